"""Quantization-aware training: the forward is the exported 4-bit model's (against the `gguf` package's q4_0 and
bitsandbytes' NF4 on the same merged weights), the LoRA gradient passes straight through the quantizer (against
torch autograd and the chain rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, LlamaConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.qlora import LORA_TARGETS, PARENT_MODULE, projection

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
IDS = np.random.default_rng(0).integers(0, 128, size=(2, 12))


# rows of whole 256-weight super-blocks, so that Q4_K_M's projections are q4_K (CONFIG's are its q5_0 fallback)
WIDE = dict(CONFIG, hidden_size=256, intermediate_size=512)


def _tuned(tmp_path, load_in_4bit: bool, config: dict = CONFIG):
    build_hf_model(LlamaConfig(**config), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=load_in_4bit)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8)
    rng = np.random.default_rng(1)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(np.asarray(rng.standard_normal(var.get_value().shape) * 0.1, np.float32))
    return model


def _merged(model, name: str, layer: int, as_jaxtune: bool = False) -> np.ndarray:
    p = projection(model, name)
    if as_jaxtune:  # jaxtune's float32 merge, bit for bit
        return np.asarray(p.merged_weight()[layer])
    a, b = np.asarray(p.lora_a[...][layer], np.float64), np.asarray(p.lora_b[...][layer], np.float64)
    base = p.base
    if hasattr(base, "weight_nf4"):
        import jax

        from jaxtune.quant import nf4
        w = np.asarray(nf4.dequantize(jax.tree.map(lambda x: x[layer], base.weight_nf4)), np.float64)
    else:
        w = np.asarray(base.weight[...][layer], np.float64)
    return (w + p.scale * b @ a).astype(np.float32)


def _round_trip(w: np.ndarray, fmt: str) -> np.ndarray:
    """What the deployed file holds, by the independent quantizers."""
    if fmt == "q4_0":
        import gguf

        q = gguf.GGMLQuantizationType.Q4_0
        return gguf.quants.dequantize(gguf.quants.quantize(w, q), q).astype(np.float32)
    if fmt == "q4_k":  # ggml's q4_K bytes (jaxtune's numpy quantizer, byte-equal to llama.cpp's), read by `gguf`
        import gguf

        from jaxtune.quant import quantize_q4_k

        if w.shape[-1] % 256:  # the export's fallback
            q = gguf.GGMLQuantizationType.Q5_0
            return gguf.quants.dequantize(gguf.quants.quantize(w, q), q).astype(np.float32)
        q = gguf.GGMLQuantizationType.Q4_K
        return gguf.quants.dequantize(quantize_q4_k(w), q).reshape(w.shape).astype(np.float32)
    import bitsandbytes.functional as F

    q, state = F.quantize_4bit(torch.from_numpy(w), blocksize=64, compress_statistics=True, quant_type="nf4")
    return F.dequantize_4bit(q, state).numpy()


def _deployed(tmp_path, model, fmt: str):
    """transformers' model of the base, its projections replaced by the quantized merged weights. q4_K's scale
    search is discontinuous (a last-bit change of a weight may pick another grid for its block), so it quantizes
    jaxtune's own float32 merge; the others numpy's float64 one."""
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            for name in LORA_TARGETS:
                module = getattr(getattr(hf.model.layers[layer], PARENT_MODULE[name]), name)
                merged = _merged(model, name, layer, as_jaxtune=fmt == "q4_k")
                module.weight.copy_(torch.from_numpy(_round_trip(merged, fmt)))
    return hf


@pytest.mark.parametrize("fmt, load_in_4bit, tol, config, kernels", [
    ("q4_0", False, 1e-4, CONFIG, None), ("q4_0", True, 1e-4, CONFIG, None),
    # the GPU's path: the NF4 projections' q4_0 weights by one Pallas pass from the codes (interpreted here)
    ("q4_0", True, 1e-4, CONFIG, "pallas-interpret"),
    ("nf4", True, 2e-3, CONFIG, None),  # bnb's absmax codes: a few one apart
    ("q4_k", True, 1e-4, WIDE, None), ("q4_k", False, 1e-4, CONFIG, None)])
def test_the_qat_forward_is_the_exported_4bit_models(tmp_path, fmt, load_in_4bit, tol, config, kernels):
    model = _tuned(tmp_path, load_in_4bit, config)
    plain = np.asarray(model(IDS))
    model.qat = fmt
    jaxtune.set_kernels(kernels)
    try:
        qat = np.asarray(model(IDS))
    finally:
        jaxtune.set_kernels(None)
        model.qat = None
    with torch.no_grad():
        want = _deployed(tmp_path, model, fmt)(torch.as_tensor(IDS)).logits.numpy()
    assert np.abs(qat - want).max() < tol
    assert np.abs(plain - want).max() > 10 * tol  # the 4-bit model, not the float one


def test_the_lora_gradient_passes_straight_through_the_quantizer(tmp_path):
    """dL/dA = s B^T dL/dW and dL/dB = s dL/dW A^T, with dL/dW torch's gradient of the deployed q4_0 model."""
    import jax

    from jaxtune.training.step import split_model

    model = _tuned(tmp_path, load_in_4bit=False)
    hf = _deployed(tmp_path, model, "q4_0")
    logits = hf(torch.as_tensor(IDS)).logits
    logits.square().mean().backward()
    model.qat = "q4_0"
    graphdef, lora, frozen = split_model(model)

    def loss(lora):
        return jax.numpy.mean(jax.numpy.square(nnx.merge(graphdef, lora, frozen)(IDS)))

    grads = jax.grad(loss)(lora)
    got = {k: v for k, v in nnx.to_flat_state(grads)}
    for name in LORA_TARGETS:
        p = projection(model, name)
        path = tuple(k for k, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
                     if name in k and "lora_a" in k)[0][:-1]
        for layer in range(CONFIG["num_hidden_layers"]):
            dw = getattr(getattr(hf.model.layers[layer], PARENT_MODULE[name]), name).weight.grad.numpy()
            a, b = np.asarray(p.lora_a[...][layer]), np.asarray(p.lora_b[...][layer])
            np.testing.assert_allclose(np.asarray(got[(*path, "lora_a")].get_value()[layer]), p.scale * b.T @ dw,
                                       rtol=2e-3, atol=1e-7)
            np.testing.assert_allclose(np.asarray(got[(*path, "lora_b")].get_value()[layer]), p.scale * dw @ a.T,
                                       rtol=2e-3, atol=1e-7)


