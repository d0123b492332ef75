"""Fused NF4 dequant-matmul for GPU in Pallas (Triton): y = x @ dequant(W)ᵀ and dx = dy @ dequant(W).

The weight stays in bitsandbytes' byte layout: codes uint8 [N, K/2], byte i of row n holding W[n, 2i]
in the high nibble and W[n, 2i+1] in the low one. Rather than interleaving nibbles on chip, the kernels
split the contraction: x @ Wᵀ = x[:, 0::2] @ W_hiᵀ + x[:, 1::2] @ W_loᵀ. The wrapper hands the forward
kernel x with its even columns first, then its odd ones (one cheap pass over x; strided loads inside
the kernel measured 2x slower), and each nibble plane feeds a tensor-core dot directly. A 32-byte tile
covers exactly one 64-value absmax block, so one scale per row serves both planes. Dequantization
(NF4 value by a select tree on the 4 bits, times the float32 absmax, rounded to the compute dtype:
bitsandbytes' arithmetic, bit for bit) happens in registers per tile; no bf16 copy of W reaches HBM.
Small M splits the reduction across programs to fill the GPU.

`absmax` here is the per-block float32 scale [N, K/64] (double quantization already undone: a vector
1/16 the size of W's codes); with a layer index it may also be a stack prepared in the kernels' own layout
[layers, K/64, N] (`ops.prepare_kernel_scales`: done once for every layer outside the layer scan).
Also here: a dequant-only kernel (NF4 -> W in memory order, or Wᵀ, in bf16 or e4m3) for "dequantize, then
cuBLAS", and the pure-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.addressing import addressable

NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
BLOCK = 64  # values per absmax
_BYTES_PER_BLOCK = BLOCK // 2


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
    lut: str = "select"  # NF4 value lookup: "select" (bit tree) or "gather" (16-entry table load)
    # forward only, for a few rows (decoding): products and row sums on the CUDA cores instead of a tensor-core
    # dot, whose tiles need 16 rows (block_m then needs no more than the rows there are, padded to a power of 2)
    gemv: bool = False


# ------------------------------------------------------------------------------------------- reference


def nf4_dequantize_reference(codes: jax.Array, absmax: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """W [N, K] = NF4[code] * absmax (float32), cast to dtype."""
    n, half = codes.shape
    idx = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(n, 2 * half).astype(jnp.int32)
    w = jnp.asarray(NF4_VALUES, jnp.float32)[idx].reshape(n, -1, BLOCK) * absmax[:, :, None]
    return w.reshape(n, 2 * half).astype(dtype)


def nf4_matmul_reference(x: jax.Array, codes: jax.Array, absmax: jax.Array) -> jax.Array:
    """x [..., K] @ dequant(W)ᵀ with f32 accumulation, x's dtype out."""
    w = nf4_dequantize_reference(codes, absmax, x.dtype)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


# ---------------------------------------------------------------------------------------- tile helpers


