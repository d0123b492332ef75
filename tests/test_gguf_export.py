"""GGUF export reads back equal two independent ways: transformers' GGUF loader and jaxtune's importer (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

import jaxtune
from conftest import build_hf_model
from test_export import _randomize_lora

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# rows of whole 256-weight super-blocks, and enough layers for llama.cpp's 6-bit layers to be a pattern
K_QUANT_SHAPES = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2)
TEXT = 'Paris is the capital of France. {"age": 31} 0123456789\n<|im_start|>user hello<|im_end|>'


def _trained_like(tmp_path, hf_config, tokenizer):
    """A random HF model (original weights in tmp/base) and its QLoRA model with random adapters."""
    build_hf_model(hf_config, tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=8, lora_alpha=16)
    return _randomize_lora(model), tok


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _rounded(w: np.ndarray, gguf_type: str) -> np.ndarray:
    """What a float32 matrix becomes when stored as `gguf_type` and read back (round to nearest even)."""
    import ml_dtypes

    if w.ndim == 1 or gguf_type == "f32":
        return w
    return w.astype({"bf16": ml_dtypes.bfloat16, "f16": np.float16}[gguf_type]).astype(np.float32)


@pytest.mark.parametrize("make_config, gguf_type, tol", [
    (lambda v: LlamaConfig(vocab_size=v, **SMALL), "f32", 1e-4),
    (lambda v: LlamaConfig(vocab_size=v, **SMALL), "bf16", 3e-2),  # logits span about +-2
    (lambda v: LlamaConfig(vocab_size=v, **SMALL, tie_word_embeddings=True, head_dim=32), "f16", 5e-3),
    (lambda v: MistralConfig(vocab_size=v, **SMALL, sliding_window=None), "bf16", 3e-2),
    (lambda v: LlamaConfig(vocab_size=v, **{**SMALL, "num_hidden_layers": 3}), "q8_0", 5e-2),
    (lambda v: LlamaConfig(vocab_size=v, **SMALL, tie_word_embeddings=True, head_dim=32), "q4_0", 0.5),  # 4 bits
    # 8 random layers at 4 bits amplify the rounding: logits spanning +-3.4 move by up to 1.94 (q4_0: 2.24)
    (lambda v: LlamaConfig(vocab_size=v, **K_QUANT_SHAPES), "q4_k_m", 2.5),
])
def test_gguf_reads_back_like_the_merged_checkpoint(tmp_path, tiny_tokenizer, make_config, gguf_type, tol):
    from safetensors.numpy import load_file

    from convert.gguf_source import GGUFSource

    model, tok = _trained_like(tmp_path, make_config(len(tiny_tokenizer)), tiny_tokenizer)
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    jaxtune.save_gguf(model, tmp_path / "out" / "model.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type=gguf_type)
    assert [f.name for f in (tmp_path / "out").iterdir()] == ["model.gguf"]
    merged_tensors = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    with GGUFSource(tmp_path / "out" / "model.gguf") as source:
        assert sorted(source.names()) == sorted(merged_tensors)
        if gguf_type not in ("q8_0", "q4_0", "q4_k_m"):  # every tensor is the merged one, rounded once
            for name, want in merged_tensors.items():
                np.testing.assert_array_equal(source.get(name), _rounded(want, gguf_type), err_msg=name)
    if gguf_type == "q4_0":  # the matrices in 4 bits; the tied embedding (llama.cpp's output too) in 8
        import gguf

        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
        assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types
        assert {types[f"blk.{i}.{m}.weight"] for i in range(2) for m in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                          "ffn_gate", "ffn_up", "ffn_down")} == {"Q4_0"}
    if gguf_type == "q4_k_m":  # llama-quantize's Q4_K_M mix: 6 bits for the output and for attn_v and ffn_down
        import gguf  # of layers 0, 3, 6 and 7 of 8 (the first and last eighth, every third between), 4 elsewhere

        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
        for i in range(8):
            assert {types[f"blk.{i}.{m}.weight"] for m in ("attn_q", "attn_k", "attn_output", "ffn_gate",
                                                            "ffn_up")} == {"Q4_K"}
            assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == (
                "Q6_K" if i in (0, 3, 6, 7) else "Q4_K"), i
        assert types["blk.0.attn_norm.weight"] == "F32"
    ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), size=(2, 12))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids)
    via_transformers = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf",
                                                            dtype=torch.float32).eval()
    reimported, gguf_tok = jaxtune.from_pretrained(tmp_path / "out" / "model.gguf", dtype="float32")
    assert np.abs(_logits(via_transformers, ids) - merged).max() < tol
    assert np.abs(np.asarray(reimported(ids)) - merged).max() < tol
    if gguf_type == "q4_k_m":  # closer to the merged model than llama.cpp's q4_0 file of it, same size class
        jaxtune.save_gguf(model, tmp_path / "q4_0.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type="q4_0")
        q4_0, _ = jaxtune.from_pretrained(tmp_path / "q4_0.gguf", dtype="float32")
        k_err, q4_0_err = (np.linalg.norm(np.asarray(m(ids)) - merged) for m in (reimported, q4_0))
        assert k_err < 0.9 * q4_0_err, (k_err, q4_0_err)
    if gguf_type in ("q8_0", "q4_0", "q4_k_m"):  # the same quantized bytes, read two ways
        assert np.abs(np.asarray(reimported(ids)) - _logits(via_transformers, ids)).max() < 1e-4
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    want = tok(TEXT)["input_ids"]
    assert gguf_tok(TEXT)["input_ids"] == want and hf_tok(TEXT)["input_ids"] == want
    assert gguf_tok.chat_template == tok.chat_template == hf_tok.chat_template


def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path, tiny_tokenizer):
    """llama3 scaling as the `rope_freqs` tensor (per-pair frequency divisors), linear as rope.scaling.* keys."""
    import gguf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(vocab_size=len(tiny_tokenizer), **SMALL, rope_scaling=rope, max_position_embeddings=1024)
    model, tok = _trained_like(tmp_path / "llama3", hf_config, tiny_tokenizer)
    jaxtune.save_gguf(model, tmp_path / "llama3.gguf", tokenizer=tok, base=tmp_path / "llama3" / "base")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / (hf_config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "llama3.gguf").tensors}["rope_freqs.weight"]
    np.testing.assert_allclose(np.asarray(stored.data), (plain / scaled.double()).numpy(), rtol=1e-5)
    assert not np.allclose(np.asarray(stored.data), 1.0)
    # and read back: jaxtune's importer turns rope_freqs into the same llama3 scaling; logits equal transformers'
    jaxtune.save_merged(model, tmp_path / "merged3", base=tmp_path / "llama3" / "base", dtype="float32")
    jaxtune.save_gguf(model, tmp_path / "llama3-f32.gguf", tokenizer=tok, base=tmp_path / "llama3" / "base",
                      gguf_type="f32")
    reimported, _ = jaxtune.from_pretrained(tmp_path / "llama3-f32.gguf", dtype="float32")
    c = reimported.config
    assert (c.rope_type, c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
            c.rope_original_max_position) == ("llama3", 8.0, 1.0, 4.0, 64)
    ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), size=(2, 100))  # past the original 64
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged3", dtype=torch.float32).eval(), ids)
    assert np.abs(np.asarray(reimported(ids)) - merged).max() < 1e-4
    # transformers' GGUF loader still reads the file (it leaves the llama3 scaling out: rope_type "default")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="llama3-f32.gguf", dtype=torch.float32)
    assert hf.config.num_hidden_layers == SMALL["num_hidden_layers"]

    linear = LlamaConfig(vocab_size=len(tiny_tokenizer), **SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model, tok = _trained_like(tmp_path / "linear", linear, tiny_tokenizer)
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "linear" / "base", dtype="float32")
    jaxtune.save_gguf(model, tmp_path / "linear.gguf", tokenizer=tok, base=tmp_path / "linear" / "base",
                      gguf_type="f32")
    fields = gguf.GGUFReader(tmp_path / "linear.gguf").fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 2.0
    ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), size=(2, 40))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids)
    reimported, _ = jaxtune.from_pretrained(tmp_path / "linear.gguf", dtype="float32")
    assert np.abs(np.asarray(reimported(ids)) - merged).max() < 1e-4


def test_llama3_rope_freqs_without_their_context_key_give_llama3_frequencies():
    """llama.cpp writes Llama 3.1's scaling as rope_freqs alone: the importer's parameters (original context
    assumed 8192) reproduce transformers' llama3 frequencies; divisors of another shape are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from convert.gguf_source import llama3_rope_from_factors
    from jaxtune.errors import UnsupportedModelError

    for theta, head_dim, context, low, high, factor in [(500000.0, 128, 8192, 1.0, 4.0, 8.0),
                                                        (10000.0, 16, 64, 1.0, 4.0, 8.0),
                                                        (500000.0, 64, 32768, 2.0, 8.0, 32.0)]:
        hf = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta, rope_scaling={
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": context})
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        plain = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        divisors = (plain / scaled.double().numpy()).astype(np.float32).astype(np.float64)
        rope = llama3_rope_from_factors(divisors, theta, head_dim, 8192)
        got = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta, rope_scaling=rope)
        np.testing.assert_allclose(ROPE_INIT_FUNCTIONS["llama3"](got, "cpu")[0].double().numpy(),
                                   scaled.double().numpy(), rtol=1e-5)
    assert llama3_rope_from_factors(np.ones(8), 10000.0, 16, 8192) is None
    with pytest.raises(UnsupportedModelError, match="does not follow llama3"):
        llama3_rope_from_factors(np.random.default_rng(0).uniform(1, 8, 8), 10000.0, 16, 8192)


