"""Readers: every format yields the same records in the same order, and starting at (file, record)
yields exactly the tail of a full read (what a resumed prepare relies on)."""

from __future__ import annotations

import csv
import json

import pytest

from tiny_speculators.data.readers import count_records, read_records
from tiny_speculators.errors import UserError


def chat(i: int) -> dict:
    return {"id": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


@pytest.fixture
def files(tmp_path):
    """The same 2100 records (more than one Parquet batch) in every format, plus a small second file."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [chat(i) for i in range(2100)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 7 == 0 else "")
                                              for i, r in enumerate(records)))  # blank lines are not records
    (tmp_path / "a.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    as_strings = [{"id": r["id"], "messages": json.dumps(r["messages"])} for r in records]
    with open(tmp_path / "a.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["id", "messages"])
        w.writeheader()
        w.writerows(as_strings)
    split = {"train": datasets.Dataset.from_list(as_strings[:1500]),
             "test": datasets.Dataset.from_list(as_strings[1500:])}
    datasets.DatasetDict(split).save_to_disk(str(tmp_path / "a_ds"))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(chat(10_000 + i)) + "\n" for i in range(3)))
    return tmp_path


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.parquet", "a.csv", "a_ds"])
def test_formats_and_start_positions(files, name):
    paths = [files / name, files / "b.jsonl"]
    full = list(read_records(paths))
    assert len(full) == 2103 and all(r.error is None for r in full)
    assert [r.messages[0]["content"] for r in full] == [f"q{i}" for i in range(2100)] + ["q10000", "q10001", "q10002"]
    assert [r.file for r in full] == [0] * 2100 + [1] * 3
    for start, offset in [((0, 0), 0), ((0, 1), 1), ((0, 1024), 1024), ((0, 1500), 1500), ((0, 2099), 2099),
                          ((0, 2100), 2100), ((1, 0), 2100), ((1, 2), 2102), ((1, 3), 2103)]:
        tail = list(read_records(paths, start=start))
        assert [r.where for r in tail] == [r.where for r in full[offset:]], start


def test_where_and_counts(files):
    jsonl = list(read_records([files / "a.jsonl"]))
    assert jsonl[1].where == f"{files / 'a.jsonl'}:3"  # line 2 is blank
    assert list(read_records([files / "a_ds"]))[1500].where == f"{files / 'a_ds'}[test]#0"
    assert count_records([files / "a.jsonl", files / "a.parquet"]) == 4200
    assert count_records([files / "a.csv"]) is None


def test_unknown_and_missing_files(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(UserError, match="unknown data format '.txt'"):
        list(read_records([tmp_path / "x.txt"]))
    with pytest.raises(UserError, match="does not exist"):
        list(read_records([tmp_path / "nope.jsonl"]))
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserError, match="neither a `datasets` save_to_disk folder nor a stage's output folder"):
        list(read_records([tmp_path / "folder"]))


def test_builtin_prompt_sets_resolve_and_an_unknown_one_is_named():
    from tiny_speculators.data.readers import resolve_data

    (path,) = resolve_data(["builtin:train"])
    assert path.name == "train.jsonl" and path.is_file()
    with pytest.raises(UserError, match=r"there is no built-in prompt set 'nope' \(known: builtin:train\)"):
        resolve_data(["builtin:nope"])
