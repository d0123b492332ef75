"""Data: readers, formats with response-only loss, FFD packing properties, deterministic stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxtune.data import BatchStream, encode_rows, pack_examples, read_rows
from jaxtune.data.formats import Example
from jaxtune.data.packing import IGNORE
from jaxtune.data.sources import DataError, Row


def _examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(1, 1000, n).astype(np.int32), rng.random(n) < 0.7) for n in lengths]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), seq_len=st.integers(8, 64))
def test_packing_invariants(lengths, seq_len):
    examples = _examples(lengths)
    with pytest.warns(UserWarning) if max(lengths) > seq_len else _no_warning():
        packed = pack_examples(examples, seq_len)
    kept = [Example(e.ids[:seq_len], e.target[:seq_len]) for e in examples]
    # every example appears exactly once, contiguous, with positions 0..n-1 and one segment id
    found = []
    for r in range(len(packed)):
        seg, pos, ids, lab = (packed.segment_ids[r], packed.positions[r], packed.input_ids[r], packed.labels[r])
        assert (np.diff((seg > 0).astype(int)) <= 0).all()  # padding only at the end
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all()
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            found.append(ids[where].tolist())
            # label j = next token of the same sample where that token is a target; the boundary is masked
            ex = next(e for e in kept if e.ids.tolist() == ids[where].tolist())
            want = np.where(ex.target[1:], ex.ids[1:], IGNORE)
            np.testing.assert_array_equal(lab[where][:-1], want)
            assert lab[where][-1] == IGNORE
        assert (lab[seg == 0] == IGNORE).all() and (ids[seg == 0] == 0).all()
    assert sorted(found) == sorted(e.ids.tolist() for e in kept)
    # first-fit-decreasing never needs more rows than twice the lower bound
    assert len(packed) <= max(1, 2 * -(-sum(len(e.ids) for e in kept) // seq_len))
    assert packed.truncated == sum(n > seq_len for n in lengths)


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_ffd_packs_tightly_and_no_packing_pads():
    examples = _examples([30, 20, 10, 34, 6, 28, 2])
    packed = pack_examples(examples, 32 * 1 + 32)  # rows of 64
    assert len(packed) == 3 and packed.efficiency == pytest.approx(130 / 192)
    padded = pack_examples(examples, 64, packing=False)
    assert len(padded) == 7 and padded.segment_ids.max() == 1


def test_stream_is_deterministic_and_resumable():
    packed = pack_examples(_examples([5] * 40), 16)
    a = BatchStream(packed, micro_batch=2, accum=2, seed=3)
    seq = [a.next()["input_ids"] for _ in range(7)]
    b = BatchStream(packed, micro_batch=2, accum=2, seed=3)
    for _ in range(3):
        b.next()
    c = BatchStream(packed, micro_batch=2, accum=2, seed=3)
    c.restore(b.state())
    for want in seq[3:]:
        np.testing.assert_array_equal(c.next()["input_ids"], want)
    assert seq[0].shape == (2, 2, 16)


def test_a_dataset_smaller_than_one_step_fills_it_from_the_next_epochs():
    packed = pack_examples(_examples([16] * 3), 16)  # 3 rows; a step takes 2 x 4 = 8
    with pytest.warns(UserWarning, match="packs into 3 rows but one step takes 8"):
        stream = BatchStream(packed, micro_batch=4, accum=2, seed=1)
    first, second = stream.next()["input_ids"].reshape(8, 16), stream.next()["input_ids"].reshape(8, 16)
    order = lambda epoch: np.random.default_rng([1, epoch]).permutation(3)  # noqa: E731
    want = np.concatenate([order(e) for e in range(8)])  # epochs back to back, each in its own order
    np.testing.assert_array_equal(first, packed.input_ids[want[:8]])
    np.testing.assert_array_equal(second, packed.input_ids[want[8:16]])
    resumed = BatchStream(packed, micro_batch=4, accum=2, seed=1)
    resumed.restore(stream.state())
    np.testing.assert_array_equal(resumed.next()["input_ids"].reshape(8, 16), packed.input_ids[want[16:24]])


def test_chat_loss_covers_only_assistant_turns(tiny_tokenizer):
    row = Row({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                            {"role": "assistant", "content": "world"}]}, "x:1")
    (ex,) = encode_rows([row], "chat", tiny_tokenizer)
    target_text = tiny_tokenizer.decode(ex.ids[ex.target])
    assert target_text == "world<|im_end|>\n"
    (all_ex,) = encode_rows([row], "chat", tiny_tokenizer, train_on_all=True)
    assert all_ex.target.all()


def test_completion_alpaca_and_text_formats(tiny_tokenizer):
    (c,) = encode_rows([Row({"prompt": "The quick", "completion": " brown fox"}, "x:1")], "completion", tiny_tokenizer)
    assert tiny_tokenizer.decode(c.ids[c.target]) == " brown fox<|im_end|>"
    (a,) = encode_rows([Row({"instruction": "Say hi", "input": "", "output": "hello"}, "x:1")], "alpaca", tiny_tokenizer)
    assert tiny_tokenizer.decode(a.ids[a.target]) == "hello<|im_end|>\n"
    (t,) = encode_rows([Row({"text": "hello world"}, "x:1")], "text", tiny_tokenizer)
    assert t.target.all()


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv", "parquet"])
def test_readers(tmp_path, ext):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]
    path = tmp_path / f"d.{ext}"
    if ext == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif ext == "json":
        path.write_text(json.dumps(rows))
    elif ext == "csv":
        path.write_text("prompt,completion\n" + "\n".join(f"{r['prompt']},{r['completion']}" for r in rows) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    assert [r.data for r in read_rows(path)] == rows


def test_saved_datasets_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"text": "a b c"}, {"text": "d e"}]).save_to_disk(str(tmp_path / "ds"))
    assert [r.data["text"] for r in read_rows(tmp_path / "ds")] == ["a b c", "d e"]


def test_missing_field_names_file_line_and_field(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(DataError) as e:
        encode_rows(read_rows(path), "completion", tiny_tokenizer)
    assert f"{path}:2" in str(e.value) and "'completion'" in str(e.value) and "\n" not in str(e.value)


def test_empty_dataset_and_unknown_format(tmp_path, tiny_tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        read_rows(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="unknown data format 'sharegpt'; supported: chat, alpaca, completion, text"):
        encode_rows([Row({"text": "x"}, "x:1")], "sharegpt", tiny_tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"broken.jsonl:2: invalid JSON"):
        read_rows(tmp_path / "broken.jsonl")


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_tokenizer_of_another_model_is_refused_before_training(tmp_path, tiny_tokenizer, objective):
    """Ids past the model's embedding table (a tokenizer from another model) fail with the id and the fix, before any
    step, instead of a NaN loss after a few (the lookup reads past the table)."""
    import jaxtune
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, eos_token_id=1)
    model = init_model(cfg, dtype="float32", seed=0)
    jaxtune.get_peft_model(model, r=2)
    rows = [{"text": "The quick brown fox jumps over the lazy dog."}] if objective == "sft" else \
        [{"prompt": "The quick brown fox jumps over the lazy dog."}]
    top = max(tiny_tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"])
    assert top >= 64
    config = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=1, objective=objective,
                                 **({"max_completion_length": 8, "num_generations": 2} if objective == "grpo"
                                    else {"format": "text"}))
    with pytest.raises(DataError, match=r"token id \d+ .* vocabulary has 64 ids: the tokenizer belongs to another model"):
        jaxtune.train(model, tiny_tokenizer, rows, config, out_dir=str(tmp_path / "run"), progress=False,
                      **({"reward_funcs": [lambda prompts, completions, **kw: [0.0] * len(prompts)]}
                         if objective == "grpo" else {}))
    assert not (tmp_path / "run" / "checkpoints").exists()
