"""The prepare stage: every kind of bad record is reported and counted, good records survive intact,
all input formats agree, max_length, atomic output, one-sentence errors."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tiny_speculators.data.chat import ChatRenderer
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.data.readers import normalize_messages
from tiny_speculators.errors import UserError

GOOD = [
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."}]},
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello there!"}]},
    {"conversations": [{"from": "system", "value": "Short answers."}, {"from": "human", "value": "Sky colour?"},
                       {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Grass?"},
                       {"from": "gpt", "value": "Green."}]},
]


def bad_corpus(path: Path) -> dict[str, int]:
    """Write a JSONL with the three GOOD records among one of each bad kind; return the expected drop counts."""
    lines = [
        json.dumps(GOOD[0]).encode(),                                                     # 1 good
        b'{"conversations": [{"from": "human", "value": "unterminated"',                  # 2 invalid JSON
        b'{"messages": [{"role": "user", "content": "caf\xe9?"}, '                         # 3 latin-1 byte
        b'{"role": "assistant", "content": "ok"}]}',
        json.dumps({"dialog": [{"from": "human", "value": "x"}]}).encode(),               # 4 missing field
        json.dumps({"conversations": [{"from": "human"}, {"from": "gpt", "value": "y"}]}).encode(),  # 5 missing
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"},
                                 {"role": "assistant", "content": "z"}]}).encode(),      # 6 unknown role
        json.dumps({"messages": [{"role": "user", "content": "  \n"},
                                 {"role": "assistant", "content": "z"}]}).encode(),      # 7 empty content
        json.dumps({"messages": [{"role": "user", "content": 42},
                                 {"role": "assistant", "content": "z"}]}).encode(),      # 8 non-string content
        json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}).encode(),     # 9 no assistant turn
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                 {"role": "assistant", "content": "c"}]}).encode(),      # 10 template error
        b"[1, 2, 3]",                                                                     # 11 not an object
        json.dumps(GOOD[1]).encode(),                                                     # 12 good
        b"   ",                                                                           # 13 blank: skipped
        json.dumps(GOOD[2]).encode(),                                                     # 14 good
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {"invalid JSON": 1, "not UTF-8": 1, "missing field": 2, "unknown role": 1, "empty content": 1,
            "non-string content": 1, "no assistant turn": 1, "template error": 1, "invalid record": 1}


@pytest.fixture
def fast_tokenizer(monkeypatch, smollm2_tokenizer):
    """prepare() loads the verifier's tokenizer by name; reuse the session's copy to keep tests fast."""
    import tiny_speculators.verifier.load as load

    monkeypatch.setattr(load, "load_tokenizer", lambda name, trust_remote_code=False: smollm2_tokenizer)
    return smollm2_tokenizer


def expected_rows(tokenizer, records, template=None):
    renderer = ChatRenderer(tokenizer, chat_template=template)
    return [(s.input_ids, s.loss_mask) for r in records for s in renderer.samples(normalize_messages(r))]


def rows(prepared):
    return list(zip(prepared.dataset["input_ids"], prepared.dataset["loss_mask"], strict=True))


def test_bad_input_corpus(tmp_path, fast_tokenizer, smollm2_dir, alternating_template, caplog):
    data = tmp_path / "chats.jsonl"
    expected = bad_corpus(data)
    caplog.set_level(logging.WARNING)
    summary = prepare(str(smollm2_dir), [data], tmp_path / "out", chat_template=alternating_template)
    assert summary["records_read"] == 13
    assert summary["kept"] == 3 and summary["samples"] == 3
    assert summary["dropped"] == expected
    assert summary["records_read"] == summary["kept"] + sum(summary["dropped"].values())
    prepared = load_prepared(tmp_path / "out")
    assert prepared.dataset["source"] == [f"{data}:1", f"{data}:12", f"{data}:14"]
    assert rows(prepared) == expected_rows(fast_tokenizer, GOOD, alternating_template.read_text())
    assert prepared.summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    bad = [json.loads(line) for line in (tmp_path / "out" / "bad_records.jsonl").read_text().splitlines()]
    assert [b["where"] for b in bad] == [f"{data}:{i}" for i in range(2, 12)]
    assert f"{data}:3: not UTF-8" in caplog.text and f"{data}:6: unknown role" in caplog.text
    assert "template error: Conversation roles must alternate" in caplog.text
    # the token counts are exactly the masked tokens of the dataset
    counts = prepared.token_counts()
    assert counts.dtype.is_floating_point is False and counts.shape == (len(fast_tokenizer),)
    assert int(counts.sum()) == summary["masked_tokens"] == sum(sum(m) for _, m in rows(prepared))

    with pytest.raises(UserError, match=rf"{data}:2: invalid JSON.*--strict"):
        prepare(str(smollm2_dir), [data], tmp_path / "strict", chat_template=alternating_template, strict=True)
    assert not (tmp_path / "strict").exists() and not list(tmp_path.glob(".strict*"))  # nothing half-written


def test_all_formats_agree(tmp_path, fast_tokenizer, smollm2_dir):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    # both shapes in one table: the schema must name both columns (inference looks at the first row only)
    schema = pa.schema([
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ])
    pq.write_table(pa.Table.from_pylist(GOOD, schema=schema), tmp_path / "a.parquet")
    features = datasets.Features.from_arrow_schema(schema)
    columns = {name: [r.get(name) for r in GOOD] for name in ("conversations", "messages")}
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp_path / "a_ds"))
    reference = expected_rows(fast_tokenizer, GOOD)
    for name in ("a.jsonl", "a.json", "a.parquet", "a_ds"):
        summary = prepare(str(smollm2_dir), [tmp_path / name], tmp_path / f"out-{name}")
        assert summary["dropped"] == {} and summary["kept"] == 3, name
        assert rows(load_prepared(tmp_path / f"out-{name}")) == reference, name
    # several files at once, in order
    summary = prepare(str(smollm2_dir), [tmp_path / "a.json", tmp_path / "a.parquet"], tmp_path / "two")
    assert summary["kept"] == 6 and rows(load_prepared(tmp_path / "two")) == reference + reference
    import torch

    row = load_prepared(tmp_path / "two").dataset.with_format("torch")[0]
    assert row["input_ids"].dtype == torch.int64 and row["loss_mask"].shape == row["input_ids"].shape


def test_max_length_truncate_and_drop(tmp_path, fast_tokenizer, smollm2_dir):
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    lengths = [len(ids) for ids, _ in expected_rows(fast_tokenizer, GOOD)]
    limit = sorted(lengths)[1]  # one record is longer than this
    longest = lengths.index(max(lengths))
    s = prepare(str(smollm2_dir), [data], tmp_path / "t", max_length=limit)
    assert s["kept"] == 3 and s["truncated"] == 1 and s["dropped"] == {}
    assert max(len(x) for x in load_prepared(tmp_path / "t").dataset["input_ids"]) == limit
    s = prepare(str(smollm2_dir), [data], tmp_path / "d", max_length=limit, overflow="drop")
    assert s["kept"] == 2 and s["dropped"] == {"too long": 1}
    s = prepare(str(smollm2_dir), [data], tmp_path / "d", max_length=limit, overflow="drop", strict=True)
    assert s["dropped"] == {"too long": 1}  # a chosen length policy, not bad input: --strict does not stop
    assert f"{data}:{longest + 1}" not in load_prepared(tmp_path / "d").dataset["source"]
    # so short that the first assistant token is cut off: dropped with its own reason
    s = prepare(str(smollm2_dir), [data], tmp_path / "e", max_length=limit, last_turn_only=True)
    assert s["kept"] + sum(s["dropped"].values()) == 3


def test_one_sentence_errors(tmp_path, fast_tokenizer, smollm2_dir):
    with pytest.raises(UserError, match="does not exist"):
        prepare(str(smollm2_dir), [tmp_path / "nope.jsonl"], tmp_path / "o")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match="holds no records"):
        prepare(str(smollm2_dir), [tmp_path / "empty.jsonl"], tmp_path / "o")
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(UserError, match=r"no usable records.*no assistant turn: 1"):
        prepare(str(smollm2_dir), [tmp_path / "bad.jsonl"], tmp_path / "o")
    assert not list(tmp_path.glob(".o*"))  # no work folder left behind
    (tmp_path / "broken.json").write_text('[{"messages": ')
    with pytest.raises(UserError, match="not valid JSON"):
        prepare(str(smollm2_dir), [tmp_path / "broken.json"], tmp_path / "o")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "precious.txt").write_text("mine")
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    with pytest.raises(UserError, match="not an earlier prepare output"):
        prepare(str(smollm2_dir), [tmp_path / "good.jsonl"], tmp_path / "o")
    assert (tmp_path / "o" / "precious.txt").read_text() == "mine"
    # rerunning into an earlier output replaces it
    prepare(str(smollm2_dir), [tmp_path / "good.jsonl"], tmp_path / "p")
    assert prepare(str(smollm2_dir), [tmp_path / "good.jsonl"], tmp_path / "p")["kept"] == 1


def test_tokenizer_without_chat_template(tmp_path, smollm2_dir, smollm2_tokenizer):
    folder = tmp_path / "no-template"
    folder.mkdir()
    shutil.copy(smollm2_dir / "config.json", folder / "config.json")
    bare = type(smollm2_tokenizer).from_pretrained(smollm2_dir)
    bare.chat_template = None
    bare.save_pretrained(folder)
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    with pytest.raises(UserError, match="has no chat template"):
        prepare(str(folder), [tmp_path / "good.jsonl"], tmp_path / "o")


def test_qwen3_split_counts(tmp_path, qwen3_tokenizer, qwen3_tokenizer_dir, monkeypatch):
    import tiny_speculators.data.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "load_prepare_tokenizer", lambda name, **_: qwen3_tokenizer)
    chat = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
                         {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]}
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps(chat) + "\n" + json.dumps(GOOD[0]) + "\n")
    s = prepare(str(qwen3_tokenizer_dir), [data], tmp_path / "on")
    assert (s["kept"], s["samples"], s["split_records"]) == (2, 3, 1)
    assert s["vocab_size"] == 151669 and s["model_vocab_size"] is None  # a tokenizer-only folder
    s = prepare(str(qwen3_tokenizer_dir), [data], tmp_path / "off", enable_thinking=False)
    assert s["dropped"] == {"template inconsistency": 1} and s["kept"] == 1
    s = prepare(str(qwen3_tokenizer_dir), [data], tmp_path / "drop", rewritten_turns="drop")
    assert s["dropped"] == {"rewritten turns": 1}


def test_json_array_with_bad_bytes_keeps_the_good_records(tmp_path, fast_tokenizer, smollm2_dir):
    good = json.dumps(GOOD[0]).encode()
    bad = b'{"messages": [{"role": "user", "content": "na\xefve"}, {"role": "assistant", "content": "ok"}]}'
    (tmp_path / "a.json").write_bytes(b"[" + good + b", " + bad + b", " + good + b"]")
    s = prepare(str(smollm2_dir), [tmp_path / "a.json"], tmp_path / "o")
    assert (s["records_read"], s["kept"], s["dropped"]) == (3, 2, {"not UTF-8": 1})
    assert load_prepared(tmp_path / "o").dataset["source"] == [f"{tmp_path / 'a.json'}#0", f"{tmp_path / 'a.json'}#2"]
