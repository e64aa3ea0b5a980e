"""Every common chat layout, per record: fixture files for each (including the peers' own layouts)
prepare with every record kept, and the layouts normalise to the same template messages."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tiny_speculators.data.chat import RecordError
from tiny_speculators.data.layouts import normalize_record
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.data.readers import read_records

LAYOUTS = Path(__file__).parent / "fixtures" / "layouts"


@pytest.fixture
def smollm2_prepare(monkeypatch, smollm2_tokenizer):
    import tiny_speculators.data.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "load_prepare_tokenizer", lambda name, **_: smollm2_tokenizer)
    return smollm2_tokenizer


@pytest.fixture
def qwen3_prepare(monkeypatch, qwen3_tokenizer):
    import tiny_speculators.data.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "load_prepare_tokenizer", lambda name, **_: qwen3_tokenizer)
    return qwen3_tokenizer


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["specforge.jsonl", "speculators.jsonl"])
def test_peer_layouts_keep_every_record(tmp_path, smollm2_prepare, smollm2_dir, name):
    """The issue's report: a SpecForge-layout file was rejected whole ('missing field' on every record)."""
    path = LAYOUTS / name
    summary = prepare(str(smollm2_dir), [path], tmp_path / "out")
    n = len(lines(path))
    assert (summary["records_read"], summary["kept"], summary["dropped"]) == (n, n, {})
    assert (tmp_path / "out" / "bad_records.jsonl").read_text() == ""
    # every assistant turn of every record is masked once
    turns = sum(m["role"] == "assistant" for r in read_records([path]) for m in r.messages)
    masked_runs = sum(sum(1 for a, b in zip([0, *m], m, strict=False) if b and not a)
                      for m in load_prepared(tmp_path / "out").dataset["loss_mask"])
    assert masked_runs == turns


def test_peer_layouts_normalise_like_their_converters():
    specforge = lines(LAYOUTS / "specforge.jsonl")
    for record in specforge:
        assert normalize_record(record) == (record["conversations"], None)
    speculators = lines(LAYOUTS / "speculators.jsonl")
    ultrachat = speculators[0]  # speculators' UltraChat normalisation keeps messages and adds conversations
    expected = [{"role": t["role"], "content": t["content"]} for t in ultrachat["messages"]]
    assert normalize_record(ultrachat)[0] == expected
    roles = [[m["role"] for m in normalize_record(r)[0]] for r in speculators[2:]]
    assert roles == [["user", "assistant"], ["system", "user", "assistant"], ["user", "assistant", "user", "assistant"]]


def test_mixed_file_is_read_record_by_record():
    records = list(read_records([LAYOUTS / "mixed.jsonl"]))
    assert [r.error for r in records] == [None] * 6
    assert records[3].messages == [{"role": "user", "content": "Mixed turns?"},
                                   {"role": "assistant", "content": "Handled per turn."}]
    assert records[4].messages[0] == {"role": "system", "content": "You are kind."}
    assert records[5].messages[0] == {"role": "user", "content": "Content parts?"}
    assert [r.where for r in records] == [f"{LAYOUTS / 'mixed.jsonl'}:{i}" for i in range(1, 7)]