def _sentencepiece_style_tokenizer(path):
    """A Llama-2 style tokenizer: BPE over "▁"-spaced text with byte fallback, <s> prepended, trained offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Paris is the capital of France.", "hello 0123"]
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def test_sentencepiece_style_tokenizer_reads_back_equal(tmp_path):
    import gguf

    sp = _sentencepiece_style_tokenizer(tmp_path / "tok")
    model, tok = _trained_like(tmp_path, LlamaConfig(vocab_size=len(sp) + 5, **SMALL), sp)  # 5 unused ids
    jaxtune.save_gguf(model, tmp_path / "out" / "m.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type="f16")
    fields = gguf.GGUFReader(tmp_path / "out" / "m.gguf").fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[sp.convert_tokens_to_ids("<0x41>")] == 6 and types[sp.bos_token_id] == 3 and types[-1] == 5
    _, gguf_tok = jaxtune.from_pretrained(tmp_path / "out" / "m.gguf", dtype="float32")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="m.gguf")
    for text in ("Paris ünïcode 42", "hello  world\nThe fox", "The lazy dog."):
        want = tok(text)["input_ids"]
        assert want[0] == sp.bos_token_id and gguf_tok(text)["input_ids"] == want and hf_tok(text)["input_ids"] == want
        assert gguf_tok.decode(want, skip_special_tokens=True) == text
    assert gguf_tok.chat_template == tok.chat_template


def test_smollm2_fine_tune_round_trips_through_gguf(tmp_path, tuned_smollm2, short_smollm2_path):
    """SmolLM2's tokenizer, chat template and layout survive the export; the 2-layer cut's greedy answers sit near
    ties, so it goes through f32 (bf16's rounding is test_gguf_reads_back_like_the_merged_checkpoint's)."""
    model, tokenizer = tuned_smollm2
    prompts = [[{"role": "user", "content": c}] for c in ("Say 3", "What is the capital of France?",
                                                          "Write a haiku about rain.")]
    want = jaxtune.generate(model, tokenizer, prompts, max_new_tokens=12)
    jaxtune.save_gguf(model, tmp_path / "tuned.gguf", tokenizer=tokenizer, base=short_smollm2_path, gguf_type="f32")
    reimported, gguf_tok = jaxtune.from_pretrained(tmp_path / "tuned.gguf", dtype="float32")
    assert jaxtune.generate(reimported, gguf_tok, prompts, max_new_tokens=12) == want
    assert gguf_tok("Hello 12345 world")["input_ids"] == tokenizer("Hello 12345 world")["input_ids"]
    assert gguf_tok.chat_template == tokenizer.chat_template
    # every token typed as llama.cpp's converter typed the bundled file (its unk <|endoftext|> CONTROL, not UNKNOWN)
    import gguf

    from jaxtune.io.bundled import bundled_path

    types = gguf.GGUFReader(tmp_path / "tuned.gguf").fields["tokenizer.ggml.token_type"].contents()
    assert types == gguf.GGUFReader(bundled_path("smollm2")).fields["tokenizer.ggml.token_type"].contents()
    assert types[tokenizer.unk_token_id] == 3


def test_gguf_export_refusals_are_clear_and_leave_no_file(tmp_path, tiny_tokenizer, monkeypatch):
    import convert.gguf_export as gguf_export

    model, tok = _trained_like(tmp_path, LlamaConfig(vocab_size=len(tiny_tokenizer), **SMALL), tiny_tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(jaxtune.CheckpointError, match="end in .gguf"):
        jaxtune.save_gguf(model, out / "model.bin", tokenizer=tok)
    with pytest.raises(jaxtune.CheckpointError, match="unknown GGUF type 'q4_k'"):
        jaxtune.save_gguf(model, out / "m.gguf", tokenizer=tok, gguf_type="q4_k")
    calls = []

    def fail_on_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_encode(*args)

    real_encode = gguf_export._encode
    monkeypatch.setattr(gguf_export, "_encode", fail_on_third)
    with pytest.raises(OSError, match="disk full"):
        jaxtune.save_gguf(model, out / "m.gguf", tokenizer=tok, base=tmp_path / "base")
    assert list(out.iterdir()) == []  # neither the file nor its partial
    (out / "m.gguf").write_bytes(b"x")
    with pytest.raises(jaxtune.CheckpointError, match="already exists"):
        jaxtune.save_gguf(model, out / "m.gguf", tokenizer=tok)

    build_hf_model(Qwen2Config(vocab_size=len(tiny_tokenizer), **SMALL), tmp_path / "qwen")
    qwen, _ = jaxtune.from_pretrained(tmp_path / "qwen", dtype="float32")
    jaxtune.get_peft_model(qwen, r=4, lora_alpha=8)
    with pytest.raises(jaxtune.UnsupportedModelError, match="GGUF export covers llama, mistral, mixtral, qwen3, qwen3_moe, gpt_oss models, not 'qwen2'"):
        jaxtune.save_gguf(qwen, out / "q.gguf", tokenizer=tok)


def test_gguf_names_and_qk_permutation_invert_the_importer():
    from convert.gguf_export import gguf_name, permute_qk
    from convert.gguf_source import _hf_name, unpermute_qk

    for name in ("token_embd.weight", "output.weight", "output_norm.weight", "blk.7.attn_q.weight",
                 "blk.0.ffn_down.weight", "blk.12.attn_norm.weight", "blk.3.ffn_norm.weight"):
        assert gguf_name(_hf_name(name)) == name
    w = np.random.default_rng(0).standard_normal((6 * 8, 5))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 6), 6), w)
    # llama.cpp's interleaved order: within a head, row 2i is the first half's row i, row 2i+1 the second half's
    head = permute_qk(w, 6)[:8]
    np.testing.assert_array_equal(head[0::2], w[:4])
    np.testing.assert_array_equal(head[1::2], w[4:8])


def _qwen3_moe(v: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=v, **SMALL, head_dim=16, moe_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True)


def _qwen3(v: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=v, **SMALL, head_dim=32, tie_word_embeddings=True)


@pytest.mark.parametrize("make_config, gguf_type, tol", [
    (_qwen3, "f32", 1e-4),
    (_qwen3, "q8_0", 5e-2),
    (_qwen3_moe, "f32", 1e-4),
    (_qwen3_moe, "q4_0", None),  # 4 bits: the bytes against the gguf package's quantizer instead of the logits
])
def test_qwen3_and_qwen3_moe_gguf_read_back_in_transformers_like_the_merged_checkpoint(
        tmp_path, tiny_tokenizer, make_config, gguf_type, tol):
    """llama.cpp's qwen3 / qwen3moe files: q/k rows as HF has them (NEOX RoPE), the q/k norms, the router and each
    layer's experts stacked [experts, out, in]; transformers' GGUF loader reads them to the merged model's logits,
    and the metadata carries llama.cpp's keys."""
    import gguf

    config = make_config(len(tiny_tokenizer))
    model, tok = _trained_like(tmp_path, config, tiny_tokenizer)
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    jaxtune.save_gguf(model, tmp_path / "out" / "model.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type=gguf_type)
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[config.model_type]
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == arch and fields[f"{arch}.attention.key_length"] == config.head_dim
    assert fields[f"{arch}.block_count"] == 2 and fields[f"{arch}.attention.head_count_kv"] == 2
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # numpy order
    assert shapes["blk.1.attn_q_norm.weight"] == shapes["blk.1.attn_k_norm.weight"] == (config.head_dim,)
    if config.model_type == "qwen3_moe":
        assert (fields[f"{arch}.expert_count"], fields[f"{arch}.expert_used_count"],
                fields[f"{arch}.expert_feed_forward_length"]) == (4, 2, 64)
        assert shapes["blk.0.ffn_gate_inp.weight"] == (4, 64)
        assert shapes["blk.0.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == (4, 64, 64)
        assert shapes["blk.1.ffn_down_exps.weight"] == (4, 64, 64) and "blk.0.ffn_gate.weight" not in shapes
    if tol is None:  # each stack is the merged experts stacked, quantized as the gguf package quantizes them
        from safetensors.numpy import load_file

        merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
        stored = {t.name: t for t in reader.tensors}
        for i in range(2):
            for proj in ("gate", "up", "down"):
                t = stored[f"blk.{i}.ffn_{proj}_exps.weight"]
                want = np.stack([merged[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(4)])
                assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
                np.testing.assert_array_equal(np.asarray(t.data).reshape(-1),
                                              gguf.quants.quantize(want, t.tensor_type).reshape(-1))
        return
    ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), size=(2, 12))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids)
    via_transformers = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf", config=config,
                                                            dtype=torch.float32).eval()
    assert np.abs(_logits(via_transformers, ids) - merged).max() < tol
    reimported, gguf_tok = jaxtune.from_pretrained(tmp_path / "out" / "model.gguf", dtype="float32")
    assert reimported.config.model_type == config.model_type
    assert np.abs(np.asarray(reimported(ids)) - _logits(via_transformers, ids)).max() < 1e-4  # one file, read two ways
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    assert hf_tok(TEXT)["input_ids"] == tok(TEXT)["input_ids"] == gguf_tok(TEXT)["input_ids"]


