"""What the NF4 kernels share: bitsandbytes' code layout decoded tile by tile, and the operands' tiles.

Codes are uint8 [N, K/2] (or a stack [layers, N, K/2] read at a layer in place), byte i of row n holding W[n, 2i] in
the high nibble and W[n, 2i+1] in the low one; each 64 values of a row share one float32 scale, handed to the
kernels as [K/64, N] (`scales_operand`). The fused matmuls (`nf4_matmul.py`) and the dequant kernels
(`nf4_dequant.py`) both decode a tile into its two nibble planes (`nibble_planes`) at its blocks' scales
(`block_scales`), and lay out their operands the same way (`tile_spec`, `layer_operand`, ...).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.addressing import addressable

NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
BLOCK = 64  # values per absmax
BYTES_PER_BLOCK = BLOCK // 2


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """Tile sizes (powers of two) and launch parameters of one kernel call.

    block_m, block_n: output tile; block_bytes: bytes of a code row consumed per step (32 or 64, i.e. 64
    or 128 values of K); split: programs sharing one reduction (partial sums added in f32 afterwards).
    """

    block_m: int = 64
    block_n: int = 128
    block_bytes: int = 32
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # NF4 value lookup: "select" (bit tree), "gather" (16-entry table load), or "permute" (forward, bf16 x: a bf16
    # table per (row, block) read by PTX byte permutes, a code byte's 2 values in 7 permutes)
    lut: str = "select"
    # forward only, for a few rows (decoding): products and row sums on the CUDA cores instead of a tensor-core
    # dot, whose tiles need 16 rows (block_m then needs no more than the rows there are, padded to a power of 2)
    gemv: bool = False
    # forward only: the decoded weight tile as the dot's left operand (yᵀ tile = W tile @ xᵀ). Hopper's wgmma may take
    # its left operand from registers, so the decoded values need no trip through shared memory, and the weight's
    # rows fill the 64-row side of the instruction while the few rows of x fill its narrow side (8-256)
    weight_first: bool = False


# ---------------------------------------------------------------------------------------------- tile decoding


def nf4_value(nibble: jax.Array) -> jax.Array:
    """NF4 code value (float32) of 4-bit indices by a 4-level select tree: 15 selects, no memory."""
    bits = [(nibble & (1 << b)) != 0 for b in range(4)]
    level = [jnp.float32(v) for v in NF4_VALUES]
    for bit in bits:
        level = [jnp.where(bit, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]


def nf4_lookup(nibbles: jax.Array, lut_ref) -> jax.Array:
    """NF4 values (float32) of 4-bit indices: with a table ref one load from a 64-byte table (a single cache line,
    so a warp's lookups cost one L1 wavefront); without, the select tree (`nf4_value`)."""
    return nf4_value(nibbles) if lut_ref is None else lut_ref[nibbles.astype(jnp.int32)]


def nibble_planes(codes: jax.Array, scale: jax.Array, dtype, lut_ref) -> tuple[jax.Array, jax.Array]:
    """Dequantized high- and low-nibble planes [rows, cols] of a code tile (`nf4_lookup`); scale broadcasts on
    rows."""
    return ((nf4_lookup(codes >> 4, lut_ref) * scale).astype(dtype),
            (nf4_lookup(codes & 15, lut_ref) * scale).astype(dtype))


def at_layer(ref, layer_ref, index: tuple) -> jax.Array:
    """ref[index], or for a ref with one more (leading, layer) axis than `index` covers, ref[layer, *index]."""
    return ref[index] if len(ref.shape) == len(index) else ref[(layer_ref[0], *index)]


def block_scales(absmax_ref, layer_ref, byte0, rows: pl.Slice | slice, block_bytes: int, row_ref=None,
                  block_ref=None) -> list:
    """The float32 scale [rows] of each 64-block (one or two) of the code tile starting at byte `byte0` (absmax_ref
    is [K/64, N], or a stack [layers, K/64, N] read at layer_ref[0]); with row_ref ([N] or [layers, N]) each row's
    scales divided by its entry, with block_ref ([K/64] or [layers, K/64]) each block's by its entry."""
    divisor = None if row_ref is None else at_layer(row_ref, layer_ref, (rows,)).astype(jnp.float32)

    def scales(block):
        s = at_layer(absmax_ref, layer_ref, (block, rows))
        s = s if divisor is None else s / divisor
        return s if block_ref is None else s / at_layer(block_ref, layer_ref, (block,))

    return [scales(byte0 // BYTES_PER_BLOCK + b) for b in range(block_bytes // BYTES_PER_BLOCK)]


def tile_scale(absmax_ref, layer_ref, byte0, rows: pl.Slice | slice, block_bytes: int, row_ref=None,
                block_ref=None) -> jax.Array:
    """Per-(row, byte) float32 scale of the code tile starting at byte `byte0` (`block_scales`, divided before the
    broadcast over the tile's bytes: one division per row and block)."""
    return by_block(block_scales(absmax_ref, layer_ref, byte0, rows, block_bytes, row_ref, block_ref), block_bytes)


def by_block(per_block: list, width: int) -> jax.Array:
    """[rows, 1] values per 64-block of a tile row (one or two [rows] arrays) spread over the tile's `width`
    columns (one block: [rows, 1], broadcast by the caller)."""
    if len(per_block) == 1:
        return per_block[0][:, None]
    col = jnp.arange(width)[None, :]
    return jnp.where(col < width // 2, per_block[0][:, None], per_block[1][:, None])


def optional_refs(refs: tuple, stacked: bool, outputs: int, row_scaled: bool = False,
                   block_scaled: bool = False) -> tuple:
    """(layer_ref, row_scale_ref, block_scale_ref, lut_ref, *output refs) from what follows codes and absmax: the
    layer when `stacked`, the row scales when `row_scaled`, the 64-block scales when `block_scaled`, the NF4 table
    when the call passed one (None when absent)."""
    layer_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    row_ref, refs = (refs[0], refs[1:]) if row_scaled else (None, refs)
    block_ref, refs = (refs[0], refs[1:]) if block_scaled else (None, refs)
    lut_ref, refs = (refs[0], refs[1:]) if len(refs) > outputs else (None, refs)
    return (layer_ref, row_ref, block_ref, lut_ref, *refs)


# --------------------------------------------------------------------------------------------------- operands


def layer_codes(codes: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, int | None]:
    """(codes as the kernels read them, layers in the stack or None). A stack the kernels cannot address whole
    (pallas_kernels/addressing.py: 32-bit offsets) gives its layer as a copy; the other stacked operands are
    still read at the layer in place."""
    if layer is None or codes.ndim != 3:
        return codes, None
    if addressable(codes.shape, codes.dtype):
        return codes, codes.shape[0]
    return jax.lax.dynamic_index_in_dim(codes, layer, keepdims=False), codes.shape[0]


def check_weight(codes: jax.Array, absmax: jax.Array, k: int | None = None,
                 layer: jax.Array | None = None) -> tuple[int, int]:
    """(N, K) of an NF4 weight, or a ValueError naming what of codes, absmax or x's K does not fit the layout."""
    if codes.ndim != (2 if layer is None else 3) or codes.dtype != jnp.uint8:
        want = "[N, K/2]" if layer is None else "stacked [layers, N, K/2] with a layer index"
        raise ValueError(f"nf4 kernels want codes uint8 {want}, got {codes.dtype} {codes.shape}")
    n, half = codes.shape[-2:]
    if n % BLOCK or (2 * half) % BLOCK:
        raise ValueError(f"nf4 kernels need N and K multiples of {BLOCK}; got N={n}, K={2 * half}")
    blocks = 2 * half // BLOCK
    if absmax.ndim == 3 and layer is not None:
        if absmax.shape != (codes.shape[0], blocks, n):
            raise ValueError(f"stacked absmax must be float32 [layers, K/{BLOCK}, N] = "
                             f"{(codes.shape[0], blocks, n)}, got {absmax.shape}")
    elif absmax.shape != (n, blocks):
        raise ValueError(f"absmax must be float32 [N, K/{BLOCK}] = {(n, blocks)}, got {absmax.shape}")
    if k is not None and k != 2 * half:
        raise ValueError(f"x has K={k} but the NF4 weight has K={2 * half}")
    return n, 2 * half


def fit_tiles(tiles: MatmulTiles, n: int, half: int, reduce: str) -> MatmulTiles:
    """The tiles shrunk to divide this weight: block_bytes to 32 where 64 does not divide K/2, block_n halved
    until it divides N, then split halved until it divides the steps of the reduced dimension ("k": K/2 in
    block_bytes, "n": N in block_n), counted in the blocks as fitted (else a split would skip a remainder)."""
    if tiles.block_bytes not in (BYTES_PER_BLOCK, 2 * BYTES_PER_BLOCK):
        raise ValueError(f"block_bytes must be {BYTES_PER_BLOCK} or {2 * BYTES_PER_BLOCK} (one or two absmax "
                         f"blocks per tile row), got {tiles.block_bytes}")
    block_bytes = tiles.block_bytes if half % tiles.block_bytes == 0 else BYTES_PER_BLOCK
    block_n = tiles.block_n
    while n % block_n:
        block_n //= 2
    steps = half // block_bytes if reduce == "k" else n // block_n
    split = tiles.split
    while split > 1 and steps % split:
        split //= 2
    return dataclasses.replace(tiles, block_bytes=block_bytes, block_n=block_n, split=split)


def tile_spec(a: jax.Array, block: tuple[int, ...], index_map) -> pl.BlockSpec:
    """A tile `block` of a, or, for an a with one more (leading, layer) axis, the same tile in a block spanning
    the stack (read at the layer in the kernel, never sliced out of the stack)."""
    if a.ndim == len(block):
        return pl.BlockSpec(block, index_map)
    return pl.BlockSpec((a.shape[0], *block), lambda *g: (0, *index_map(*g)))


def layer_operand(layer: jax.Array | None) -> tuple[list, list]:
    """(BlockSpecs, args) of the layer index a stacked call reads its layer at."""
    if layer is None:
        return [], []
    return [pl.BlockSpec((1,), lambda *g: (0,))], [jnp.asarray(layer, jnp.int32).reshape(1)]


def vector_operand(name: str, vector: jax.Array | None, length: int, dims: str, layers: int | None, block: int,
                 index_map) -> tuple[list, list]:
    """(BlockSpecs, args) of an optional vector operand [length] (`dims` names the length, e.g. "N"), or a stack
    [layers, length] read at the layer when the call reads one layer of a stack (`layers` not None)."""
    if vector is None:
        return [], []
    allowed = [(length,)] + ([(layers, length)] if layers is not None else [])
    if tuple(vector.shape) not in allowed:
        raise ValueError(f"{name} must be [{dims}] (or [layers, {dims}] with a layer) for {dims}={length}, "
                         f"got {vector.shape}")
    return [tile_spec(vector, (block,), index_map)], [vector]


def scales_operand(absmax: jax.Array) -> jax.Array:
    """The block scales in the kernels' layout [K/64, N] (the scales of one step of K contiguous): a weight's own
    absmax [N, K/64] transposed, a prepared stack [layers, K/64, N] as it is."""
    return absmax if absmax.ndim == 3 else absmax.T


def lut_operand(lut: str) -> tuple[list, list]:
    if lut in ("select", "permute"):  # no table operand: the tree, or the per-(row, block) tables built in the kernel
        return [], []
    if lut != "gather":
        raise ValueError(f"unknown NF4 lookup {lut!r}; use 'gather', 'select' or 'permute'")
    return [pl.BlockSpec((16,), lambda *g: (0,))], [jnp.asarray(NF4_VALUES, jnp.float32)]
