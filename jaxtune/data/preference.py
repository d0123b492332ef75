"""Preference pairs (prompt, chosen, rejected) -> token ids -> rows that hold both responses of each pair.

Rows follow TRL's preference formats: `prompt`, `chosen` and `rejected` as strings, or as message lists
(conversational: rendered with the chat template; without `prompt`, the messages chosen and rejected share
are the prompt). Tokenization is TRL's: the prompt alone and prompt + response are tokenized, and the response
starts where the two diverge; plain-text responses end with the EOS token.

A pair occupies one row, so one forward pass scores both responses; several pairs share a row when they fit.
With `share_prompt` (the default) the prompt runs once: the row holds the prompt but its last token, then that
token followed by the chosen response, then that token again followed by the rejected one, and each response
attends to the prompt and itself (attention ids: prompt p, branches -2p and -2p-1; see
`ops.context.shared_prefix_segments`). Without it the row holds prompt + chosen and prompt + rejected as two
packed sequences. Either way the loss segments are 2k+1 (pair k's prompt and chosen response) and 2k+2 (its
rejected response) and every next token is labeled exactly as in the two separate sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxtune.data.formats import _check_messages
from jaxtune.data.packing import IGNORE, PackedRows, _FirstFit
from jaxtune.data.sources import DataError, Row


@dataclass(frozen=True)
class PreferencePair:
    prompt: np.ndarray  # int32 token ids
    chosen: np.ndarray
    rejected: np.ndarray
    where: str
    merged: bool = False  # the prompt's last token merged with the responses' first when tokenized together

    def prompt_cost(self, share_prompt: bool) -> int:
        """Tokens the prompt takes in a row: twice, or once plus its last token again for the second response."""
        n = len(self.prompt)
        return n + min(n, 1) if share_prompt else 2 * n

    def length(self, share_prompt: bool) -> int:
        """Tokens the pair takes in a row."""
        return self.prompt_cost(share_prompt) + len(self.chosen) + len(self.rejected)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list)


def _fields(row: Row) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row, checked; a conversational row without a prompt gets the messages
    chosen and rejected start with as its prompt."""
    for name in ("chosen", "rejected"):
        if row.data.get(name) is None:
            raise DataError(f"{row.where}: missing field {name!r}; a preference row needs 'chosen' and 'rejected' "
                            "(and 'prompt')")
    chosen, rejected, prompt = row.data["chosen"], row.data["rejected"], row.data.get("prompt")
    conversational = _is_messages(chosen)
    for name, value in (("chosen", chosen), ("rejected", rejected)) + ((("prompt", prompt),) if prompt is not None else ()):
        if conversational and not _is_messages(value) or not conversational and not isinstance(value, str):
            kind = "message lists" if conversational else "strings"
            raise DataError(f"{row.where}: field {name!r} is a {type(value).__name__}, but this row's responses are "
                            f"{kind}; give prompt, chosen and rejected the same form")
        if conversational:
            _check_messages(value, f"{row.where}: {name}")
    if prompt is None:
        if not conversational:
            raise DataError(f"{row.where}: missing field 'prompt'; a row of plain-text responses needs one")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        text = "".join(m["content"] for m in value) if conversational else value
        if not text.strip():
            raise DataError(f"{row.where}: the {name} response is empty; give the pair two non-empty responses")
    return prompt, chosen, rejected


