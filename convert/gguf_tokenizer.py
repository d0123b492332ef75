"""The tokenizer a GGUF file describes, built from its metadata with `gguf` and `tokenizers` (no torch).

A GGUF carries no tokenizer.json: it stores llama.cpp's `tokenizer.ggml.*` keys (vocabulary, merges or
scores, token types, special ids, chat template). Those are handed to transformers' own tokenizer classes
(GPT2Tokenizer for byte-level BPE, LlamaTokenizer for SentencePiece BPE), so the result is an ordinary
fast tokenizer with `apply_chat_template`, equal to what `AutoTokenizer.from_pretrained(..., gguf_file=)`
gives, without that route's torch import.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxtune.errors import UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# llama.cpp pre-tokenizer names -> the split regex the vocabulary's merges were learned with
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")}
PRE_TOKENIZER_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})
# llama.cpp names whose split isolates every digit, then applies GPT-2's regex (SmolLM2's HF tokenizer: Digits then
# ByteLevel); without the digit step, spaces before a number would merge differently ("a  12" -> "Ġ","Ġ" vs "ĠĠ")
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
SUPPORTED_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE


def tokenizer_from_gguf(field: Callable[[str], Any], where: str):
    """A transformers fast tokenizer from GGUF metadata; `field(key)` returns a key's value or None."""
    from tokenizers import AddedToken, Regex, pre_tokenizers

    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if kind not in SUPPORTED_MODELS or tokens is None:
        raise UnsupportedModelError(
            f"{where} describes a {kind!r} tokenizer; jaxtune builds GGUF tokenizers of type "
            f"{' or '.join(SUPPORTED_MODELS)} (or convert the model from its HF directory instead)"
        )
    special = {name: tokens[int(index)] for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))
               if (index := field(f"tokenizer.ggml.{key}")) is not None and 0 <= int(index) < len(tokens)}
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, field("tokenizer.ggml.merges"), special)
        pre = field("tokenizer.ggml.pre")
        split = PRE_TOKENIZER_SPLITS.get(pre)
        if split is not None:
            tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in DIGITS_THEN_GPT2:
            tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer = _sentencepiece(tokens, field("tokenizer.ggml.merges"), field("tokenizer.ggml.scores"), special,
                                   field("tokenizer.ggml.add_space_prefix"))

    types = field("tokenizer.ggml.token_type") or ()
    alphabet = set(_byte_spelling().values()) if kind == "gpt2" else None
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control})
    vocab = tokenizer.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)

    add_bos = field("tokenizer.ggml.add_bos_token")
    add_bos = (kind == "llama") if add_bos is None else bool(add_bos)  # llama.cpp's default for SentencePiece
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, **special,
        add_bos_token=add_bos, add_eos_token=bool(field("tokenizer.ggml.add_eos_token")),
        chat_template=field("tokenizer.chat_template"))


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level vocabulary's alphabet)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _byte_level(tokens: list[str], merges: list[str] | None, special: dict[str, str]):
    """GPT-2 style byte-level BPE; tokens spelled outside the byte alphabet are re-spelled into it."""
    from transformers import GPT2Tokenizer

    if merges is None:
        raise UnsupportedModelError("the GGUF byte-level tokenizer has no tokenizer.ggml.merges; the file is incomplete")
    spell = _byte_spelling()
    alphabet = set(spell.values())
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    return GPT2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], **special)


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None,
                   special: dict[str, str], add_space_prefix: Any):
    """SentencePiece BPE (Llama 2, Mistral): merges from the file, or recovered from the token scores."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif scores is not None:
        pairs = generate_merges(vocab, dict(zip(tokens, scores)))
    else:
        raise UnsupportedModelError("the GGUF SentencePiece tokenizer has neither merges nor scores; the file is incomplete")
    prefix = True if add_space_prefix is None else bool(add_space_prefix)
    return LlamaTokenizer(vocab=vocab, merges=pairs, add_prefix_space=prefix, legacy=False, add_bos_token=False, **special)


# ---- the reverse: a transformers fast tokenizer -> GGUF tokenizer metadata ----

NORMAL, UNKNOWN, UNUSED, BYTE = 1, 2, 5, 6  # llama.cpp token types (with CONTROL, USER_DEFINED above)
_GPT2_DEFAULT_SPLIT = "gpt-2"  # llama.cpp's name for GPT-2's own pre-tokenizer regex (ByteLevel use_regex=True)


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json `pre_tokenizer` (inverse of PRE_TOKENIZER_SPLITS)."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    for step in steps:
        pattern = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        if pattern is not None:
            names = [name for name, split in PRE_TOKENIZER_SPLITS.items() if split == pattern]
            if names:
                return names[0] if names[0] != "llama3" else "llama-bpe"
            raise UnsupportedModelError(
                "the tokenizer splits text with a regex llama.cpp has no name for; GGUF export covers the Llama 3 "
                "and Qwen2 splits and GPT-2's own")
    byte_level = [s for s in steps if s.get("type") == "ByteLevel" and s.get("use_regex", True)]
    if byte_level and len(steps) == 1:
        return _GPT2_DEFAULT_SPLIT
    if byte_level and len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits"):
        return DIGITS_THEN_GPT2[0]
    raise UnsupportedModelError("the tokenizer's pre-tokenizer has no llama.cpp equivalent; GGUF export covers the "
                                "Llama 3, Qwen2, SmolLM2 and GPT-2 byte-level pre-tokenizers")


def _merge_strings(merges: list[Any]) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def gguf_tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """`tokenizer.ggml.*` / `tokenizer.chat_template` values for a transformers fast BPE tokenizer.

    Byte-level BPE (Llama 3, Qwen2, GPT-2 style) is written as llama.cpp's "gpt2" model with merges and the
    pre-tokenizer's name; SentencePiece-style BPE (byte fallback: Llama 2, Mistral) as its "llama" model with
    scores (higher merges first) and merges. Ids the tokenizer does not use up to the model's vocabulary size
    are padding tokens, as llama.cpp's converter writes them.
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedModelError("GGUF export needs a fast (tokenizers-backed) tokenizer; load it with "
                                    "AutoTokenizer.from_pretrained(..., use_fast=True)")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise UnsupportedModelError(f"GGUF export covers BPE tokenizers; this one is {model.get('type')!r}")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise UnsupportedModelError(f"the tokenizer has ids up to {max(vocab.values())} but the model's vocabulary is "
                                    f"{vocab_size}; export with the tokenizer the model was trained with")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i], types[i] = token, NORMAL
    for i, added in tokenizer.added_tokens_decoder.items():
        types[i] = CONTROL if added.special else USER_DEFINED
    merges = _merge_strings(model.get("merges") or [])
    fields: dict[str, Any] = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    if model.get("byte_fallback"):
        # SentencePiece's unknown piece, as llama.cpp's converter types it; a byte-level vocabulary's unk (SmolLM2's
        # <|endoftext|>) stays CONTROL, as there (typed otherwise, llama.cpp warns of a control-looking token)
        if tokenizer.unk_token_id is not None:
            types[tokenizer.unk_token_id] = UNKNOWN
        fields["tokenizer.ggml.model"] = "llama"
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        fields["tokenizer.ggml.scores"] = [-float(rank.get(t, 0)) if ty == NORMAL else 0.0
                                           for t, ty in zip(tokens, types)]
        for i, t in enumerate(tokens):  # byte-fallback pieces, whether in the model's vocab or added
            if types[i] != UNUSED and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = BYTE
        normalizer = json.dumps(spec.get("normalizer")) + json.dumps(spec.get("pre_tokenizer"))
        fields["tokenizer.ggml.add_space_prefix"] = '"Prepend"' in normalizer or '"prepend_scheme": "first"' in normalizer \
            or '"prepend_scheme": "always"' in normalizer
    else:
        fields["tokenizer.ggml.model"] = "gpt2"
        fields["tokenizer.ggml.pre"] = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    fields["tokenizer.ggml.token_type"] = types
    for key, token_id in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                          ("unknown_token_id", tokenizer.unk_token_id), ("padding_token_id", tokenizer.pad_token_id)):
        if token_id is not None:
            fields[f"tokenizer.ggml.{key}"] = int(token_id)
    probe = tokenizer("a")["input_ids"]  # what encode() adds around text, as llama.cpp's add_bos/add_eos flags
    fields["tokenizer.ggml.add_bos_token"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    fields["tokenizer.ggml.add_eos_token"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id]
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        fields["tokenizer.chat_template"] = tokenizer.chat_template
    return fields
