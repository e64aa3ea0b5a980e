"""Read chat records from JSON, JSONL, Parquet or a ``datasets`` folder, and normalise them.

Two record shapes are understood:

* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}``.
  Roles ``system``, ``human``/``user``, ``gpt``/``assistant``; raw ShareGPT dumps
  (ShareGPT_Vicuna_unfiltered) also label model turns ``chatgpt``, ``bing`` or ``bard``.
* OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` with roles ``system``,
  ``user``, ``assistant``; ``content`` may also be a list of ``{"type": "text", "text": ...}`` parts.
  An assistant ``reasoning_content`` string is passed to the template (Qwen3 renders it as ``<think>``).

Each record comes out as a :class:`Record` holding either its normalised messages or the
:class:`~tiny_speculators.data.chat.RecordError` that makes it unusable, plus where it came from
(``file:line`` for JSONL, ``file#record`` for JSON arrays, ``file#row`` for tables).

    from tiny_speculators.data.readers import read_records
    for record in read_records(["chats.jsonl"]):
        print(record.where, record.error or len(record.messages))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_speculators.data.chat import RecordError
from tiny_speculators.errors import UserError

__all__ = ["ROLES", "Record", "count_records", "normalize_messages", "read_records"]

# ShareGPT "from" / OpenAI "role" -> template role
ROLES: dict[str, str] = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
}


_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Record:
    where: str
    messages: list[dict[str, Any]] | None = None
    error: RecordError | None = None


def _has_surrogates(value: Any) -> bool:
    """True if a decoded string holds bytes that were not UTF-8 (kept as lone surrogates)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _content(value: Any, where: str) -> str:
    if isinstance(value, list):  # OpenAI content parts: text only
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RecordError("non-string content", f"{where} has a content part that is not text")
            texts.append(part["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise RecordError("non-string content", f"{where} content is {type(value).__name__}, not a string")
    if not value.strip():
        raise RecordError("empty content", f"{where} content is empty")
    return value


def normalize_messages(record: Any) -> list[dict[str, Any]]:
    """``[{"role", "content"[, "reasoning_content"]}, ...]`` from a ShareGPT or OpenAI record, or ``RecordError``."""
    if not isinstance(record, dict):
        raise RecordError("invalid record", f"a record must be a JSON object, not {type(record).__name__}")
    if _has_surrogates(record):
        raise RecordError("not UTF-8", "the record contains bytes that are not valid UTF-8")
    if record.get("conversations") is not None or ("conversations" in record and "messages" not in record):
        turns, role_key, content_key, field_name = record["conversations"], "from", "value", "conversations"
    elif "messages" in record:
        turns, role_key, content_key, field_name = record["messages"], "role", "content", "messages"
    else:
        raise RecordError("missing field", "the record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list):
        raise RecordError("invalid record", f"'{field_name}' must be a list, not {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{field_name}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError("invalid record", f"{where} must be an object, not {type(turn).__name__}")
        if role_key not in turn:
            raise RecordError("missing field", f"{where} has no '{role_key}'")
        if content_key not in turn:
            raise RecordError("missing field", f"{where} has no '{content_key}'")
        role = turn[role_key]
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RecordError("unknown role", f"{where} has role {role!r}")
        message: dict[str, Any] = {"role": ROLES[role.lower()], "content": _content(turn[content_key], where)}
        reasoning = turn.get("reasoning_content")
        if message["role"] == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _record(where: str, obj: Any) -> Record:
    try:
        return Record(where, messages=normalize_messages(obj))
    except RecordError as e:
        return Record(where, error=e)


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise UserError(f"data file {path} does not exist")


def _is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_jsonl(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(where, error=RecordError("not UTF-8", f"byte {e.start} of the line is not valid UTF-8"))
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except json.JSONDecodeError as e:
                yield Record(where, error=RecordError("invalid JSON", f"{e.msg} at column {e.colno}"))
                continue
            yield _record(where, obj)


def _read_json(path: Path) -> Iterator[Record]:
    data = path.read_bytes()
    text = data.decode("utf-8", errors="surrogateescape")  # bad bytes are reported per record
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if text.count("\n") > 1 and text.lstrip()[:1] == "{":  # a JSONL file named .json
            yield from _read_jsonl(path)
            return
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(obj, dict) and ("conversations" in obj or "messages" in obj):
        obj = [obj]
    if not isinstance(obj, list):
        raise UserError(f"{path} must hold a list of chat records (or one record)")
    for i, item in enumerate(obj):
        yield _record(f"{path}#{i}", item)


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path} is not a readable Parquet file ({e})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for item in batch.to_pylist():
            yield _record(f"{path}#{row}", item)
            row += 1


def _read_dataset_dir(path: Path) -> Iterator[Record]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a readable `datasets` folder ({e})") from None
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, ds in splits:
        label = f"{path}[{split}]" if split else str(path)
        for row, item in enumerate(ds):
            yield _record(f"{label}#{row}", item)


def read_records(paths: Iterable[str | Path]) -> Iterator[Record]:
    """Every record of every file, in order. A missing or unreadable file is a ``UserError``."""
    paths = [Path(p) for p in paths]
    for path in paths:
        _check_exists(path)
    for path in paths:
        suffix = path.suffix.lower()
        if _is_dataset_dir(path):
            yield from _read_dataset_dir(path)
        elif path.is_dir():
            raise UserError(f"{path} is a folder but not a `datasets` save_to_disk folder")
        elif suffix in (".jsonl", ".ndjson"):
            yield from _read_jsonl(path)
        elif suffix == ".json":
            yield from _read_json(path)
        elif suffix in (".parquet", ".pq"):
            yield from _read_parquet(path)
        else:
            raise UserError(f"{path}: unknown data format '{suffix}' "
                            "(use .jsonl, .json, .parquet or a datasets folder)")


def count_records(paths: Iterable[str | Path]) -> int | None:
    """A cheap record count for progress bars (JSONL lines, Parquet rows), or None when unknown."""
    total = 0
    for path in map(Path, paths):
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson") and path.is_file():
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
        elif suffix in (".parquet", ".pq") and path.is_file():
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except Exception:
                return None
        else:
            return None
    return total
