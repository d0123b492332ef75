"""What NF4 re-quantization costs against gpt-oss's MXFP4 experts, on the CPU.

    python benchmarks/accuracy/mxfp4_to_nf4.py [--experts 4] [--out runs/mxfp4-nf4]

1. Real shapes (gpt-oss-20b's experts: hidden 2880, width 2880): Gaussian weights (std 0.02) quantized to MXFP4 as
   OpenAI's checkpoints are (per block of 32 the power of two that puts the largest magnitude at or below 6, values
   rounded to the nearest E2M1), then the MXFP4 weights quantized to NF4 as jaxtune loads them. Relative RMS error
   of the weights and of the expert's clamped-SwiGLU output on random inputs: MXFP4 -> NF4, beside bf16 -> MXFP4 and
   bf16 -> NF4 for scale.
2. A tiny random gpt-oss whose experts are stored in MXFP4: logits of the exact (float32) load against the NF4 load
   on fixed token rows: largest |difference|, mean KL, and perplexity of the rows under both.
Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxtune.quant import mxfp4, nf4


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., in] float -> (blocks [..., in / 32, 16] uint8, scales [..., in / 32] uint8), rounding to nearest."""
    blocks = w.reshape(*w.shape[:-1], -1, mxfp4.BLOCK).astype(np.float32)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    exponent = np.where(absmax > 0, np.ceil(np.log2(np.maximum(absmax, 1e-38) / 6.0)), -mxfp4.E8M0_BIAS)
    exponent = np.clip(exponent, -mxfp4.E8M0_BIAS, 127)
    scaled = blocks / np.exp2(exponent)
    codes = np.abs(scaled[..., None] - mxfp4.E2M1_VALUES).argmin(-1).astype(np.uint8)  # nearest; +0 before -0
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent[..., 0] + mxfp4.E8M0_BIAS).astype(np.uint8)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def nf4_round_trip(w: np.ndarray) -> np.ndarray:
    return np.asarray(nf4.dequantize(nf4.quantize(np.ascontiguousarray(w, np.float32))), np.float32)


def clamped_swiglu(x, gate, up, down, alpha=1.702, limit=7.0):
    g, u = np.minimum(x @ gate.T, limit), np.clip(x @ up.T, -limit, limit)
    return ((u + 1) * g / (1 + np.exp(-alpha * g))) @ down.T


def real_shapes(experts: int, hidden: int = 2880, width: int = 2880) -> dict:
    rng = np.random.default_rng(0)
    weights = {"gate": (width, hidden), "up": (width, hidden), "down": (hidden, width)}
    errs: dict[str, list[float]] = {k: [] for k in ("mxfp4_vs_bf16", "nf4_vs_mxfp4", "nf4_vs_bf16", "out_nf4_vs_mxfp4",
                                                   "out_mxfp4_vs_bf16")}
    x = rng.standard_normal((256, hidden)).astype(np.float32)
    for _ in range(experts):
        bf16, mx, nf = {}, {}, {}
        for name, shape in weights.items():
            w = (0.02 * rng.standard_normal(shape)).astype(np.float32)
            m = np.asarray(mxfp4.dequantize(*quantize_mxfp4(w)), np.float32)
            bf16[name], mx[name], nf[name] = w, m, nf4_round_trip(m)
            errs["mxfp4_vs_bf16"].append(rel(m, w))
            errs["nf4_vs_mxfp4"].append(rel(nf[name], m))
            errs["nf4_vs_bf16"].append(rel(nf4_round_trip(w), w))
        ref = clamped_swiglu(x, **mx)
        errs["out_nf4_vs_mxfp4"].append(rel(clamped_swiglu(x, **nf), ref))
        errs["out_mxfp4_vs_bf16"].append(rel(ref, clamped_swiglu(x, **bf16)))
    return {"part": "real-shape experts", "hidden": hidden, "width": width, "experts": experts,
            **{k: round(float(np.mean(v)), 5) for k, v in errs.items()}}


def tiny_model(out: Path) -> dict:
    import jax
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    import jaxtune

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=16)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    hf.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name), -1, -2))  # [E, out, in] rows of blocks
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))
    rows = np.random.default_rng(1).integers(0, 256, (8, 64))
    exact, _ = jaxtune.from_pretrained(out, dtype="float32")
    four_bit, _ = jaxtune.from_pretrained(out, dtype="float32", load_in_4bit=True)
    a, b = (np.asarray(m(rows), np.float64) for m in (exact, four_bit))
    logp_a, logp_b = (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
                      for x in (a, b))
    kl = float((np.exp(logp_a) * (logp_a - logp_b)).sum(-1).mean())
    nll = lambda lp: float(-np.take_along_axis(lp[:, :-1], rows[:, 1:, None], -1).mean())  # noqa: E731
    return {"part": "tiny gpt-oss (4 layers, 8 experts, hidden 128)", "max_abs_logit_diff": round(float(np.abs(a - b).max()), 5),
            "max_abs_logit": round(float(np.abs(a).max()), 4), "mean_kl": round(kl, 7),
            "ppl_mxfp4": round(float(np.exp(nll(logp_a))), 4), "ppl_nf4": round(float(np.exp(nll(logp_b))), 4),
            "jax": jax.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--out", default="runs/mxfp4-nf4")
    args = ap.parse_args()
    print(json.dumps(real_shapes(args.experts)), flush=True)
    print(json.dumps(tiny_model(Path(args.out))), flush=True)


if __name__ == "__main__":
    main()