def test_mixtral_gguf_holds_the_merged_experts_as_llama_cpp_reads_them(tmp_path, tiny_tokenizer):
    """Mixtral as llama.cpp's `llama` with experts: the router and the stacked experts are the merged checkpoint's
    (transformers-tested) tensors, q/k in llama.cpp's order; jaxtune reads the file back to the merged logits."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import MixtralConfig

    from convert.gguf_export import permute_qk

    config = MixtralConfig(vocab_size=len(tiny_tokenizer), **SMALL, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=None)
    model, tok = _trained_like(tmp_path, config, tiny_tokenizer)
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    jaxtune.save_gguf(model, tmp_path / "model.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type="f32")
    merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["llama.expert_count"] == 4
    assert fields["llama.expert_used_count"] == 2 and fields["llama.expert_feed_forward_length"] == 128
    stored = {t.name: np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    for i in range(2):
        moe = f"model.layers.{i}.block_sparse_moe"
        np.testing.assert_array_equal(stored[f"blk.{i}.ffn_gate_inp.weight"], merged[f"{moe}.gate.weight"])
        for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            want = np.stack([merged[f"{moe}.experts.{e}.{w}.weight"] for e in range(4)])
            np.testing.assert_array_equal(stored[f"blk.{i}.ffn_{proj}_exps.weight"], want)
        np.testing.assert_array_equal(stored[f"blk.{i}.attn_k.weight"],
                                      permute_qk(merged[f"model.layers.{i}.self_attn.k_proj.weight"], 2))
    ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), size=(2, 12))
    want = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids)
    reimported, _ = jaxtune.from_pretrained(tmp_path / "model.gguf", dtype="float32")
    assert reimported.config.model_type == "mixtral"
    assert np.abs(np.asarray(reimported(ids)) - want).max() < 1e-4


def test_yarn_rope_is_refused_in_one_line_before_writing(tmp_path, tiny_tokenizer):
    """A Qwen3 with YaRN RoPE (its long-context setting) trains and exports merged; GGUF export names what it
    lacks and the fix, and writes nothing."""
    from jaxtune.models.causal_lm import init_model
    from jaxtune.models.config import ModelConfig

    config = ModelConfig(model_type="qwen3", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, rope_type="yarn",
                         rope_factor=4.0, rope_original_max_position=32768, rope_attention_factor=1.1386)
    model = jaxtune.get_peft_model(init_model(config, dtype="float32", seed=0), r=4)
    out = tmp_path / "out"
    with pytest.raises(jaxtune.UnsupportedModelError, match="YaRN RoPE scaling.*export --merged"):
        jaxtune.save_gguf(model, out / "m.gguf", tokenizer=tiny_tokenizer)
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("case", ["gpt_oss_yarn", "gpt_oss_plain_rope"])
def test_gpt_oss_gguf_gives_llama_cpps_logits_of_the_merged_model(tmp_path, tiny_tokenizer, case):
    """gpt-oss as llama.cpp's `gpt-oss` (sinks, biases, alternating windows, split gate/up experts, YaRN): the file
    written here is byte for byte the one llama.cpp read when its logits were recorded
    (tests/data/make_llama_cpp_gguf_logits.py), and those logits, every position of a row three windows long, equal
    transformers' of the merged checkpoint. With gpt-oss's YaRN, llama.cpp rounds the ramp's ends to whole pairs
    where transformers' gpt-oss does not: within the bound below at these shapes."""
    import hashlib
    import json
    from pathlib import Path

    from gguf_families import IDS, family_gguf

    recorded = json.loads((Path(__file__).parent / "data" / "llama_cpp_gguf_logits.json").read_text())[case]
    path, merged = family_gguf(case, tiny_tokenizer, str(tmp_path))
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == recorded["sha256"], \
        "the GGUF differs from the recorded one: rerun tests/data/make_llama_cpp_gguf_logits.py"
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    want = _logits(hf, [IDS])[0]
    got = np.asarray(recorded["logits"])
    # llama.cpp keeps its KV cache in f16: 3.1e-4 apart with plain RoPE, 4.9e-4 with YaRN (logits spanning ±1.4)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max(), np.abs(got - want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("gguf_type", ["q8_0", "f16", "bf16"])
def test_gpt_oss_gguf_types_and_bytes_are_llama_quantizes(tmp_path, tiny_tokenizer, gguf_type):
    """jaxtune's gpt-oss GGUF in q8_0, f16 and bf16: every tensor's type and bytes are what llama.cpp's quantizer
    wrote from the same f32 file (recorded by tests/data/make_llama_cpp_gguf_logits.py): the router, the norms,
    the sinks and every bias stay F32."""
    import hashlib
    import json
    from pathlib import Path

    import gguf

    from gguf_families import family_gguf

    recorded = json.loads((Path(__file__).parent / "data" / "llama_cpp_gguf_logits.json").read_text())
    _, merged = family_gguf("gpt_oss_yarn", tiny_tokenizer, str(tmp_path))
    model, _ = jaxtune.from_pretrained(merged, dtype="float32")
    path = tmp_path / f"{gguf_type}.gguf"
    jaxtune.save_gguf(model, path, tokenizer=tiny_tokenizer, gguf_type=gguf_type, name="gguf-case")
    got = {t.name: [t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()]
           for t in gguf.GGUFReader(path).tensors}
    assert got == recorded["gpt_oss_yarn"]["quantized"][gguf_type]