def _nf4_value(nibble: jax.Array) -> jax.Array:
    """NF4 code value (float32) of 4-bit indices by a 4-level select tree: 15 selects, no memory."""
    bits = [(nibble & (1 << b)) != 0 for b in range(4)]
    level = [jnp.float32(v) for v in NF4_VALUES]
    for bit in bits:
        level = [jnp.where(bit, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]


def _planes(codes: jax.Array, scale: jax.Array, dtype, lut_ref) -> tuple[jax.Array, jax.Array]:
    """Dequantized high- and low-nibble planes [rows, cols] of a code tile; scale broadcasts on rows.

    With a table ref the NF4 value is one load from a 64-byte table (a single cache line, so a warp's
    lookups cost one L1 wavefront); without, a select tree.
    """
    if lut_ref is None:
        hi, lo = _nf4_value(codes >> 4), _nf4_value(codes & 15)
    else:
        hi, lo = lut_ref[(codes >> 4).astype(jnp.int32)], lut_ref[(codes & 15).astype(jnp.int32)]
    return (hi * scale).astype(dtype), (lo * scale).astype(dtype)


# e4m3 weights by byte permutes: the 16 e4m3 values NF4[c] * scale of a (row, 64-block) are 16 bytes in 4 registers, and
# PTX `prmt` picks 4 bytes of 8 by a selector of 4 nibbles, so 2 code bytes (4 values) become their 4 output bytes,
# in memory order, in 5 integer ops and 3 permutes instead of 4 table loads, multiplies and roundings
_E4M3_BY_PERMUTE_PTX = """{
.reg .b32 s, t, s7, s2, lo, hi;
shr.b32 t, $1, 4;
and.b32 t, t, 0x0F0F;
and.b32 s, $1, 0x0F0F;
shl.b32 s, s, 4;
or.b32 s, s, t;
and.b32 s7, s, 0x7777;
prmt.b32 lo, $2, $3, s7;
prmt.b32 hi, $4, $5, s7;
and.b32 s2, s, 0x8888;
shr.b32 s2, s2, 1;
add.u32 s2, s2, 0x3210;
prmt.b32 $0, lo, hi, s2;
}"""


def _prmt(a: jax.Array, b: jax.Array, selector: jax.Array) -> jax.Array:
    """PTX `prmt.b32` (default mode, selector nibbles below 8): byte i of the result is byte (nibble i of the
    selector) of the 8 bytes of b:a. The interpreter's stand-in for the instruction."""
    out = jnp.zeros_like(a)
    for i in range(4):
        index = (selector >> (4 * i)) & 7
        byte = jnp.zeros_like(a)
        for j in range(8):
            byte = jnp.where(index == j, ((a if j < 4 else b) >> (8 * (j % 4))) & 0xFF, byte)
        out = out | (byte << (8 * i))
    return out


def _e4m3_by_permute(codes16: jax.Array, table: tuple, interpret: bool) -> jax.Array:
    """uint32 words of 4 e4m3 values in memory order from uint32 holding 2 code bytes each (low 16 bits) and the
    4 table words of each element's (row, block); the PTX above on a GPU, the same steps in jnp when interpreted."""
    if not interpret:  # declared int32: Triton takes signless integer results only
        [out] = pltriton.elementwise_inline_asm(
            _E4M3_BY_PERMUTE_PTX, args=[codes16, *table], constraints="=r,r,r,r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(codes16.shape, jnp.int32)])
        return jax.lax.bitcast_convert_type(out, jnp.uint32)
    selector = ((codes16 & 0x0F0F) << 4) | ((codes16 >> 4) & 0x0F0F)  # nibbles hi0, lo0, hi1, lo1
    lo = _prmt(table[0], table[1], selector & 0x7777)
    hi = _prmt(table[2], table[3], selector & 0x7777)
    return _prmt(lo, hi, ((selector & 0x8888) >> 1) + 0x3210)


def _e4m3_table(scale: jax.Array) -> tuple:
    """The 4 uint32 words whose bytes are e4m3(NF4[c] * scale) for c = 0..15 (scale float32, any shape): the
    rounding the other paths do per value, done 16 times per (row, block)."""
    words = []
    for w in range(4):
        word = None
        for b in range(4):
            value = (jnp.float32(NF4_VALUES[4 * w + b]) * scale).astype(jnp.float8_e4m3fn)
            byte = jax.lax.bitcast_convert_type(value, jnp.uint8).astype(jnp.uint32) << (8 * b)
            word = byte if word is None else word | byte
        words.append(word)
    return tuple(words)


def _at_layer(ref, layer_ref, index: tuple) -> jax.Array:
    """ref[index], or for a ref with one more (leading, layer) axis than `index` covers, ref[layer, *index]."""
    return ref[index] if len(ref.shape) == len(index) else ref[(layer_ref[0], *index)]


def _block_scales(absmax_ref, layer_ref, byte0, rows: pl.Slice | slice, block_bytes: int, row_ref=None,
                  block_ref=None) -> list:
    """The float32 scale [rows] of each 64-block (one or two) of the code tile starting at byte `byte0` (absmax_ref
    is [K/64, N], or a stack [layers, K/64, N] read at layer_ref[0]); with row_ref ([N] or [layers, N]) each row's
    scales divided by its entry, with block_ref ([K/64] or [layers, K/64]) each block's by its entry."""
    divisor = None if row_ref is None else _at_layer(row_ref, layer_ref, (rows,)).astype(jnp.float32)

    def scales(block):
        s = _at_layer(absmax_ref, layer_ref, (block, rows))
        s = s if divisor is None else s / divisor
        return s if block_ref is None else s / _at_layer(block_ref, layer_ref, (block,))

    return [scales(byte0 // _BYTES_PER_BLOCK + b) for b in range(block_bytes // _BYTES_PER_BLOCK)]


def _tile_scale(absmax_ref, layer_ref, byte0, rows: pl.Slice | slice, block_bytes: int, row_ref=None,
                block_ref=None) -> jax.Array:
    """Per-(row, byte) float32 scale of the code tile starting at byte `byte0` (`_block_scales`, divided before the
    broadcast over the tile's bytes: one division per row and block)."""
    return _by_block(_block_scales(absmax_ref, layer_ref, byte0, rows, block_bytes, row_ref, block_ref), block_bytes)


def _by_block(per_block: list, width: int) -> jax.Array:
    """[rows, 1] values per 64-block of a tile row (one or two [rows] arrays) spread over the tile's `width`
    columns (one block: [rows, 1], broadcast by the caller)."""
    if len(per_block) == 1:
        return per_block[0][:, None]
    col = jnp.arange(width)[None, :]
    return jnp.where(col < width // 2, per_block[0][:, None], per_block[1][:, None])


# ---------------------------------------------------------------------------------------------- kernels


def _optional_refs(refs: tuple, stacked: bool, outputs: int, row_scaled: bool = False,
                   block_scaled: bool = False) -> tuple:
    """(layer_ref, row_scale_ref, block_scale_ref, lut_ref, *output refs) from what follows codes and absmax: the
    layer when `stacked`, the row scales when `row_scaled`, the 64-block scales when `block_scaled`, the NF4 table
    when the call passed one (None when absent)."""
    layer_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    row_ref, refs = (refs[0], refs[1:]) if row_scaled else (None, refs)
    block_ref, refs = (refs[0], refs[1:]) if block_scaled else (None, refs)
    lut_ref, refs = (refs[0], refs[1:]) if len(refs) > outputs else (None, refs)
    return (layer_ref, row_ref, block_ref, lut_ref, *refs)


def _matmul_kernel(x_ref, codes_ref, absmax_ref, *refs, half, block_bytes, steps, stacked, gemv):
    """y tile [bm, bn] (+= over this program's share of K) = x_even @ W_hiᵀ + x_odd @ W_loᵀ (`gemv`: products
    accumulated elementwise in float32 over the steps, no tensor-core dot, and summed over the tile's bytes once
    at the end: a sum per step costs a cross-thread reduction per step)."""
    layer_ref, _, _, lut_ref, y_ref = _optional_refs(refs, stacked, 1)
    s = pl.program_id(2)
    bm, bn = y_ref.shape
    rows = slice(None)

    def body(t, acc):
        byte0 = (s * steps + t) * block_bytes
        codes = _at_layer(codes_ref, layer_ref, (slice(None), pl.ds(byte0, block_bytes)))
        scale = _tile_scale(absmax_ref, layer_ref, byte0, rows, block_bytes)
        w_hi, w_lo = _planes(codes, scale, jnp.float32 if gemv else x_ref.dtype, lut_ref)
        x_even = x_ref[:, pl.ds(byte0, block_bytes)]
        x_odd = x_ref[:, pl.ds(half + byte0, block_bytes)]
        if gemv:  # [bm, bn, block_bytes] products
            x_even, x_odd = x_even.astype(jnp.float32)[:, None, :], x_odd.astype(jnp.float32)[:, None, :]
            return acc + x_even * w_hi[None] + x_odd * w_lo[None]
        acc = acc + pltriton.dot(x_even, w_hi, trans_b=True)
        return acc + pltriton.dot(x_odd, w_lo, trans_b=True)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn, block_bytes) if gemv else (bm, bn), jnp.float32))
    y_ref[...] = (jnp.sum(acc, axis=2) if gemv else acc).astype(y_ref.dtype)


def _matmul_t_kernel(dy_ref, codes_ref, absmax_ref, *refs, block_n, block_bytes, steps, stacked):
    """dx tiles [bm, block_bytes] of the even and odd columns: dy @ W_hi and dy @ W_lo over N."""
    layer_ref, _, _, lut_ref, dx_even_ref, dx_odd_ref = _optional_refs(refs, stacked, 2)
    j = pl.program_id(1)
    s = pl.program_id(2)
    bm = dy_ref.shape[0]
    byte0 = j * block_bytes

    def body(t, carry):
        acc_even, acc_odd = carry
        n0 = (s * steps + t) * block_n
        rows = pl.ds(n0, block_n)
        codes = _at_layer(codes_ref, layer_ref, (rows, slice(None)))
        scale = _tile_scale(absmax_ref, layer_ref, byte0, rows, block_bytes)
        w_hi, w_lo = _planes(codes, scale, dy_ref.dtype, lut_ref)
        dy = dy_ref[:, rows]
        return acc_even + pltriton.dot(dy, w_hi), acc_odd + pltriton.dot(dy, w_lo)

    zeros = jnp.zeros((bm, block_bytes), jnp.float32)
    acc_even, acc_odd = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    dx_even_ref[...] = acc_even.astype(dx_even_ref.dtype)
    dx_odd_ref[...] = acc_odd.astype(dx_odd_ref.dtype)


def _dequant_kernel(codes_ref, absmax_ref, *refs, block_bytes, interleave, transpose, stacked, row_scaled,
                    block_scaled, column_axis, paired):
    """W tile [bn, 2 * block_bytes] in memory order: the planes go to even/odd columns, either interleaved in
    registers and stored contiguously (`interleave`), or by two strided stores; `transpose`: the Wᵀ tile, whose
    even / odd rows are the planes.
    `paired`: codes_ref holds the codes as uint16 pairs of bytes (`_as_pairs`): `_dequant_pairs` writes the tile;
    `stacked`: codes_ref spans every layer of a stack and the first of `refs` holds the layer to read;
    `row_scaled`: each row's block scales are divided by that row's entry of the next ref (FP8's power of two);
    `block_scaled`: each 64-block's by its entry of the ref after that (FP8's scales per input block, for Wᵀ)."""
    layer_ref, row_ref, block_ref, lut_ref, w_ref = _optional_refs(refs, stacked, 1, row_scaled, block_scaled)
    j = pl.program_id(column_axis)
    codes = _at_layer(codes_ref, layer_ref, (slice(None), slice(None)))
    per_block = _block_scales(absmax_ref, layer_ref, j * block_bytes, slice(None), block_bytes, row_ref, block_ref)
    if paired:
        _dequant_pairs(codes, per_block, w_ref, lut_ref, interleave, transpose)
        return
    w_hi, w_lo = _planes(codes, _by_block(per_block, block_bytes), w_ref.dtype, lut_ref)
    if transpose:  # each plane's transpose to the even / odd rows: no interleave before the transpose (e4m3
        # alone 1.1-1.5x faster, in the training step the same: benchmarks/results/2026-11-23-stacked-codes-h200.md)
        w_ref[pl.ds(0, block_bytes, stride=2), :] = w_hi.T
        w_ref[pl.ds(1, block_bytes, stride=2), :] = w_lo.T
    elif interleave:
        w_ref[...] = jnp.stack([w_hi, w_lo], axis=-1).reshape(w_hi.shape[0], 2 * block_bytes)
    else:
        w_ref[:, pl.ds(0, block_bytes, stride=2)] = w_hi
        w_ref[:, pl.ds(1, block_bytes, stride=2)] = w_lo


def _dequant_pairs(words, per_block: list, w_ref, lut_ref, interleave: bool, transpose: bool) -> None:
    """The W (or Wᵀ) tile of a tile of uint16 pairs [bn, cols] (`per_block`: its 64-blocks' scales): word m holds
    W's columns 4m .. 4m + 3 as the high and low nibbles of its low byte, then of its high byte. Its four planes
    are dequantized apart and interleaved in registers (two levels of pairs), then stored contiguously: faster
    than reading bytes (benchmarks/results/2026-11-26-32b-pairs-h100.md), where rebuilding the bytes from the
    words first was 12% slower and four strided stores (`interleave=False`) 2.9x slower."""
    rows, cols = words.shape
    scale = _by_block(per_block, cols)
    nibbles = ((words >> 4) & 15, words & 15, (words >> 12) & 15, (words >> 8) & 15)
    planes = [((_nf4_value(c) if lut_ref is None else lut_ref[c.astype(jnp.int32)]) * scale).astype(w_ref.dtype)
              for c in nibbles]
    if transpose:
        for c, plane in enumerate(planes):
            w_ref[pl.ds(c, cols, stride=4), :] = plane.T
    elif interleave:  # [rows, cols, byte, nibble]: column 4m + 2 * byte + nibble
        high, low = jnp.stack([planes[0], planes[2]], axis=-1), jnp.stack([planes[1], planes[3]], axis=-1)
        w_ref[...] = jnp.stack([high, low], axis=-1).reshape(rows, 4 * cols)
    else:
        for c, plane in enumerate(planes):
            w_ref[:, pl.ds(c, cols, stride=4)] = plane


def _dequant_e4m3_kernel(codes_ref, absmax_ref, *refs, block_bytes, stacked, row_scaled, block_scaled,
                         column_axis, transpose, interpret):
    """e4m3 W tile in memory order as uint32 words [bn, block_bytes / 2], each from one uint16 of codes (2 code
    bytes): a 16-entry byte table per (row, block) and byte permutes (`_e4m3_by_permute`). `transpose`: the Wᵀ
    tile [2 * block_bytes, bn] of bytes instead, byte j of every word going to the rows j, j + 4, ..."""
    layer_ref, row_ref, block_ref, _, w_ref = _optional_refs(refs, stacked, 1, row_scaled, block_scaled)
    j = pl.program_id(column_axis)
    codes16 = _at_layer(codes_ref, layer_ref, (slice(None), slice(None))).astype(jnp.uint32)
    tables = [_e4m3_table(s) for s in _block_scales(absmax_ref, layer_ref, j * block_bytes, slice(None), block_bytes,
                                                    row_ref, block_ref)]
    width = codes16.shape[1]
    table = tuple(jnp.broadcast_to(_by_block([t[w] for t in tables], width), codes16.shape) for w in range(4))
    words = _e4m3_by_permute(codes16, table, interpret)
    if not transpose:
        w_ref[...] = words
        return
    for byte in range(4):
        plane = ((words >> (8 * byte)) & 0xFF).astype(jnp.uint8)
        w_ref[pl.ds(byte, width, stride=4), :] = plane.T


# ---------------------------------------------------------------------------------------------- wrappers


def _as_pairs(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., half] as uint16 pairs [..., half / 2], the first byte in the low half (a bitcast)."""
    return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), jnp.uint16)


def _dequant_operand(codes: jax.Array, layer: jax.Array | None, permute: bool,
                     pairs: bool = False) -> tuple[jax.Array, bool]:
    """(the codes operand of the dequant kernels, whether as uint16 pairs). The e4m3 permutes read pairs. A stack
    past 32-bit byte offsets (pallas_kernels/addressing.py) is read as pairs too: half the elements, so every
    stack up to 4 GiB is addressed whole, in place (a copy of the layer cost 31 ms of a 1.12 s Qwen3-32B step:
    benchmarks/results/2026-11-26-32b-pairs-h100.md); only past what pairs reach is the layer copied out.
    `pairs=True`: pairs whatever the operand (benchmarks, tests)."""
    if pairs:
        return _as_pairs(codes), True
    if layer is not None and not addressable(codes.shape, codes.dtype):
        if addressable((*codes.shape[:-1], codes.shape[-1] // 2), jnp.uint16):
            return _as_pairs(codes), True
        codes, _ = _layer_codes(codes, layer)
    return (_as_pairs(codes), True) if permute else (codes, False)


def _layer_codes(codes: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, int | None]:
    """(codes as the kernels read them, layers in the stack or None). A stack the kernels cannot address whole
    (pallas_kernels/addressing.py: 32-bit offsets) gives its layer as a copy; the other stacked operands are
    still read at the layer in place."""
    if layer is None or codes.ndim != 3:
        return codes, None
    if addressable(codes.shape, codes.dtype):
        return codes, codes.shape[0]
    return jax.lax.dynamic_index_in_dim(codes, layer, keepdims=False), codes.shape[0]


def _check(codes: jax.Array, absmax: jax.Array, k: int | None = None,
           layer: jax.Array | None = None) -> tuple[int, int]:
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


def _fit(tiles: MatmulTiles, n: int, half: int, reduce: str) -> MatmulTiles:
    """The tiles shrunk to divide this weight: block_bytes to 32 where 64 does not divide K/2, block_n halved
    until it divides N, then split halved until it divides the steps of the reduced dimension ("k": K/2 in
    block_bytes, "n": N in block_n), counted in the blocks as fitted (else a split would skip a remainder)."""
    if tiles.block_bytes not in (_BYTES_PER_BLOCK, 2 * _BYTES_PER_BLOCK):
        raise ValueError(f"block_bytes must be {_BYTES_PER_BLOCK} or {2 * _BYTES_PER_BLOCK} (one or two absmax "
                         f"blocks per tile row), got {tiles.block_bytes}")
    block_bytes = tiles.block_bytes if half % tiles.block_bytes == 0 else _BYTES_PER_BLOCK
    block_n = tiles.block_n
    while n % block_n:
        block_n //= 2
    steps = half // block_bytes if reduce == "k" else n // block_n
    split = tiles.split
    while split > 1 and steps % split:
        split //= 2
    return dataclasses.replace(tiles, block_bytes=block_bytes, block_n=block_n, split=split)


def _spec(a: jax.Array, block: tuple[int, ...], index_map) -> pl.BlockSpec:
    """A tile `block` of a, or, for an a with one more (leading, layer) axis, the same tile in a block spanning
    the stack (read at the layer in the kernel, never sliced out of the stack)."""
    if a.ndim == len(block):
        return pl.BlockSpec(block, index_map)
    return pl.BlockSpec((a.shape[0], *block), lambda *g: (0, *index_map(*g)))


def _layer_args(layer: jax.Array | None) -> tuple[list, list]:
    """(BlockSpecs, args) of the layer index a stacked call reads its layer at."""
    if layer is None:
        return [], []
    return [pl.BlockSpec((1,), lambda *g: (0,))], [jnp.asarray(layer, jnp.int32).reshape(1)]


def _vector_args(name: str, vector: jax.Array | None, length: int, dims: str, layers: int | None, block: int,
                 index_map) -> tuple[list, list]:
    """(BlockSpecs, args) of an optional vector operand [length] (`dims` names the length, e.g. "N"), or a stack
    [layers, length] read at the layer when the call reads one layer of a stack (`layers` not None)."""
    if vector is None:
        return [], []
    allowed = [(length,)] + ([(layers, length)] if layers is not None else [])
    if tuple(vector.shape) not in allowed:
        raise ValueError(f"{name} must be [{dims}] (or [layers, {dims}] with a layer) for {dims}={length}, "
                         f"got {vector.shape}")
    return [_spec(vector, (block,), index_map)], [vector]


def _scales_operand(absmax: jax.Array) -> jax.Array:
    """The block scales in the kernels' layout [K/64, N] (the scales of one step of K contiguous): a weight's own
    absmax [N, K/64] transposed, a prepared stack [layers, K/64, N] as it is."""
    return absmax if absmax.ndim == 3 else absmax.T


def _lut_args(lut: str) -> tuple[list, list]:
    if lut == "select":
        return [], []
    if lut != "gather":
        raise ValueError(f"unknown NF4 lookup {lut!r}; use 'gather' or 'select'")
    return [pl.BlockSpec((16,), lambda *g: (0,))], [jnp.asarray(NF4_VALUES, jnp.float32)]


def _split_even_odd(x: jax.Array) -> jax.Array:
    """x with its even columns first, then its odd ones: contiguous operands for the two nibble planes
    (strided loads inside the kernel measured 2x slower: they defeat Triton's async copies)."""
    return jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def _pad_rows(x: jax.Array, block: int) -> jax.Array:
    m = x.shape[0]
    mp = pl.cdiv(m, block) * block
    return x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))


def nf4_matmul_forward(x: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
                       layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """y [..., N] = x [..., K] @ dequant(W)ᵀ, fused (no gradient rule: see `nf4_matmul`). With `layer`, codes
    is a stack [layers, N, K/2] read at that layer in place."""
    lead, k = x.shape[:-1], x.shape[-1]
    n, _ = _check(codes, absmax, k, layer)
    codes, _ = _layer_codes(codes, layer)
    half = k // 2
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    tiles = _fit(tiles, n, half, "k")
    bm, bn, bb, split = tiles.block_m, tiles.block_n, tiles.block_bytes, tiles.split
    if tiles.gemv:  # no tensor-core tile to fill: as few rows as there are
        bm = min(bm, pl.next_power_of_2(m))
    steps = half // bb // split
    xp = _pad_rows(_split_even_odd(x2), bm)
    mp = xp.shape[0]
    out_dtype = x.dtype if split == 1 else jnp.float32
    lut_specs, lut_args = _lut_args(tiles.lut)
    layer_specs, layer_args = _layer_args(layer)
    scales = _scales_operand(absmax)
    y = pl.pallas_call(
        functools.partial(_matmul_kernel, half=half, block_bytes=bb, steps=steps, stacked=layer is not None,
                          gemv=tiles.gemv),
        grid=(mp // bm, n // bn, split),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
            _spec(codes, (bn, half), lambda i, j, s: (j, 0)),
            _spec(scales, (k // BLOCK, bn), lambda i, j, s: (0, j)),
            *layer_specs,
            *lut_specs,
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split, mp, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="nf4_matmul",
    )(xp, codes, scales, *layer_args, *lut_args)
    y = y[0] if split == 1 else y.sum(axis=0).astype(x.dtype)
    return y[:m].reshape(*lead, n)


def nf4_matmul_dx(dy: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
                  layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """dx [..., K] = dy [..., N] @ dequant(W), fused (with `layer`: codes stacked, read at that layer)."""
    n, k = _check(codes, absmax, layer=layer)
    codes, _ = _layer_codes(codes, layer)
    if dy.shape[-1] != n:
        raise ValueError(f"dy has N={dy.shape[-1]} but the NF4 weight has N={n}")
    if tiles.gemv:
        raise ValueError("gemv tiles are for the forward kernel; dx takes tensor-core tiles")
    lead = dy.shape[:-1]
    half = k // 2
    dy2 = dy.reshape(-1, n)
    m = dy2.shape[0]
    tiles = _fit(tiles, n, half, "n")
    bm, bn, bb, split = tiles.block_m, tiles.block_n, tiles.block_bytes, tiles.split
    steps = n // bn // split
    dyp = _pad_rows(dy2, bm)
    mp = dyp.shape[0]
    out_dtype = dy.dtype if split == 1 else jnp.float32
    lut_specs, lut_args = _lut_args(tiles.lut)
    layer_specs, layer_args = _layer_args(layer)
    scales = _scales_operand(absmax)
    dx_even, dx_odd = pl.pallas_call(
        functools.partial(_matmul_t_kernel, block_n=bn, block_bytes=bb, steps=steps, stacked=layer is not None),
        grid=(mp // bm, half // bb, split),
        in_specs=[
            pl.BlockSpec((bm, n), lambda i, j, s: (i, 0)),
            _spec(codes, (n, bb), lambda i, j, s: (0, j)),
            _spec(scales, (k // BLOCK, n), lambda i, j, s: (0, 0)),
            *layer_specs,
            *lut_specs,
        ],
        out_specs=[pl.BlockSpec((None, bm, bb), lambda i, j, s: (s, i, j))] * 2,
        out_shape=[jax.ShapeDtypeStruct((split, mp, half), out_dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="nf4_matmul_dx",
    )(dyp, codes, scales, *layer_args, *lut_args)
    if split > 1:
        dx_even, dx_odd = dx_even.sum(axis=0), dx_odd.sum(axis=0)
    else:
        dx_even, dx_odd = dx_even[0], dx_odd[0]
    dx = jnp.stack([dx_even[:m], dx_odd[:m]], axis=-1).reshape(m, k).astype(dy.dtype)
    return dx.reshape(*lead, k)


def nf4_dequantize(codes: jax.Array, absmax: jax.Array, dtype=jnp.bfloat16, *, block_n: int = 64,
                   block_bytes: int = 64, num_warps: int = 4, lut: str = "gather", interleave: bool = True,
                   transpose: bool = False, layer: jax.Array | None = None, row_scale: jax.Array | None = None,
                   block_scale: jax.Array | None = None, columns_first: bool = True, permute: bool = False,
                   pairs: bool = False, interpret: bool = False) -> jax.Array:
    """W [N, K] (or Wᵀ [K, N] with `transpose`) in dtype from NF4 codes and float32 absmax (for "dequantize,
    then cuBLAS"; float8 dtypes give the FP8 path its operand, Wᵀ the K-major one its input gradient needs).

    With `layer` (an int32 scalar), `codes` is a stack [layers, N, K/2] read in place at that layer: inside a
    layer scan a slice of the stack handed to a custom call is a copy of the whole weight's codes (`absmax`
    then either this layer's [N, K/64] or the prepared stack [layers, K/64, N]); a stack the kernel cannot
    address whole (pallas_kernels/addressing.py) is read as uint16 pairs of bytes instead (`_dequant_operand`).
    `row_scale` [N] (or [layers, N] with `layer`): W's rows divided by it, as `NF4[code] * (absmax / row_scale)`
    (FP8's power-of-two scales);
    `block_scale` [K/64] (or [layers, K/64]): each 64-block of W's columns divided by its entry the same way (FP8's
    scales per input block, which leave Wᵀ's contraction axis unscaled).
    `columns_first`: consecutive programs take consecutive tiles along a row of codes (the launch grid's fastest
    axis), so the programs in flight read and write whole rows, instead of one tile column down all rows.
    `permute` (e4m3 only, W or Wᵀ; `lut` and `interleave` do not apply): each (row, block)'s 16 possible e4m3
    values are rounded once into a byte table and every pair of code bytes becomes 4 output bytes by byte permutes
    (`_e4m3_by_permute`); the same bits as the per-value path, 1.07-1.24x faster on the 8B shapes but for down's
    Wᵀ (0.97x), and 1.2x for W in the training step
    (benchmarks/results/2026-11-24-fp8-block-scales-and-permute-h200.md).
    `pairs`: the codes read as uint16 pairs of bytes always, not only where a stack needs it (`_dequant_operand`).

    Defaults from benchmarks/results/2026-11-22-dense-step-round2-h200.md (planes interleaved in registers and
    stored contiguously: 1.4-1.5x faster than two strided stores on the 8B shapes) and
    2026-11-24-dequant-launch-order-h200.md (64-row tiles, 4 warps, launched along rows of codes: gate/up 5-13%
    faster than 128-row tiles launched down columns)."""
    n, k = _check(codes, absmax, layer=layer)
    layers = codes.shape[0] if layer is not None else None
    operand, paired = _dequant_operand(codes, layer, permute, pairs)
    half = k // 2
    tiles = _fit(MatmulTiles(block_n=block_n, block_bytes=block_bytes), n, half, "k")
    bn, bb = tiles.block_n, tiles.block_bytes
    if permute and jnp.dtype(dtype) != jnp.float8_e4m3fn:
        raise ValueError(f"permute writes e4m3 through byte tables: dtype must be float8_e4m3fn, got {dtype}")
    layer_specs, layer_args = _layer_args(layer)
    scales = _scales_operand(absmax)
    # the index maps below take (row block i, byte block j); `by_tile` adapts them to the grid's axis order
    grid, by_tile = ((half // bb, n // bn), lambda f: lambda j, i: f(i, j)) if columns_first else (
        (n // bn, half // bb), lambda f: f)
    row_specs, row_args = _vector_args("row_scale", row_scale, n, "N", layers, bn, by_tile(lambda i, j: (i,)))
    block_specs, block_args = _vector_args("block_scale", block_scale, k // BLOCK, f"K/{BLOCK}", layers, k // BLOCK,
                                           lambda *g: (0,))
    if permute:  # the codes as uint16 pairs; W as uint32 words, Wᵀ as bytes
        operand_block, lut_specs, lut_args = (bn, bb // 2), [], []
        kernel = functools.partial(_dequant_e4m3_kernel, transpose=transpose, interpret=interpret)
        out_shape, out_dtype, out_block = ((k, n), jnp.uint8, (2 * bb, bn)) if transpose else (
            (n, k // 4), jnp.uint32, (bn, bb // 2))
    else:
        operand_block = (bn, bb // 2) if paired else (bn, bb)
        lut_specs, lut_args = _lut_args(lut)
        kernel = functools.partial(_dequant_kernel, interleave=interleave, transpose=transpose, paired=paired)
        out_shape, out_dtype, out_block = ((k, n), dtype, (2 * bb, bn)) if transpose else ((n, k), dtype, (bn, 2 * bb))
    out = pl.pallas_call(
        functools.partial(kernel, block_bytes=bb, stacked=layer is not None, row_scaled=bool(row_args),
                          block_scaled=bool(block_args), column_axis=0 if columns_first else 1),
        grid=grid,
        in_specs=[
            _spec(operand, operand_block, by_tile(lambda i, j: (i, j))),
            _spec(scales, (k // BLOCK, bn), by_tile(lambda i, j: (0, i))),
            *layer_specs,
            *row_specs,
            *block_specs,
            *lut_specs,
        ],
        out_specs=pl.BlockSpec(out_block, by_tile(lambda i, j: (j, i) if transpose else (i, j))),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="nf4_dequantize_e4m3" if permute else "nf4_dequantize",
    )(operand, scales, *layer_args, *row_args, *block_args, *lut_args)
    if not permute:
        return out
    raw = out if transpose else jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(n, k)
    return jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)


# ------------------------------------------------------------------------------------------ custom VJP


def _zero_like(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret):
    return nf4_matmul_forward(x, codes, absmax, tiles=tiles, interpret=interpret)


def _nf4_matmul_fwd(x, codes, absmax, tiles, dx_tiles, interpret):
    return _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret), (codes, absmax)


def _nf4_matmul_bwd(tiles, dx_tiles, interpret, res, dy):
    codes, absmax = res
    dx = nf4_matmul_dx(dy, codes, absmax, tiles=dx_tiles, interpret=interpret)
    return dx, _zero_like(codes), _zero_like(absmax)


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


def nf4_matmul(x: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
               dx_tiles: MatmulTiles = MatmulTiles(block_m=64, block_n=64, block_bytes=32),
               interpret: bool = False) -> jax.Array:
    """x @ dequant(W)ᵀ with a fused backward dx = dy @ dequant(W); W is frozen (zero cotangents)."""
    return _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret)
