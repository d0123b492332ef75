"""Which implementation runs the heavy ops: `JAXTUNE_KERNELS=auto|xla|pallas|pallas-interpret|cudnn`.

- `auto` (default): on GPU, per call shape, the implementation measured fastest (table below, from
  benchmarks/results/2026-11-22-nf4-matmul-h100.md); attention through cuDNN for plain causal rows (one
  sequence per row, no window) and the Pallas flash attention for packed segments and sliding windows;
  FP8 projections (`compute="fp8"`) through cuBLASLt; on CPU the XLA reference.
- `xla`: the pure XLA reference everywhere.
- `pallas`: the Pallas kernels wherever they apply (fused NF4 matmul for every M, flash attention, FP8 GEMM, the
  chunked gated delta rule).
- `pallas-interpret`: the same kernels run by the Pallas interpreter (CPU; for tests).
- `cudnn`: the same as `auto` (kept for scripts that name it).

The choice is made when a function is traced: set it before the first jit of the model
(`jaxtune.set_kernels("xla")` or the environment variable).
"""

from __future__ import annotations

import os

import jax

from jaxtune.errors import JaxtuneError

KERNEL_MODES = ("auto", "xla", "pallas", "pallas-interpret", "cudnn")
ENV_VAR = "JAXTUNE_KERNELS"

# NF4 projection, measured on H100 (jax 0.11.2) over the Llama-3-8B shapes, forward and dx alike:
# (largest M, implementation). The fused kernel wins while the weight read dominates; past that,
# dequantizing to bf16 with the Pallas kernel and calling cuBLAS wins (XLA's own dequant is slower). Up to 64 rows
# since the byte-permute tiles (`nf4_linear.kernel_tiles`): the 8B GRPO step decoding 64 rows from the codes 10.22
# against 10.88 s on an H200 (benchmarks/results/2026-11-28-grpo-dense-rollout-h200.md).
NF4_TABLE: tuple[tuple[float, str], ...] = ((64, "fused"), (float("inf"), "dequant+dot"))

_mode: str | None = None


def set_kernels(mode: str | None) -> None:
    """Pick the kernel mode for ops traced from now on (None: back to the environment variable)."""
    global _mode
    if mode is not None:
        _validate(mode, "set_kernels")
    _mode = mode


def _validate(mode: str, where: str) -> str:
    if mode not in KERNEL_MODES:
        raise JaxtuneError(f"{where}: unknown kernel mode {mode!r}; use one of {', '.join(KERNEL_MODES)}")
    return mode


def kernel_mode() -> str:
    """The mode in force: the setter's, else $JAXTUNE_KERNELS, else `auto`."""
    if _mode is not None:
        return _mode
    return _validate(os.environ.get(ENV_VAR, "auto").strip() or "auto", ENV_VAR)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _forced(pallas: str) -> str | None:
    """The implementation the mode fixes: `pallas` under the Pallas modes, `xla` under `xla` or off GPU; None
    where the measured choice decides."""
    mode = kernel_mode()
    if mode in ("pallas", "pallas-interpret"):
        return pallas
    if mode == "xla" or not _on_gpu():
        return "xla"
    return None


def nf4_impl(m: int) -> str:
    """`xla`, `fused`, `dequant+dot` for an NF4 projection of M rows; the mode decides, then the table."""
    return _forced("fused") or next(impl for limit, impl in NF4_TABLE if m <= limit)


def nf4_dequant_impl() -> str:
    """`pallas` (the dequant kernel) or `xla` for a whole NF4 weight dequantized on its own, as the "dequantize, then
    dot" path does."""
    return _forced("pallas") or "pallas"


def moe_impl() -> str:
    """`pallas` (the grouped expert kernel) or `xla` (`jax.lax.ragged_dot`) for a mixture of experts' projections.
    On GPU always the kernel: XLA's ragged_dot computes every expert for every row there (1% of a dense GEMM's
    rate at 128 experts, benchmarks/results/2026-11-27-moe-h200.md)."""
    return _forced("pallas") or "pallas"


# The frozen experts' GEMMs (forward, input gradient) through JAX's Mosaic GPU ragged dot (wgmma) on Hopper in
# `auto` mode; the Triton kernel elsewhere and under `pallas`. Off: measured 0.50-0.73x the Triton kernel at
# Qwen3-30B-A3B's expert shapes, the step 22,077 against 27,629 tokens/s (H200,
# benchmarks/results/2026-11-28-moe-vs-unsloth-h200.md).
MOE_WGMMA_ON_HOPPER = False