def check_preference_rows(rows: Sequence[Row]) -> None:
    """Every row is a usable preference pair (fields, types, non-empty responses): found before a model loads."""
    if not rows:
        raise DataError("the dataset is empty; it needs at least one preference row")
    for row in rows:
        _fields(row)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(row: Row, tokenizer: Any, objective: str = "dpo") -> PreferencePair:
    """One row -> token ids of its prompt and two responses, as TRL's trainer of `objective` tokenizes it.

    TRL's ORPOTrainer differs from its DPOTrainer in one way kept here: it puts the tokenizer's BOS token before a
    prompt that does not start with it (a plain-text prompt, where the tokenizer adds none itself)."""
    prompt, chosen, rejected = _fields(row)
    if _is_messages(chosen):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{row.where}: conversational preference rows need a tokenizer with a chat template; "
                            "give prompt, chosen and rejected as strings")

        def ids(messages, generation_prompt=False) -> list[int]:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        p, pc, pr = ids(prompt, True), ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token or ""
        end = lambda s: s if not eos or s.endswith(eos) else s + eos  # noqa: E731
        ids = lambda s: list(tokenizer(s)["input_ids"])  # noqa: E731
        p, pc, pr = ids(prompt), ids(prompt + end(chosen)), ids(prompt + end(rejected))
    bos = getattr(tokenizer, "bos_token_id", None)
    if objective == "orpo" and bos is not None and (not p or p[0] != bos):
        p, pc, pr = [bos] + p, [bos] + pc, [bos] + pr
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    as_array = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return PreferencePair(as_array(p[:n]), as_array(pc[n:]), as_array(pr[n:]), row.where, merged=n < len(p))


def encode_pairs(rows: Sequence[Row], tokenizer: Any, objective: str = "dpo", *,
                 progress: bool = True) -> list[PreferencePair]:
    """Tokenizes every row (with a progress bar); warns about pairs whose two responses are the same, and about
    prompts whose last token merges with the response's first (the response then starts one token early)."""
    check_preference_rows(rows)
    pairs = [encode_pair(row, tokenizer, objective)
             for row in tqdm(rows, desc="tokenizing pairs", unit="pair", leave=False, disable=not progress)]
    same = [p.where for p in pairs if np.array_equal(p.chosen, p.rejected)]
    if same:
        warnings.warn(f"{len(same)} of {len(pairs)} pairs have identical chosen and rejected responses (first: "
                      f"{same[0]}); they teach nothing and only dilute the batch", stacklevel=2)
    merged = [p.where for p in pairs if p.merged]
    if merged:
        warnings.warn(f"{len(merged)} of {len(pairs)} pairs have a prompt whose tokens are not a prefix of prompt + "
                      f"response's (first: {merged[0]}): the prompt's last token merges with the response's first, "
                      "so the response is scored from one token earlier; start plain-text responses with a space "
                      "or end prompts with one", stacklevel=2)
    return pairs


