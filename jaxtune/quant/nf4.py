"""4-bit NormalFloat (NF4) weights, byte-compatible with bitsandbytes (blocksize 64, double quantization).

Format (bitsandbytes `quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)`):
W [out, in] is flattened row-major into blocks of 64; each block keeps absmax = max|x|; each value becomes
the index of the NF4 code nearest to x * (1 / absmax) (ties to the lower code); two indices per byte, the
FIRST value in the HIGH nibble. The absmax vector is then shifted by offset = mean(absmax) and quantized
blockwise (256 per block) with bitsandbytes' signed 8-bit dynamic map, keeping one fp32 absmax2 per block.
Dequantization: absmax = dynamic[q] * absmax2 + offset; w = NF4[code] * absmax.

jaxtune keeps exactly these arrays (packed bytes reshaped to [out, in // 2]), so bnb tensors import and
export without requantization. The one value whose last bit depends on the implementation is the offset
(a float32 mean: torch CPU, torch CUDA and numpy sum in different orders); jaxtune computes it with a
float64 accumulator, correctly rounded, and accepts any given offset when importing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import CheckpointError

BLOCK = 64
NESTED_BLOCK = 256
NF4_CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)
BNB_TENSOR_NAMES = ("weight", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")


@lru_cache(maxsize=1)
def dynamic_map() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (256 sorted float32 values), computed in float64 then rounded.

    bnb builds it with float32 torch ops whose last bit depends on the CPU's vector width, so maps written
    by different machines can differ by one ulp; imported weights keep the map they were written with.
    """
    max_exponent_bits = 7
    data: list[float] = [0.0, 1.0]
    for i in range(max_exponent_bits):
        items = 2**i + 1
        bounds = 0.1 + 0.9 * np.arange(items, dtype=np.float64) / (items - 1)
        means = (bounds[:-1] + bounds[1:]) / 2
        scale = 10.0 ** (-(max_exponent_bits - 1) + i)
        data += (means * scale).tolist() + (-means * scale).tolist()
    return np.array(sorted(data), dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclass
class NF4Weight:
    """The arrays of one NF4 weight (or a stack of them, with leading axes): all that bnb serializes."""

    codes: jax.Array | np.ndarray  # uint8 [..., out, in // 2], first value in the high nibble
    absmax_codes: jax.Array | np.ndarray  # uint8 [..., out * in // 64]
    nested_absmax: jax.Array | np.ndarray  # float32 [..., ceil(out * in / 64 / 256)]
    offset: jax.Array | np.ndarray  # float32 [...]
    nested_map: jax.Array | np.ndarray  # float32 [..., 256]: the 8-bit dynamic map the absmax codes index
    # set inside the layer scan: `codes` is then the whole stack [layers, out, in // 2] (read in place by the
    # dequant kernel, never sliced into a copy) and this weight is its layer `layer`
    layer: jax.Array | None = None
    # prepared for the Pallas kernels once per call, outside the layer scan (`ops.prepare_kernel_scales`), and
    # stacked like the codes: the block scales in the kernels' layout [layers, K/64, N] and, for FP8, each row's
    # power-of-two scale [layers, N] and each input block's [layers, K/64]
    kernel_absmax: jax.Array | None = None
    fp8_scale: jax.Array | None = None
    fp8_block_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[-2], self.codes.shape[-1] * 2

    def own_codes(self) -> jax.Array:
        """This weight's codes: the stack's layer `layer` when the codes are a stack."""
        if self.layer is None:
            return jnp.asarray(self.codes)
        return jax.lax.dynamic_index_in_dim(jnp.asarray(self.codes), self.layer, keepdims=False)


def _check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or shape[1] % BLOCK:
        raise ValueError(f"NF4 weights must be 2-D [out, in] with in a multiple of {BLOCK}; got shape {tuple(shape)}")


def _absmax_and_codes(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    blocks = w.astype(jnp.float32).reshape(-1, BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    scaled = jnp.clip(blocks * (1.0 / jnp.maximum(absmax, 1e-38))[:, None], -1.0, 1.0)
    bounds = jnp.asarray((NF4_CODE[:-1] + NF4_CODE[1:]) / 2)
    idx = jnp.sum(scaled[..., None] > bounds, axis=-1).astype(jnp.uint8).reshape(w.shape)
    packed = (idx[:, 0::2] << 4) | idx[:, 1::2]
    return absmax, packed


def _quantize_absmax(absmax: jax.Array, offset: jax.Array, code: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bnb `quantize_blockwise(absmax - offset, blocksize=256)` with the dynamic map."""
    x = absmax - offset
    n = x.shape[0]
    nb = -(-n // NESTED_BLOCK)
    padded = jnp.pad(x, (0, nb * NESTED_BLOCK - n))
    blocks = padded.reshape(nb, NESTED_BLOCK)
    # a partial last block takes its absmax over its real values only (padding is zeros: no effect)
    nested = jnp.max(jnp.abs(blocks), axis=1)
    scaled = jnp.clip(blocks * (1.0 / nested)[:, None], -1.0, 1.0).reshape(-1)[:n]
    bounds = (code[:-1] + code[1:]) / 2
    q = jnp.searchsorted(bounds, scaled, side="left").astype(jnp.uint8)
    return q, nested


def _double_quantized(packed, absmax, offset, nested_map) -> NF4Weight:
    code = jnp.asarray(dynamic_map() if nested_map is None else nested_map, jnp.float32)
    q, nested = _quantize_absmax(absmax, offset, code)
    return NF4Weight(packed, q, nested, offset, code)


def quantize_traced(w: jax.Array, offset: jax.Array | None = None, nested_map: jax.Array | None = None) -> NF4Weight:
    """Traceable NF4 quantization (inside jit/vmap); without `offset` the mean is a float32 reduction."""
    absmax, packed = _absmax_and_codes(w)
    offset = jnp.mean(absmax) if offset is None else jnp.asarray(offset, jnp.float32)
    return _double_quantized(packed, absmax, offset, nested_map)


_nf4_codes = jax.jit(_absmax_and_codes)
_double_quantized_jit = jax.jit(_double_quantized)


def quantize(
    w: np.ndarray | jax.Array, *, offset: float | None = None, nested_map: np.ndarray | None = None
) -> NF4Weight:
    """NF4 double-quantized arrays of W [out, in] exactly as bitsandbytes computes them.

    Runs on the default JAX device. `offset` and `nested_map` override the two float constants whose last
    bit depends on the implementation (to reproduce a given bnb state bit for bit).
    """
    _check_shape(tuple(w.shape))
    absmax, packed = _nf4_codes(jnp.asarray(w))  # computed once; only the small absmax vector visits the host
    if offset is None:
        offset = np.asarray(absmax, np.float64).mean()  # float64 accumulation, correctly rounded to float32
    return _double_quantized_jit(packed, absmax, jnp.float32(offset),
                                 None if nested_map is None else jnp.asarray(nested_map))


def dequantize_absmax(q: NF4Weight) -> jax.Array:
    """float32 absmax per 64-block, [..., out * in // 64]."""
    code2 = jnp.asarray(q.nested_map)
    n = q.absmax_codes.shape[-1]
    nested = jnp.asarray(q.nested_absmax)
    # each nested scale covers 256 consecutive blocks: a broadcast, not jnp.repeat (whose index tables XLA
    # constant-folds for seconds at 8B sizes)
    scale = jnp.broadcast_to(nested[..., None], (*nested.shape, NESTED_BLOCK)).reshape(*nested.shape[:-1], -1)[..., :n]
    idx = jnp.asarray(q.absmax_codes).astype(jnp.int32)
    values = jnp.take_along_axis(code2, idx, axis=-1) if code2.ndim > 1 else code2[idx]
    return values * scale + jnp.asarray(q.offset)[..., None]


def dequantize(q: NF4Weight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """W [..., out, in] from NF4 arrays: NF4[code] * absmax (float32 math, as bnb), cast to dtype."""
    codes = q.own_codes()
    out, half = codes.shape[-2:]
    idx = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(*codes.shape[:-1], half * 2)
    values = jnp.asarray(NF4_CODE)[idx.astype(jnp.int32)]
    absmax = dequantize_absmax(q).reshape(*codes.shape[:-2], out, half * 2 // BLOCK)
    w = values.reshape(*values.shape[:-1], -1, BLOCK) * absmax[..., None]
    return w.reshape(values.shape).astype(dtype)


QUANT_STATE_BYTES = 256  # room for the quant state's JSON when a writer must size it before quantizing


def _quant_state_json(shape: tuple[int, int], offset: float, dtype: str) -> bytes:
    state = {
        "quant_type": "nf4", "blocksize": BLOCK, "dtype": dtype, "shape": list(shape),
        "nested_blocksize": NESTED_BLOCK, "nested_dtype": "float32", "nested_offset": float(offset),
    }
    return json.dumps(state).encode()


def bnb_tensor_specs(shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each of `to_bnb_tensors`' arrays for a weight [out, in], known before quantizing (a
    writer lays out its files first); the quant state's JSON padded with spaces to QUANT_STATE_BYTES (JSON allows
    them; bitsandbytes and jaxtune parse it with json.loads)."""
    blocks = shape[0] * shape[1] // BLOCK
    return {"weight": ((shape[0] * shape[1] // 2, 1), np.dtype(np.uint8)), "absmax": ((blocks,), np.dtype(np.uint8)),
            "quant_map": ((16,), np.dtype(np.float32)),
            "nested_absmax": ((-(-blocks // NESTED_BLOCK),), np.dtype(np.float32)),
            "nested_quant_map": ((256,), np.dtype(np.float32)),
            "quant_state.bitsandbytes__nf4": ((QUANT_STATE_BYTES,), np.dtype(np.uint8))}


def to_bnb_tensors(q: NF4Weight, *, dtype: str = "bfloat16", shape: tuple[int, int] | None = None
                   ) -> dict[str, np.ndarray]:
    """The six bnb tensors of one NF4 weight, by their serialized names (suffixes of `<module>.weight`); `shape`:
    the weight's own, recorded in the quant state, where `q` holds its flattened blocks (`to_bnb`)."""
    shape = q.shape if shape is None else shape
    return {
        "weight": np.asarray(q.codes, np.uint8).reshape(-1, 1),
        "absmax": np.asarray(q.absmax_codes, np.uint8),
        "quant_map": NF4_CODE.copy(),
        "nested_absmax": np.asarray(q.nested_absmax, np.float32),
        "nested_quant_map": np.asarray(q.nested_map, np.float32).copy(),
        "quant_state.bitsandbytes__nf4": np.frombuffer(
            _quant_state_json(shape, float(np.asarray(q.offset)), dtype), np.uint8
        ).copy(),
    }


def to_bnb(w: np.ndarray | jax.Array, *, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """Quantizes W [out, in] and returns bnb's serialized tensors: weight, absmax, quant_map, nested_absmax,
    nested_quant_map, quant_state.bitsandbytes__nf4. A weight whose rows are not whole blocks is quantized as
    bnb does it, in blocks of 64 over the flattened weight (its size a multiple of 64)."""
    shape = tuple(w.shape)
    if quantizable(shape):
        return to_bnb_tensors(quantize(w), dtype=dtype)
    if (shape[0] * shape[1]) % BLOCK:
        raise CheckpointError(f"a weight of shape {shape} is not whole {BLOCK}-weight blocks; export it in 16 bits")
    return to_bnb_tensors(quantize(jnp.reshape(jnp.asarray(w), (-1, BLOCK))), dtype=dtype, shape=shape)


def parse_quant_state(raw: np.ndarray | bytes, where: str = "quant_state") -> dict:
    """The JSON of a `quant_state.bitsandbytes__nf4` tensor, validated."""
    try:
        state = json.loads(bytes(np.asarray(raw, np.uint8).tobytes() if not isinstance(raw, bytes) else raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{where} is not valid JSON; the bnb-4bit checkpoint is corrupt, re-download it") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is not a JSON object; the bnb-4bit checkpoint is corrupt, re-download it")
    if state.get("quant_type") != "nf4":
        raise CheckpointError(f"{where} has quant_type={state.get('quant_type')!r}; only nf4 is supported (not fp4)")
    if state.get("blocksize") != BLOCK or state.get("nested_blocksize", NESTED_BLOCK) != NESTED_BLOCK:
        raise CheckpointError(
            f"{where} uses blocksize={state.get('blocksize')}, nested_blocksize={state.get('nested_blocksize')}; "
            f"only {BLOCK}/{NESTED_BLOCK} (bnb defaults) are supported"
        )
    if "nested_offset" not in state:
        raise CheckpointError(f"{where} lacks nested_offset: only double-quantized (compress_statistics=True) NF4 is supported")
    if not isinstance(state.get("shape"), list) or len(state["shape"]) != 2:
        raise CheckpointError(f"{where} has no valid 2-D shape; the bnb-4bit checkpoint is corrupt")
    return state


def from_bnb_tensors(tensors: dict[str, np.ndarray], shape: tuple[int, int] | None = None, where: str = "weight",
                     *, flat: bool = False) -> NF4Weight:
    """NF4 arrays from bnb's serialized tensors (no requantization); checks maps and shapes. `flat`: a weight whose
    rows are not whole blocks (bnb's blocks run on across rows), as the arrays of its flattened [size / 64, 64]."""
    missing = [k for k in BNB_TENSOR_NAMES if k not in tensors]
    if missing:
        raise CheckpointError(f"{where} lacks bnb tensor(s) {', '.join(missing)}; the bnb-4bit checkpoint is incomplete")
    state = parse_quant_state(tensors["quant_state.bitsandbytes__nf4"], f"{where}.quant_state")
    state_shape = tuple(int(s) for s in state["shape"])
    if shape is not None and tuple(shape) != state_shape:
        raise CheckpointError(f"{where} quant_state shape {state_shape} does not match the expected {tuple(shape)}")
    if flat and (state_shape[0] * state_shape[1]) % BLOCK:
        raise CheckpointError(f"{where} of shape {state_shape} is not whole {BLOCK}-weight blocks; jaxtune reads "
                              "bnb-4bit weights of whole blocks only")
    out, inn = (state_shape[0] * state_shape[1] // BLOCK, BLOCK) if flat else state_shape
    _check_shape((out, inn))
    n_blocks = out * inn // BLOCK
    if not np.array_equal(np.asarray(tensors["quant_map"], np.float32), NF4_CODE):
        raise CheckpointError(f"{where}.quant_map is not the NF4 code book")
    nested_map = np.asarray(tensors["nested_quant_map"], np.float32).reshape(-1)
    if nested_map.shape != (256,) or not np.allclose(nested_map, dynamic_map(), rtol=1e-6, atol=0):
        raise CheckpointError(f"{where}.nested_quant_map is not bnb's 8-bit dynamic map")
    codes = np.asarray(tensors["weight"], np.uint8)
    absmax = np.asarray(tensors["absmax"], np.uint8).reshape(-1)
    nested = np.asarray(tensors["nested_absmax"], np.float32).reshape(-1)
    if codes.size != out * inn // 2 or absmax.size != n_blocks or nested.size != -(-n_blocks // NESTED_BLOCK):
        raise CheckpointError(f"{where} tensor sizes do not match its quant_state shape {state_shape}")
    return NF4Weight(codes.reshape(out, inn // 2), absmax, nested, np.float32(state["nested_offset"]), nested_map)


def quantizable(shape: tuple[int, ...]) -> bool:
    """Whether a weight [..., out, in] takes jaxtune's NF4 layout: rows of whole 64-weight blocks (the kernels read
    a row's blocks). bitsandbytes' blocks run on across rows; such a weight stays 16-bit here."""
    return shape[-1] % BLOCK == 0


def dequantize_bnb_blocks(tensors: dict[str, np.ndarray], shape: tuple[int, int], where: str = "weight") -> np.ndarray:
    """The float32 weight [out, in] of bnb's serialized NF4 tensors of a weight whose rows are not whole blocks
    (jaxtune keeps it 16-bit): bnb's blocks of 64 over the flattened weight, dequantized as bnb does."""
    return np.asarray(dequantize(from_bnb_tensors(tensors, shape, where, flat=True))).reshape(shape)


def from_bnb(tensors: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """The dequantized float32 weight [out, in] from bnb's serialized tensors."""
    return np.asarray(dequantize(from_bnb_tensors(tensors, shape)))