def _compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first local GPU; None off a GPU or where the device does not say."""
    capability = getattr(jax.local_devices()[0], "compute_capability", None) if _on_gpu() else None
    return None if capability is None else tuple(int(p) for p in str(capability).split(".")[:2])


def _hopper() -> bool:
    return (_compute_capability() or (0, 0))[0] == 9


def moe_frozen_impl() -> str:
    """`wgmma` (Mosaic GPU, pallas_kernels/grouped_matmul_wgmma.py), `pallas` (the Triton grouped kernel) or `xla`
    for the frozen expert weights' grouped GEMMs; LoRA's rank-r factors stay on `moe_impl`."""
    forced = _forced("pallas")
    if forced:
        return forced
    return "wgmma" if MOE_WGMMA_ON_HOPPER and _hopper() else "pallas"


# Under compute "fp8", the frozen experts' GEMMs in e4m3 too (pallas_kernels/grouped_fp8_matmul.py, forward and input
# gradient); off until the grouped FP8 kernel is measured against the bf16 one on the device: the experts then stay
# in bf16 under "fp8", as before
MOE_FP8_EXPERTS = False


def moe_fp8_impl() -> str | None:
    """`pallas` (the grouped FP8 kernel), `pallas-interpret`, or `xla` (its jnp reference) for the frozen experts'
    GEMMs under compute "fp8"; None: they stay in the model's dtype (`MOE_FP8_EXPERTS` off)."""
    if not MOE_FP8_EXPERTS:
        return None
    mode = kernel_mode()
    if mode == "pallas-interpret":
        return mode
    return _forced("pallas") or "pallas"


# QAT's q4_0 weights of NF4 projections on a GPU by the one-pass kernel: the 8B step 1.04x plain QLoRA's through it,
# 1.29x through XLA's passes (H200, benchmarks/results/2026-11-28-qat-q4-0-kernel-h200.md)
QAT_KERNEL_ON_GPU = True


def qat_impl() -> str:
    """`pallas` (one kernel pass from the NF4 codes to the rounded bf16 weight) or `xla` (passes over float32
    copies) for quantization-aware training's q4_0 weights."""
    return _forced("pallas") or ("pallas" if QAT_KERNEL_ON_GPU else "xla")


def fp8_impl() -> str:
    """`xla` (the jnp reference: dequantize, f32 dot), `cublas` (XLA's FP8 dot: cuBLASLt) or `pallas` (the
    FP8 kernel) for FP8 projections. On GPU cuBLASLt, measured 2x bf16 where the Pallas kernel is 0.64x
    (benchmarks/results/2026-11-23-fp8-h200.md)."""
    return _forced("pallas") or "cublas"


def check_fp8_device() -> None:
    """FP8 GEMMs need compute capability 8.9+ (Ada, Hopper); on a CPU the jnp reference emulates them."""
    capability = _compute_capability()
    if capability is not None and capability < (8, 9):
        raise JaxtuneError(f"compute='fp8' needs an FP8 GPU (compute capability 8.9+: Ada, Hopper); "
                           f"{jax.local_devices()[0].device_kind} has {'.'.join(map(str, capability))}: train with "
                           "compute='bf16'")


def attention_impl(plain_causal: bool, head_dim: int = 128) -> str:
    """`xla`, `pallas` or `cudnn` for full-sequence (no KV cache) attention; `plain_causal`: no segments/window.
    Heads of 64 or 128 run the Pallas kernel or cuDNN. Heads of 256 (Qwen3.5's full layers, Gemma 4's sliding ones)
    run cuDNN's flash attention for plain causal rows on Hopper and later, else the Pallas kernel's wide tiles
    (1.2x-2.3x XLA on packed rows and windows); heads of 512 (Gemma 4's full layers) and other widths XLA, whose
    attention beat the wide tiles at 512 (benchmarks/results/2026-12-07-wide-heads-and-gpt-oss-h200.md)."""
    if head_dim in (64, 128):
        return _forced("pallas") or ("cudnn" if plain_causal else "pallas")
    if head_dim not in (256, 512):
        return "xla"
    if head_dim == 512:  # XLA's attention measured 1.7x the best wide tiles at 2048 tokens (H200, 2026-12-07)
        return _forced("pallas") or "xla"
    cudnn = plain_causal and (_compute_capability() or (0, 0))[0] >= 9
    return _forced("pallas") or ("cudnn" if cudnn else "pallas")


# A decoding step's attention by the Pallas kernel that reads only the filled (and windowed) part of the cache
# (pallas_kernels/decode_attention.py): 1.04-10.4x XLA's, which reads the whole cache, in all six rollout shapes
# measured (H100, benchmarks/results/2026-12-08-moe-kernels-rollout-h100.md)
DECODE_ATTENTION_ON_GPU = True


def decode_attention_impl(head_dim: int, cache_length: int) -> str:
    """`pallas` or `xla` for one decoding step's attention over a KV cache."""
    fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0 and cache_length % 16 == 0
    if not fits:
        return "xla"
    return _forced("pallas") or ("pallas" if DECODE_ATTENTION_ON_GPU else "xla")


def gated_delta_impl(dk: int, dv: int) -> str:
    """`pallas` (pallas_kernels/gated_delta.py) or `xla` for the chunked gated delta rule: the kernel on GPU where
    both head dims are powers of two >= 16 (1.9x-2.4x the XLA path forward + backward on an H200,
    benchmarks/results/2026-12-02-gated-delta-xla-vs-fla-h200.md)."""
    fits = all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))
    return (_forced("pallas") or "pallas") if fits else "xla"


def interpret() -> bool:
    return kernel_mode() == "pallas-interpret"
