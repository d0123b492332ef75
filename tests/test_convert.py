"""`jaxtune convert` round trips, bitsandbytes 4-bit checkpoints, and failures that leave no output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

import jaxtune
from conftest import build_hf_model
from jaxtune.cli import main as cli_main
from jaxtune.qlora import LORA_TARGETS

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _arrays(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_convert_then_load_gives_identical_params(tmp_path, quantize, capsys):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    t0 = time.perf_counter()
    jaxtune.convert(tmp_path / "hf", tmp_path / "out", quantize=quantize)
    t_convert = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded, _ = jaxtune.from_pretrained(tmp_path / "out")
    t_load = time.perf_counter() - t0
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=quantize == "nf4")
    a, b = _arrays(loaded), _arrays(direct)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    with capsys.disabled():
        print(f"\n[convert {quantize}] convert {t_convert:.2f} s, load pre-converted {t_load:.2f} s")
    meta = json.loads((tmp_path / "out" / "jaxtune.json").read_text())
    assert meta == {"format_version": 1, "quantization": quantize, "dtype": "bfloat16",
                    "source": str((tmp_path / "hf").resolve())}


def test_convert_gguf_keeps_the_tokenizer(tmp_path, smollm2_path):
    assert cli_main(["convert", smollm2_path, str(tmp_path / "smol")]) == 0
    model, tokenizer = jaxtune.from_pretrained(tmp_path / "smol")
    assert tokenizer is not None and tokenizer.chat_template
    out = jaxtune.generate(model, tokenizer, [[{"role": "user", "content": "What is the capital of France?"}]],
                           max_new_tokens=12)
    assert "Paris" in out[0]
    # the tokenizer it wrote loads by its class: AutoTokenizer's tokenizer, without AutoTokenizer's PyTorch import
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tmp_path / "smol")
    assert type(tokenizer) is type(auto) and tokenizer.special_tokens_map == auto.special_tokens_map
    for text in ("Hello 12345 world <|im_start|>user\nhi<|im_end|>", "  spaces\tand tabs", "日本語 é 🎉"):
        assert tokenizer(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    code = f"import sys; from convert.load import load_tokenizer; load_tokenizer({str(tmp_path / 'smol')!r}); " \
           "print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


def _save_bnb_checkpoint(hf_dir, out_dir, *, corrupt_state: bool = False):
    """Rewrites a bf16 HF checkpoint in the bitsandbytes 4-bit layout, serialized by bnb's QuantState."""
    from bitsandbytes import functional as F

    out_dir.mkdir()
    tensors = load_file(hf_dir / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LORA_TARGETS):
            q, state = F.quantize_4bit(t.to(torch.bfloat16), blocksize=64, compress_statistics=True, quant_type="nf4")
            out[name] = q
            for key, value in state.as_dict(packed=True).items():
                out[f"{name}.{key}"] = value
            if corrupt_state:
                out[f"{name}.quant_state.bitsandbytes__nf4"] = torch.frombuffer(bytearray(b'{"quant_type": "nf4"'), dtype=torch.uint8)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, out_dir / "model.safetensors")
    bf16_dir = out_dir.parent / f"{out_dir.name}-bf16-source"  # the same bf16 weights, unquantized
    bf16_dir.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, bf16_dir / "model.safetensors")
    (bf16_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("hf_config", [LlamaConfig(**COMMON), Qwen3Config(**COMMON, head_dim=32)])
def test_bnb_4bit_checkpoint_loads_directly(tmp_path, hf_config):
    from bitsandbytes import functional as F
    from bitsandbytes.functional import QuantState

    hf_model = build_hf_model(hf_config, tmp_path / "hf")
    bnb = _save_bnb_checkpoint(tmp_path / "hf", tmp_path / "bnb")
    model, _ = jaxtune.from_pretrained(tmp_path / "bnb", dtype="float32")
    # the arrays are bnb's bytes, not a requantization
    codes = np.asarray(model.layers.self_attn.q_proj.codes[...])[1].reshape(-1, 1)
    np.testing.assert_array_equal(codes, bnb["model.layers.1.self_attn.q_proj.weight"].numpy())
    # logits equal transformers running on bnb's own dequantization of the same bytes
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name in bnb and f"{name}.absmax" in bnb:
                comps = {k[len(name) + 1:]: v for k, v in bnb.items() if k.startswith(name + ".")}
                state = QuantState.from_dict(comps, device=torch.device("cpu"))
                state.dtype = torch.float32  # dequantize in float32, as the float32 jaxtune model does
                param.copy_(F.dequantize_4bit(bnb[name], state))
            elif name in bnb:
                param.copy_(bnb[name].float())
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 10))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_array_less(np.abs(np.asarray(model(ids)) - ref).max(), 1e-4)
    # jaxtune's own NF4 of the same bf16 weights: identical 4-bit codes; bnb's native CPU kernel rounds ~0.15%
    # of the absmax codes to the neighbouring code (see test_nf4), a <1% change of those blocks' scales
    own, _ = jaxtune.from_pretrained(tmp_path / "bnb-bf16-source", dtype="float32", load_in_4bit=True)
    np.testing.assert_array_equal(np.asarray(own.layers.mlp.down_proj.codes[...]),
                                  np.asarray(model.layers.mlp.down_proj.codes[...]))
    ours = np.asarray(model(ids))
    rel = np.linalg.norm(np.asarray(own(ids)) - ours) / np.linalg.norm(ours)
    print(f"bnb-loaded vs own NF4 logits: rel {rel:.2e}")
    assert rel < 2e-3, rel


def test_corrupt_quant_state_is_a_clear_error(tmp_path):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    _save_bnb_checkpoint(tmp_path / "hf", tmp_path / "bnb", corrupt_state=True)
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.convert(tmp_path / "bnb", tmp_path / "out")
    assert "not valid JSON" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_bnb_shape_mismatch_is_a_clear_error(tmp_path):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    _save_bnb_checkpoint(tmp_path / "hf", tmp_path / "bnb")
    cfg = json.loads((tmp_path / "bnb" / "config.json").read_text())
    cfg["intermediate_size"] = 192
    (tmp_path / "bnb" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxtune.CheckpointError, match=r"does not match the expected"):
        jaxtune.from_pretrained(tmp_path / "bnb")


def test_unknown_quantization_exits_nonzero_without_output(tmp_path, capsys):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    capsys.readouterr()
    code = cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--quantize", "int3"])
    err = capsys.readouterr().err
    assert code == 1 and "unknown quantization 'int3'" in err and "nf4" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_existing_destination_is_not_overwritten(tmp_path):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(jaxtune.CheckpointError, match="already exists"):
        jaxtune.convert(tmp_path / "hf", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"
