"""Dataset formats -> token ids plus a mask of the tokens the loss is taken on.

`chat` rows hold `messages` rendered with the tokenizer's chat template; `alpaca` rows hold
instruction/input/output; `completion` rows hold prompt/completion; `text` rows hold text. By default the
loss covers only responses (assistant turns, output, completion); `train_on_all=True` covers everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxtune.data.sources import DataError, Row

FORMATS = ("chat", "alpaca", "completion", "text")
_ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
_ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    target: np.ndarray  # bool [n]: the loss predicts this token (from the one before it)


def _field(row: Row, name: str, kind: type = str) -> Any:
    if name not in row.data or row.data[name] is None:
        raise DataError(f"{row.where}: missing field {name!r}; every row of this format needs it")
    value = row.data[name]
    if not isinstance(value, kind):
        raise DataError(f"{row.where}: field {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _check_messages(messages: list, where: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] needs string fields 'role' and 'content'")


# the fields each format reads, with their types
FORMAT_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "chat": (("messages", list),),
    "alpaca": (("instruction", str), ("output", str)),
    "completion": (("prompt", str), ("completion", str)),
    "text": (("text", str),),
}


def check_rows(rows: Sequence[Row], fmt: str) -> None:
    """Every row holds the fields `fmt` reads, of the right types: a dataset's mistakes found before a model
    loads (tokenizing, which needs the model's tokenizer, checks the rest)."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; supported: {', '.join(FORMATS)}")
    for row in rows:
        for name, kind in FORMAT_FIELDS[fmt]:
            value = _field(row, name, kind)
            if fmt == "chat":
                _check_messages(value, row.where)


def _ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer: Any) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]


def _chat(tokenizer: Any, messages: list[dict[str, str]], where: str, train_on_all: bool) -> Example:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: format 'chat' needs a tokenizer with a chat template; use format 'text' or 'completion'")
    _check_messages(messages, where)

    def render(msgs, generation_prompt=False) -> list[int]:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        return _ids(tokenizer, text, special=False)

    ids = render(messages)
    target = np.full(len(ids), train_on_all, bool)
    if not train_on_all:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(render(messages[:i], generation_prompt=True))
            end = len(render(messages[: i + 1]))
            target[start:end] = True
    return Example(np.asarray(ids, np.int32), target)


def _prompt_response(tokenizer: Any, prompt: str, response: str, train_on_all: bool) -> Example:
    p = _ids(tokenizer, prompt, special=True)
    r = _ids(tokenizer, response, special=False) + _eos(tokenizer)
    target = np.concatenate([np.full(len(p), train_on_all, bool), np.ones(len(r), bool)])
    return Example(np.asarray(p + r, np.int32), target)


def encode_row(row: Row, fmt: str, tokenizer: Any, *, train_on_all: bool = False) -> Example:
    """One row -> Example, with errors that name the file, line and field."""
    if fmt == "chat":
        return _chat(tokenizer, _field(row, "messages", list), row.where, train_on_all)
    if fmt == "alpaca":
        instruction, output = _field(row, "instruction"), _field(row, "output")
        extra = row.data.get("input") or ""
        if getattr(tokenizer, "chat_template", None):
            user = instruction if not extra else f"{instruction}\n\n{extra}"
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return _chat(tokenizer, messages, row.where, train_on_all)
        template = _ALPACA_PROMPT_INPUT if extra else _ALPACA_PROMPT
        return _prompt_response(tokenizer, template.format(instruction=instruction, input=extra), output, train_on_all)
    if fmt == "completion":
        return _prompt_response(tokenizer, _field(row, "prompt"), _field(row, "completion"), train_on_all)
    if fmt == "text":
        ids = _ids(tokenizer, _field(row, "text"), special=True) + _eos(tokenizer)
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool))
    raise DataError(f"unknown data format {fmt!r}; supported: {', '.join(FORMATS)}")


def encode_rows(rows: Sequence[Row], fmt: str, tokenizer: Any, *, train_on_all: bool = False,
                progress: bool = True) -> list[Example]:
    """Tokenizes every row (with a progress bar); rows with nothing to learn from are an error."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; supported: {', '.join(FORMATS)}")
    if not rows:
        raise DataError("the dataset is empty; it needs at least one row")
    examples = []
    for row in tqdm(rows, desc="tokenizing", unit="row", leave=False, disable=not progress):
        ex = encode_row(row, fmt, tokenizer, train_on_all=train_on_all)
        if len(ex.ids) < 2 or not ex.target[1:].any():
            raise DataError(f"{row.where}: the row has no response tokens to train on; check its fields")
        examples.append(ex)
    return examples
