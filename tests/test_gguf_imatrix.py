"""GGUF export with an importance matrix: the matrix jaxtune computes equals the squares torch's projections see
(adapters included, through peft); written in llama.cpp's imatrix layout, llama-quantize reads it, and
`save_gguf(..., imatrix=...)` writes the very bytes `llama-quantize --imatrix` writes from the same f32 file
(recorded by tests/data/make_llama_quantize_imatrix.py); the CLI computes one from a data file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import jaxtune
from conftest import build_hf_model, set_random_lora
from gguf_mixes import IMATRIX_CASES, IMATRIX_FTYPES, imatrix_model, seeded_imatrix

RECORDED = json.loads((Path(__file__).parent / "data" / "llama_quantize_imatrix.json").read_text())
_KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def test_the_importance_matrix_is_the_squares_torchs_projections_see(tmp_path):
    """Every projection's input squares summed over the real tokens (a padded row's padding left out), with LoRA
    adapters changing what reaches the later layers: the sums hooks on peft + transformers' modules collect."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig

    from convert.imatrix import compute_importance
    from jaxtune.data.packing import PackedRows

    build_hf_model(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    jaxtune.save_peft(model, tmp_path / "peft")
    ids = np.random.default_rng(0).integers(0, 96, (3, 10)).astype(np.int32)
    segments = np.ones_like(ids)
    segments[2, 6:] = 0  # the third row: 6 tokens, then padding
    rows = PackedRows(ids, ids, segments, np.broadcast_to(np.arange(10, dtype=np.int32), ids.shape).copy(), 0)
    with __import__("jax").default_matmul_precision("highest"):
        ours = compute_importance(model, rows, batch_size=2, progress=False)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    want: dict[str, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for parent in ("self_attn", "mlp"):
            for name, module in getattr(layer, parent).named_children():
                if name in _KINDS:
                    key = f"blk.{i}.{_KINDS[name]}.weight"
                    hooks.append(module.register_forward_pre_hook(
                        lambda m, args, key=key: want.__setitem__(
                            key, want.get(key, 0) + (args[0].double() ** 2).sum((0, 1)).numpy())))
    with torch.no_grad():
        for row, length in zip(ids, (10, 10, 6)):
            peft_model(torch.as_tensor(row[None, :length], dtype=torch.long))
    for h in hooks:
        h.remove()
    assert sorted(ours.sums) == sorted(want) and len(want) == 14
    for key, value in want.items():
        np.testing.assert_allclose(ours.sums[key], value, rtol=1e-4, err_msg=key)
        assert ours.counts[key] == 26


def test_an_importance_matrix_round_trips_through_llama_cpps_file_layout(tmp_path):
    model = imatrix_model("qwen3_192_wide", 64)
    matrix = seeded_imatrix(model)
    matrix.save(tmp_path / "imatrix.gguf")
    from convert.imatrix import ImportanceMatrix

    back = ImportanceMatrix.load(tmp_path / "imatrix.gguf")
    assert sorted(back.sums) == sorted(matrix.sums) and back.counts == matrix.counts
    for name in matrix.sums:
        np.testing.assert_array_equal(back.sums[name], matrix.sums[name])
        np.testing.assert_array_equal(back.weights(name), matrix.sums[name] / np.float32(1000))
    assert (back.chunk_size, back.chunk_count) == (512, 2)
    reader = gguf.GGUFReader(tmp_path / "imatrix.gguf")
    assert bytes(reader.fields["general.type"].parts[-1]).decode() == "imatrix"


@pytest.mark.parametrize("case", IMATRIX_CASES)
def test_imatrix_gguf_bytes_are_llama_quantizes(case, tiny_tokenizer, tmp_path):
    """q4_0 (the first eighth of ffn_down in q4_1, llama-quantize's guard with an importance matrix), q4_k_m (its
    q6_K, q5_0 and q8_0 fallbacks for 192-wide rows) and q6_k: every tensor's bytes are llama-quantize --imatrix's
    from jaxtune's f32 file with the same imatrix file."""
    model = imatrix_model(case, len(tiny_tokenizer))
    seeded_imatrix(model).save(tmp_path / "imatrix.gguf")
    for ftype in IMATRIX_FTYPES:
        path = tmp_path / f"{ftype}.gguf"
        jaxtune.save_gguf(model, path, tokenizer=tiny_tokenizer, gguf_type=ftype, imatrix=tmp_path / "imatrix.gguf")
        tensors = gguf.GGUFReader(path).tensors
        assert {t.name: t.tensor_type.name for t in tensors} == RECORDED[case]["types"][ftype]
        ours = {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in tensors}
        want = RECORDED[case]["sha256"][ftype]
        assert [n for n in ours if ours[n] != want[n]] == [], ftype
        path.unlink()
    if case == "llama_16_layers":
        types = RECORDED[case]["types"]["q4_0"]
        assert types["blk.1.ffn_down.weight"] == "Q4_1" and types["blk.2.ffn_down.weight"] == "Q4_0"


def test_the_cli_computes_an_importance_matrix_from_the_training_data(tmp_path, tiny_tokenizer, capsys):
    """`export RUN --gguf-imatrix DATA` runs the tuned model over the run's own kind of rows and weights the
    q4_k_m quantizers with it: a file unlike the plain export's, which llama.cpp's reader (transformers' GGUF
    loader) reads to logits close to the plain file's; bad uses are refused in one line before loading."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from jaxtune.cli import main

    build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=256, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    rows = [{"prompt": f"hello {i}", "completion": f" world {i}"} for i in range(16)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--format",
                 "completion", "--out", str(tmp_path / "run"), "--max-steps", "2", "--seq-len", "32",
                 "--batch-size", "2", "--lora-r", "4", "--dtype", "float32"]) == 0
    for name, extra in (("plain", []), ("weighted", ["--gguf-imatrix", str(tmp_path / "d.jsonl")])):
        assert main(["export", str(tmp_path / "run"), "--gguf", str(tmp_path / f"{name}.gguf"), "--gguf-type",
                     "q4_k_m", *extra]) == 0
    assert "weighted by the importance matrix of" in capsys.readouterr().out
    plain, weighted = ({t.name: t.data.tobytes() for t in gguf.GGUFReader(tmp_path / f"{n}.gguf").tensors}
                       for n in ("plain", "weighted"))
    assert plain["blk.0.attn_q.weight"] != weighted["blk.0.attn_q.weight"]
    assert plain["output.weight"] == weighted["output.weight"]  # llama-imatrix collects no statistics for it
    ids = torch.as_tensor([[5, 9, 17, 33, 40]])
    logits = [AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{n}.gguf", dtype=torch.float32)(ids).logits
              for n in ("plain", "weighted")]
    assert float((logits[0] - logits[1]).abs().max()) < 0.5 * float(logits[0].abs().max())
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no prompt here"}) + "\n")
    (tmp_path / "bad.gguf").write_text("not a gguf")
    for argv, message in [
        (["--gguf", str(tmp_path / "x.gguf"), "--gguf-type", "q4_0", "--gguf-imatrix", str(tmp_path / "bad.jsonl")],
         "missing field 'prompt'"),
        (["--gguf", str(tmp_path / "x.gguf"), "--gguf-type", "q4_0", "--gguf-imatrix", str(tmp_path / "bad.gguf")],
         "is not a GGUF file"),
        (["--gguf", str(tmp_path / "x.gguf"), "--gguf-type", "q8_0", "--gguf-imatrix", str(tmp_path / "d.jsonl")],
         "does not use one"),
        (["--gguf", str(tmp_path / "x.gguf"), "--gguf-type", "q4_0", "--gguf-imatrix", str(tmp_path / "nope.gguf")],
         "does not exist"),
        (["--peft", str(tmp_path / "p"), "--gguf-imatrix", str(tmp_path / "d.jsonl")], "pass --gguf"),
    ]:
        assert main(["export", str(tmp_path / "run"), *argv]) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "p").exists()