def fit_pairs(pairs: Sequence[PreferencePair], seq_len: int, *, drop_long_prompts: bool = False,
              share_prompt: bool = True) -> list[PreferencePair]:
    """Pairs cut to fit one row of seq_len: responses keep their start; a pair whose prompt leaves no room for a
    token of each response is an error naming its row, or, with `drop_long_prompts`, dropped with a warning."""
    out, cut, dropped = [], 0, []
    for pair in pairs:
        room = seq_len - pair.prompt_cost(share_prompt)
        if room < 2:
            if not drop_long_prompts:
                holds = "the prompt" if share_prompt else "the prompt twice"
                raise DataError(f"{pair.where}: the prompt ({len(pair.prompt):,} tokens) leaves no room for the "
                                f"responses in seq_len={seq_len:,} (a row holds {holds} and both responses); "
                                "raise seq_len, shorten the prompt, or drop such rows (drop_long_prompts=True, "
                                "--drop-long-prompts)")
            dropped.append(pair.where)
            continue
        if len(pair.chosen) + len(pair.rejected) > room:
            short, long_ = sorted((len(pair.chosen), len(pair.rejected)))
            keep_short = min(short, room // 2)
            keep = (keep_short, room - keep_short)  # (shorter, longer) response lengths
            c_keep, r_keep = keep if len(pair.chosen) <= len(pair.rejected) else keep[::-1]
            pair = PreferencePair(pair.prompt, pair.chosen[:c_keep], pair.rejected[:r_keep], pair.where)
            cut += 1
        out.append(pair)
    if dropped:
        warnings.warn(f"{len(dropped)} of {len(pairs)} pairs were dropped: their prompts leave no room for the "
                      f"responses in seq_len={seq_len:,} (first: {dropped[0]})", stacklevel=2)
    if cut:
        warnings.warn(f"{cut} of {len(pairs)} pairs were longer than seq_len={seq_len:,} (prompt "
                      f"{'' if share_prompt else 'twice '}plus both responses) and their responses were truncated",
                      stacklevel=2)
    if not out:
        raise DataError(f"no preference pair fits seq_len={seq_len:,}; raise seq_len")
    return out


def pack_pairs(pairs: Sequence[PreferencePair], seq_len: int, *, packing: bool = True,
               drop_long_prompts: bool = False, share_prompt: bool = True) -> PackedRows:
    """Rows of seq_len holding whole pairs (first-fit-decreasing; one pair per row without packing).

    Besides the usual arrays, `extra` holds `response` [N, T] (1 where the label is a response token),
    `pair_mask` [N, P] (1 for each of the row's pairs; P = the most pairs any row holds) and, with
    `share_prompt`, `attention_ids` [N, T] (the module docstring's layout). Every next token of a sequence is
    labeled (the objective picks which count); `segment_ids` are 2k+1 for pair k's prompt and chosen response,
    2k+2 for its rejected response.
    """
    pairs = fit_pairs(pairs, seq_len, drop_long_prompts=drop_long_prompts, share_prompt=share_prompt)
    bins: list[list[PreferencePair]] = []
    if packing:
        fit = _FirstFit(seq_len, len(pairs))
        for i in sorted(range(len(pairs)), key=lambda i: (-pairs[i].length(share_prompt), i)):
            b = fit.place(pairs[i].length(share_prompt))
            if b == len(bins):
                bins.append([])
            bins[b].append(pairs[i])
    else:
        bins = [[p] for p in pairs]
    n, most = len(bins), max(len(b) for b in bins)
    ids = np.zeros((n, seq_len), np.int32)
    labels = np.full((n, seq_len), IGNORE, np.int32)
    seg = np.zeros((n, seq_len), np.int32)
    pos = np.zeros((n, seq_len), np.int32)
    response = np.zeros((n, seq_len), np.int32)
    attention = np.zeros((n, seq_len), np.int32)
    pair_mask = np.zeros((n, most), np.int32)

    def place(r: int, at: int, tokens: np.ndarray, next_token: int | None, segment: int, attention_id: int,
              first_position: int, first_response: int) -> int:
        """Writes one run at `at`: its tokens, each labeled with the next (the run's last with `next_token`),
        responses labeled from index `first_response` of the run on. Returns where the run ends."""
        m = len(tokens)
        ids[r, at:at + m], seg[r, at:at + m], attention[r, at:at + m] = tokens, segment, attention_id
        pos[r, at:at + m] = first_position + np.arange(m)
        labels[r, at:at + m - 1] = tokens[1:]
        if next_token is not None and m:
            labels[r, at + m - 1] = next_token
        response[r, at + first_response:at + m - 1] = 1
        return at + m

    for r, row in enumerate(bins):
        at = 0
        for k, pair in enumerate(row):
            pair_mask[r, k] = 1
            p = len(pair.prompt)
            if share_prompt:  # prompt run k+1, then branches -2(k+1) (chosen) and -2(k+1)-1 (rejected)
                shared, last = pair.prompt[:-1], pair.prompt[-1:]
                at = place(r, at, shared, int(last[0]) if p else None, 2 * k + 1, k + 1, 0, len(shared))
                branches = ((2 * k + 1, pair.chosen, -2 * (k + 1)), (2 * k + 2, pair.rejected, -2 * (k + 1) - 1))
                for s, answer, attention_id in branches:
                    at = place(r, at, np.concatenate([last, answer]), None, s, attention_id, max(p - 1, 0), 0)
                continue
            for s, answer in ((2 * k + 1, pair.chosen), (2 * k + 2, pair.rejected)):
                # without a prompt the response's first token has no context to be predicted from
                at = place(r, at, np.concatenate([pair.prompt, answer]), None, s, s, 0, max(p, 1) - 1)
    extra = {"response": response, "pair_mask": pair_mask}
    if share_prompt:
        extra["attention_ids"] = attention
    return PackedRows(ids, labels, seg, pos, 0, extra=extra)