def test_tool_layouts_normalise_to_template_tool_calls():
    [sharegpt, _] = list(read_records([LAYOUTS / "sharegpt_tools.json"]))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert sharegpt.messages[1:3] == [{"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "content": '{"temp_c": 21}'}]
    raw_tools = json.loads((LAYOUTS / "sharegpt_tools.json").read_text())[0]["tools"]  # a JSON string
    assert isinstance(raw_tools, str) and sharegpt.tools == json.loads(raw_tools)
    openai, legacy = list(read_records([LAYOUTS / "openai_tools.jsonl"]))
    assert openai.messages[2]["tool_calls"] == [{"type": "function", "id": "call_0001",
                                                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    assert openai.messages[3] == {"role": "tool", "content": '{"temp_c": 25}', "tool_call_id": "call_0001"}
    assert legacy.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert legacy.messages[2] == {"role": "tool", "content": '{"temp_c": -3}', "name": "get_weather"}


@pytest.mark.parametrize("name", ["mixed.jsonl", "sharegpt_tools.json", "openai_tools.jsonl", "chats.csv",
                                  "specforge.jsonl", "speculators.jsonl", "service_logs.jsonl"])
def test_every_layout_file_prepares_fully_with_qwen3(tmp_path, qwen3_prepare, qwen3_tokenizer_dir, name):
    summary = prepare(str(qwen3_tokenizer_dir), [LAYOUTS / name], tmp_path / "out")
    assert summary["dropped"] == {} and summary["kept"] == summary["records_read"] > 0


def test_field_option(tmp_path, smollm2_prepare, smollm2_dir):
    path = LAYOUTS / "custom_field.jsonl"
    with pytest.raises(Exception, match=r"no usable records.*missing field: 2"):
        prepare(str(smollm2_dir), [path], tmp_path / "no")
    summary = prepare(str(smollm2_dir), [path], tmp_path / "yes", field="dialog")
    assert summary["kept"] == 2 and summary["options"]["field"] == "dialog"
    with pytest.raises(RecordError, match=r"no 'dialog' \(--field\)"):
        normalize_record({"messages": [{"role": "user", "content": "x"}]}, field="dialog")


def test_csv_rows_keep_their_line_numbers(tmp_path, smollm2_prepare, smollm2_dir):
    records = list(read_records([LAYOUTS / "chats.csv"]))
    assert [r.where.rsplit(":", 1)[1] for r in records] == ["2", "12", "13"]  # row a spans lines 2-11
    assert records[0].messages[1]["content"] == "Yes,\nwith a newline inside the cell."
    assert records[2].tools and records[2].messages[2]["tool_calls"][0]["id"] == "call_0001"
    bad = tmp_path / "bad.csv"
    with open(bad, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerow([json.dumps([{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "ok"}])])
        w.writerow(['[{"role": "user", "content": "cut'])
        w.writerow(["not json at all"])
    summary = prepare(str(smollm2_dir), [bad], tmp_path / "out")
    assert (summary["kept"], summary["dropped"]) == (1, {"invalid JSON": 2})
    reported = [json.loads(x) for x in (tmp_path / "out" / "bad_records.jsonl").read_text().splitlines()]
    assert [r["where"] for r in reported] == [f"{bad}:3", f"{bad}:4"]
    assert "'messages' is a string but not JSON" in reported[0]["detail"]


def test_table_formats_agree_with_jsonl(tmp_path, smollm2_prepare, smollm2_dir):
    """Parquet with nested turns, Parquet/datasets with a JSON string column, CSV and JSON give the same rows."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = LAYOUTS / "specforge.jsonl"
    records = lines(source)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "nested.parquet")
    as_strings = [{"id": r["id"], "conversations": json.dumps(r["conversations"])} for r in records]
    pq.write_table(pa.Table.from_pylist(as_strings), tmp_path / "strings.parquet")
    datasets.Dataset.from_list(as_strings).save_to_disk(str(tmp_path / "strings_ds"))
    with open(tmp_path / "a.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["id", "conversations"])
        w.writeheader()
        w.writerows(as_strings)
    (tmp_path / "a.json").write_text(json.dumps(records))
    reference = None
    for name in (source, "nested.parquet", "strings.parquet", "strings_ds", "a.csv", "a.json"):
        path = name if isinstance(name, Path) else tmp_path / name
        summary = prepare(str(smollm2_dir), [path], tmp_path / f"out-{path.name}")
        assert summary["kept"] == len(records) and summary["dropped"] == {}, path.name
        rows = load_prepared(tmp_path / f"out-{path.name}").dataset
        got = list(zip(rows["input_ids"], rows["loss_mask"], strict=True))
        reference = reference or got
        assert got == reference, path.name


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "invalid tool call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "invalid tool call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}]}, "invalid tool call"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get it"}]},
     "invalid JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": {"a": 1}},
     "invalid tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "missing field"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool"}]}, "missing field"),
    ({"messages": [{"content": "x"}]}, "missing field"),
    ({"messages": "[{\"role\": "}, "invalid JSON"),
    ({"messages": {"role": "user"}}, "invalid record"),
])
def test_bad_layouts_name_their_reason(record, reason):
    with pytest.raises(RecordError) as e:
        normalize_record(record)
    assert e.value.reason == reason


def test_tool_chats_survive_parquet_struct_columns(tmp_path, qwen3_prepare, qwen3_tokenizer_dir):
    """Arrow unifies the turns of all rows into one struct type and fills absent fields with None
    (tool_calls: None on user turns, function_call: None, name: None ...): the same samples must come out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = LAYOUTS / "openai_tools.jsonl"
    table = pa.Table.from_pylist(lines(source))
    assert "function_call" in str(table.schema) and "tool_call_id" in str(table.schema)
    pq.write_table(table, tmp_path / "tools.parquet")
    a = prepare(str(qwen3_tokenizer_dir), [source], tmp_path / "a")
    b = prepare(str(qwen3_tokenizer_dir), [tmp_path / "tools.parquet"], tmp_path / "b")
    assert a["kept"] == b["kept"] == 2 and b["dropped"] == {}
    rows_a, rows_b = load_prepared(tmp_path / "a").dataset, load_prepared(tmp_path / "b").dataset
    assert rows_a["input_ids"] == rows_b["input_ids"] and rows_a["loss_mask"] == rows_b["loss_mask"]


def test_service_logs_read_as_request_then_response():
    """A served request with its response (a chat completion, a bare message, or the text) is one record: the
    request's messages, then the answer; the request's tools go to the template."""
    completion, tool_call, text, plain = list(read_records([LAYOUTS / "service_logs.jsonl"]))
    assert completion.messages[-1] == {"role": "assistant", "content": "Oslo."}
    assert [m["role"] for m in completion.messages] == ["system", "user", "assistant"]
    assert tool_call.tools[0]["function"]["name"] == "get_weather"
    assert tool_call.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert text.messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    assert plain.messages[-1]["content"].startswith("4.")
    with pytest.raises(RecordError, match="'response' must be a chat completion"):
        normalize_record({"request": {"messages": []}, "response": 3})
    with pytest.raises(RecordError, match="'request' must be an OpenAI chat request"):
        normalize_record({"request": {"prompt": "x"}, "response": "y"})


def test_redact_replaces_what_must_not_be_trained_on(tmp_path, qwen3_prepare, qwen3_tokenizer_dir):
    from tiny_speculators.errors import UserError

    path = LAYOUTS / "service_logs.jsonl"
    patterns = [r"[\w.+-]+@[\w-]+\.\w+", r"sk-[A-Za-z0-9]{20,}", r"Oslo"]
    summary = prepare(str(qwen3_tokenizer_dir), [path], tmp_path / "out", redact=patterns)
    assert summary["redacted"] == 1 + 1 + 3  # the mail, the key, Oslo in the answer, the tool call and its question
    assert summary["options"]["redact"] == patterns and summary["kept"] == 4
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).decode(
        [int(t) for row in load_prepared(tmp_path / "out").dataset["input_ids"] for t in row])
    assert "ola@example.com" not in text and "sk-abc" not in text and "Oslo" not in text
    assert text.count("[REDACTED]") == 5
    plain = prepare(str(qwen3_tokenizer_dir), [path], tmp_path / "plain")
    assert plain["redacted"] == 0
    with pytest.raises(UserError, match=r"--redact '\(' is not a regular expression"):
        prepare(str(qwen3_tokenizer_dir), [path], tmp_path / "bad", redact=["("])
