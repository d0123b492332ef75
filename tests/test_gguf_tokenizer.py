"""GGUF tokenizers built without torch equal transformers' own GGUF tokenizers (ids, special tokens, chat
template, decoding) on the bundled SmolLM2 and on small byte-level and SentencePiece files written here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = ["Hello 2024 world", "  leading spaces\n\ttabs and\r\nnewlines", "Héllo wörld ✓ 日本語 🙂",
         "don't WON'T 1234567 x=3.14", "Paris is the capital of France.</s> ok"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Extract: Amara, 41, pilot in Oslo."}, {"role": "assistant", "content": '{"a": 1}'},
     {"role": "user", "content": "again  with   spaces\n\n"}],
]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, and Lisbon of Portugal.",
          "hello world, hello there; numbers 12345 and 6789", "Extract the person as JSON with keys name, age."] * 4


def _reference(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _ours(path: str):
    from convert.gguf_source import GGUFSource

    return GGUFSource(path).tokenizer()


def assert_same_tokenizer(ours, ref, chat: bool = True) -> None:
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    if chat:
        for messages in CHATS:
            for gen in (False, True):
                text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == text
                assert ours(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]


def test_smollm2_tokenizer_equals_transformers(smollm2_path):
    ours, ref = _ours(smollm2_path), _reference(smollm2_path)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert_same_tokenizer(ours, ref)


def _write_gguf(path, *, model: str, tokens: list[str], types: list[int], scores=None, merges=None, pre=None,
                add_bos: bool | None = None, template: str | None = None) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_gguf_tokenizer_equals_transformers(tmp_path, add_bos):
    """Llama-2 / Mistral style: byte fallback, merges recovered from the scores, BOS by the file's flag."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    tokens, types = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)], [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(sorted(sp.get_vocab().items(), key=lambda kv: kv[1])):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    tokens.append("<|user|>")  # user-defined: kept whole
    types.append(4)
    scores.append(0.0)
    path = _write_gguf(tmp_path / "sp.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                       add_bos=add_bos, template=TEMPLATE)
    ours, ref = _ours(path), _reference(path)
    assert ours("hi")["input_ids"][0] == 1 if add_bos in (None, True) else ours("hi")["input_ids"][0] != 1
    assert_same_tokenizer(ours, ref)
    assert ours("<|user|> x", add_special_tokens=False)["input_ids"][0] == len(tokens) - 1


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_byte_level_gguf_tokenizer_equals_transformers(tmp_path, pre):
    """Llama-3 / Qwen2 style byte-level BPE: the split regex follows tokenizer.ggml.pre."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # "<|endoftext|>" first: transformers' byte-level builder adds it when the vocabulary lacks it (ours does not)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    model = bpe.to_str()
    import json

    spec = json.loads(model)["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    types = [3 if t in ("<|endoftext|>", "<s>", "</s>") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    path = _write_gguf(tmp_path / "bl.gguf", model="gpt2", tokens=tokens, types=types, merges=merges, pre=pre,
                       add_bos=True, template=TEMPLATE)
    assert_same_tokenizer(_ours(path), _reference(path))


DIGIT_TEXTS = ["a  12 b", "version 1.2.3  and  99 bottles", "x =  3.14,   y=1000000", "\t 7\n  8"]
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def test_smollm_pre_tokenizer_splits_digits_first_as_llama_cpp_does(smollm2_path):
    """llama.cpp's "smollm" pre-tokenizer isolates every digit, then applies GPT-2's split (its two regexes, here
    as a reference pipeline); spaces before a number tokenize differently without the digit step."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    ours = _ours(smollm2_path)
    reference = Tokenizer.from_str(ours.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(GPT2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2_only = Tokenizer.from_str(ours.backend_tokenizer.to_str())
    gpt2_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for text in DIGIT_TEXTS + TEXTS:
        assert ours(text, add_special_tokens=False)["input_ids"] == reference.encode(text, add_special_tokens=False).ids
    assert ours("a  12 b", add_special_tokens=False)["input_ids"] != gpt2_only.encode("a  12 b").ids


def test_digit_splitting_tokenizer_exports_as_smollm_and_reads_back_equal(tmp_path):
    """A byte-level tokenizer that splits digits first (SmolLM2's HF tokenizer) is written with llama.cpp's
    "smollm" pre-tokenizer and reads back with the same ids as the original."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from convert.gguf_tokenizer import gguf_tokenizer_fields

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS + ["a  12 b  99 and   3 7"] * 4, trainer)
    original = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    fields = gguf_tokenizer_fields(original, len(original))
    assert fields["tokenizer.ggml.pre"] == "smollm"
    types = [3 if t in ("<|endoftext|>", "<s>", "</s>") else 1 for t in fields["tokenizer.ggml.tokens"]]
    path = _write_gguf(tmp_path / "digits.gguf", model="gpt2", tokens=fields["tokenizer.ggml.tokens"], types=types,
                       merges=fields["tokenizer.ggml.merges"], pre="smollm", add_bos=False)
    ours = _ours(path)
    for text in DIGIT_TEXTS + TEXTS:
        assert ours(text)["input_ids"] == original(text)["input_ids"], text


def test_unsupported_gguf_tokenizer_is_a_clear_error(tmp_path):
    from jaxtune.errors import UnsupportedModelError

    path = _write_gguf(tmp_path / "uni.gguf", model="t5", tokens=["<unk>", "<s>", "</s>", "a"], types=[2, 3, 3, 1],
                       scores=[0.0, 0.0, 0.0, -1.0])
    with pytest.raises(UnsupportedModelError, match="'t5' tokenizer.*gpt2 or llama"):
        _ours(path)


def test_gguf_model_and_tokenizer_load_where_torch_cannot_be_imported(smollm2_path):
    """The base install has no torch: loading a GGUF (weights, tokenizer, chat template) must not need it."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # `import torch` raises ImportError from here on
        import jaxtune
        model, tok = jaxtune.from_pretrained({smollm2_path!r}, dtype="float32")
        ids = tok.apply_chat_template([{{"role": "user", "content": "Hi"}}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert tok.decode(ids).startswith("<|im_start|>system"), tok.decode(ids)
        assert model.config.vocab_size == len(tok) == 49152
        print("ok", len(ids))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