def test_qat_trains_and_refuses_what_it_cannot_combine_with(tiny_tokenizer):
    with pytest.raises(jaxtune.ConfigError, match="qat and compute 'fp8' do not combine"):
        jaxtune.TrainConfig(qat="q4_0", compute="fp8")
    with pytest.raises(jaxtune.ConfigError, match="LoRA dropout cannot apply; set lora_dropout 0"):
        jaxtune.TrainConfig(qat="nf4", lora_dropout=0.05)
    with pytest.raises(jaxtune.ConfigError, match="qat"):
        jaxtune.TrainConfig(qat="q3_k")
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    cfg = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tiny_tokenizer.eos_token_id)
    model = quantize_layers(init_model(cfg, dtype="float32", seed=0))
    rows = [{"text": "the quick brown fox jumps over the lazy dog " * 3}] * 16
    result = jaxtune.train(model, tiny_tokenizer, rows, jaxtune.TrainConfig(
        format="text", seq_len=32, micro_batch_size=4, max_steps=8, learning_rate=3e-3, warmup_steps=0, qat="q4_0"),
        progress=False)
    assert result.losses[-1] < result.losses[0] and model.qat is None  # the model keeps its plain forward


def test_eval_quantized_logs_the_held_out_loss_of_the_4bit_export(tmp_path, tiny_tokenizer):
    """eval_loss_q4_0 is the held-out loss of the base + adapters merged and quantized by the `gguf` package's q4_0
    (in transformers), while eval_loss stays the unquantized model's."""
    from jaxtune.data.packing import IGNORE
    from jaxtune.training.batches import prepare_data

    build_hf_model(LlamaConfig(**{**CONFIG, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    rows = [{"text": f"the quick brown fox {i} jumps over the lazy dog {i % 3}"} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=24, packing=False, micro_batch_size=4, max_steps=3, lora_r=4,
                              learning_rate=1e-2, warmup_steps=0, eval_fraction=0.25, eval_quantized="q4_0")
    records = []
    jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False, callback=records.append)
    last = [r for r in records if "eval_loss" in r][-1]
    _, held = prepare_data(rows, tiny_tokenizer, cfg, progress=False)
    labels = torch.as_tensor(np.where(held.labels == IGNORE, -100, held.labels).astype(np.int64))
    with torch.no_grad():
        logits = _deployed(tmp_path, model, "q4_0")(torch.as_tensor(held.input_ids.astype(np.int64))).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    assert last["eval_loss_q4_0"] == pytest.approx(want, rel=1e-4)
    assert abs(last["eval_loss"] - want) > 5e-4 * want  # eval_loss is the unquantized model's (measured 7e-4)


def test_qat_from_a_later_step_trains_the_steps_before_it_as_plain_lora(tiny_tokenizer):
    """qat_start_step=2: steps 1-2 are a plain run's to the bit, step 3 on goes through the quantizer (its loss is
    the 4-bit model's, not the plain run's)."""
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    cfg = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tiny_tokenizer.eos_token_id)
    rows = [{"text": f"the quick brown fox {i} jumps over the lazy dog " * 2} for i in range(16)]

    def losses(**qat) -> list[float]:
        model = quantize_layers(init_model(cfg, dtype="float32", seed=0))
        return jaxtune.train(model, tiny_tokenizer, rows, jaxtune.TrainConfig(
            format="text", seq_len=32, micro_batch_size=4, max_steps=4, learning_rate=3e-3, warmup_steps=0, **qat),
            progress=False).losses

    plain, late, qat = losses(), losses(qat="q4_0", qat_start_step=2), losses(qat="q4_0")
    assert late[:2] == plain[:2] and late[0] != qat[0]
    assert late[2] != plain[2]


def test_the_kernel_path_trains_the_adapters_as_xla_does(tmp_path):
    """On a GPU the q4_0 weights of NF4 projections come from one Pallas pass (here interpreted): the same loss and
    LoRA gradients as XLA's passes (the kernel's weight is not differentiated; the straight-through term is)."""
    import jax

    from jaxtune.training.step import split_model

    model = _tuned(tmp_path, load_in_4bit=True)
    model.qat = "q4_0"
    graphdef, lora, frozen = split_model(model)

    def loss(lora):
        return jax.numpy.mean(jax.numpy.square(nnx.merge(graphdef, lora, frozen)(IDS)))

    results = {}
    for kernels in (None, "pallas-interpret"):
        jaxtune.set_kernels(kernels)
        try:
            results[kernels] = jax.value_and_grad(loss)(lora)
        finally:
            jaxtune.set_kernels(None)
    (want, want_grads), (got, got_grads) = results[None], results["pallas-interpret"]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (path, g), (_, w) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)):
        assert np.abs(np.asarray(w.get_value())).max() > 0, path
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()), rtol=1e-4, atol=1e-7)
