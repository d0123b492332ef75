"""End-of-sequence ids as transformers' generate and TRL read them: the tokenizer's, config.json's and
generation_config.json's (Qwen2.5-Instruct lists its turn end and its text end there); kept through jaxtune's
checkpoint format and the merged export."""

from __future__ import annotations

import json

import pytest
import torch

import jaxtune
from conftest import build_hf_model
from jaxtune.generate import eos_token_ids, generate_tokens
from jaxtune.rl.rollout import rollout_rows


def _hf_eos(path) -> set[int]:
    """What TRL's GRPOTrainer stops at: the model's generation config ids and the tokenizer's eos."""
    from transformers import AutoTokenizer, GenerationConfig

    ids = GenerationConfig.from_pretrained(path).eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids)
    return {*ids, AutoTokenizer.from_pretrained(path).eos_token_id}


@pytest.fixture
def chat_model_dir(tmp_path, tiny_tokenizer):
    """A random Llama whose config.json names <|im_end|> and whose generation_config.json adds a token it greedily
    writes after the prompt (so generation stops there only if that file is read)."""
    from transformers import GenerationConfig, LlamaConfig

    path = tmp_path / "hf"
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=im_end, bos_token_id=1)
    hf = build_hf_model(config, path)
    tiny_tokenizer.save_pretrained(path)
    prompt = tiny_tokenizer("The quick brown fox")["input_ids"]
    with torch.no_grad():
        free = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=im_end,
                           pad_token_id=0)[0, len(prompt):].tolist()
    # the first token after the first that the row has not written before: only the added id stops it there
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != im_end)
    stop = free[k]
    GenerationConfig(bos_token_id=1, eos_token_id=[im_end, stop]).save_pretrained(path)
    return path, prompt, hf, stop


def test_generate_stops_at_generation_config_eos_as_transformers_does(chat_model_dir, tiny_tokenizer):
    path, prompt, hf, stop = chat_model_dir
    with torch.no_grad():  # transformers reads generation_config.json itself
        want = hf.generation_config.__class__.from_pretrained(path)
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, generation_config=want,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert reference[-1] == stop and len(reference) > 1
    model, tok = jaxtune.from_pretrained(path, dtype="float32")
    eos = eos_token_ids(model, tok)
    assert set(eos) == _hf_eos(path)
    assert generate_tokens(model, [prompt], max_new_tokens=8, eos_ids=eos) == [reference[:-1]]
    # a completion ending in the second id ended: not truncated, so mask_truncated_completions keeps it
    rows, truncated = rollout_rows([prompt], [reference], 24, eos, mask_truncated=True)
    assert not truncated[0] and (rows["labels"][0] >= 0).sum() == len(reference)


def test_generation_eos_ids_survive_convert_and_the_merged_export(chat_model_dir, tmp_path):
    path, _, _, stop = chat_model_dir
    jaxtune.convert(path, tmp_path / "nf4")
    model, tok = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")
    assert set(eos_token_ids(model, tok)) == _hf_eos(path)
    jaxtune.get_peft_model(model, r=2)
    jaxtune.save_merged(model, tmp_path / "merged", base=path, tokenizer=tok, dtype="float32")
    assert _hf_eos(tmp_path / "merged") == _hf_eos(path)


def test_a_malformed_generation_config_is_named_in_one_line(chat_model_dir):
    path = chat_model_dir[0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(jaxtune.CheckpointError, match=r"generation_config.json has eos_token_id \['x'\]"):
        jaxtune.from_pretrained(path)
    (path / "generation_config.json").write_text("{")
    with pytest.raises(jaxtune.CheckpointError, match="generation_config.json is not valid JSON"):
        jaxtune.from_pretrained(path)
