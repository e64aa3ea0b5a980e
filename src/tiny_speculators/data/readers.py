"""Read chat records from JSON, JSONL, Parquet, CSV/TSV or a ``datasets`` folder, and normalise them.

The layouts each record may take (``conversations``/``messages``, ``role``/``content`` or
``from``/``value``, tool calls, reasoning) are described in :mod:`tiny_speculators.data.layouts`.
In CSV and TSV files the turns (and ``tools``) are a JSON string in their column.

Each record comes out as a :class:`Record` holding either its normalised messages (and tool
definitions) or the :class:`~tiny_speculators.data.chat.RecordError` that makes it unusable, plus
where it came from (``file:line`` for JSONL and CSV, ``file#record`` for JSON arrays, ``file#row``
for tables). ``start`` passes over the first records cheaply (``prepare`` resuming after a kill).

    from tiny_speculators.data.readers import read_records
    for record in read_records(["chats.jsonl"]):
        print(record.where, record.error or len(record.messages))
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tiny_speculators.data.chat import RecordError
from tiny_speculators.data.layouts import ROLES, TURN_KEYS, normalize_record
from tiny_speculators.errors import UserError

__all__ = ["FORMATS", "ROLES", "Record", "count_records", "normalize_messages", "read_records", "resolve_data"]

FORMATS = ".jsonl, .ndjson, .json, .parquet, .csv, .tsv or a datasets folder"


@dataclass
class Record:
    where: str
    messages: list[dict[str, Any]] | None = None
    error: RecordError | None = None
    tools: list[dict[str, Any]] | None = None
    file: int = 0  # index of the file in the list given to read_records


def normalize_messages(record: Any, field: str | None = None) -> list[dict[str, Any]]:
    """The normalised messages of ``record`` (see :func:`~tiny_speculators.data.layouts.normalize_record`)."""
    return normalize_record(record, field)[0]


def _record(where: str, obj: Any, field: str | None) -> Record:
    try:
        messages, tools = normalize_record(obj, field)
    except RecordError as e:
        return Record(where, error=e)
    return Record(where, messages=messages, tools=tools)


def _is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_jsonl(path: Path, field: str | None, skip: int) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if skip:
                skip -= 1
                continue
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(where, error=RecordError("not UTF-8", f"byte {e.start} of the line is not valid UTF-8"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield Record(where, error=RecordError("invalid JSON", f"{e.msg} at column {e.colno}"))
                continue
            yield _record(where, obj, field)


def _read_json(path: Path, field: str | None, skip: int) -> Iterator[Record]:
    data = path.read_bytes()
    text = data.decode("utf-8", errors="surrogateescape")  # bad bytes are reported per record
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if text.count("\n") > 1 and text.lstrip()[:1] == "{":  # a JSONL file named .json
            yield from _read_jsonl(path, field, skip)
            return
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(obj, dict) and any(k in obj for k in ((field,) if field else TURN_KEYS)):
        obj = [obj]
    if not isinstance(obj, list):
        raise UserError(f"{path} must hold a list of chat records (or one record)")
    for i, item in enumerate(obj[skip:], skip):
        yield _record(f"{path}#{i}", item, field)


def _read_parquet(path: Path, field: str | None, skip: int) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path} is not a readable Parquet file ({e})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        if row + batch.num_rows <= skip:  # whole batch already done: not even converted
            row += batch.num_rows
            continue
        for item in batch.to_pylist():
            if row >= skip:
                yield _record(f"{path}#{row}", item, field)
            row += 1


def _read_csv(path: Path, field: str | None, skip: int) -> Iterator[Record]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long conversations exceed the 128 KiB default
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = _next_row(reader, f"{path} is not a readable CSV file")
        if header is None:
            return
        while True:
            start = reader.line_num + 1
            row = _next_row(reader, f"{path}:{start}: not a readable CSV row")
            if row is None:
                return
            if not any(cell.strip() for cell in row):
                continue
            if skip:
                skip -= 1
                continue
            if len(row) != len(header):
                yield Record(f"{path}:{start}", error=RecordError(
                    "invalid record", f"the row has {len(row)} cells, the header {len(header)}"))
                continue
            yield _record(f"{path}:{start}", dict(zip(header, row, strict=True)), field)


def _next_row(reader: Iterator[list[str]], error: str) -> list[str] | None:
    """The reader's next row, None at the end; a row csv cannot parse is ``error`` (with csv's reason)."""
    try:
        return next(reader)
    except StopIteration:
        return None
    except csv.Error as e:
        raise UserError(f"{error} ({e})") from None


def _read_dataset_dir(path: Path, field: str | None, skip: int) -> Iterator[Record]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a readable `datasets` folder ({e})") from None
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, ds in splits:
        label = f"{path}[{split}]" if split else str(path)
        if skip >= len(ds):
            skip -= len(ds)
            continue
        for row in range(skip, len(ds)):
            yield _record(f"{label}#{row}", ds[row], field)
        skip = 0


def _stage_output(path: Path) -> Path | None:
    """The file a stage's output folder holds its records in (its ``summary.json`` names it: ``regenerate``'s
    ``chats.jsonl``), or None."""
    summary = path / "summary.json"
    if not (path.is_dir() and summary.is_file()):
        return None
    try:
        name = json.loads(summary.read_text(encoding="utf-8")).get("output")
    except (json.JSONDecodeError, AttributeError, OSError):
        return None
    return path / name if isinstance(name, str) and (path / name).is_file() else None


BUILTIN_PREFIX = "builtin:"


def builtin_prompts(name: str) -> Path:
    """The prompt set shipped with the package that ``builtin:NAME`` names (``builtin:train``)."""
    folder = resources.files("tiny_speculators") / "resources" / "prompts"
    resource = folder / f"{name}.jsonl"
    if not resource.is_file():
        known = ", ".join(sorted(BUILTIN_PREFIX + Path(str(f)).stem for f in folder.iterdir()
                                 if str(f).endswith(".jsonl")))
        raise UserError(f"there is no built-in prompt set '{name}' (known: {known})")
    return Path(str(resource))


def resolve_data(paths: Iterable[str | Path]) -> list[Path]:
    """The data paths to read: ``builtin:NAME`` is a prompt set shipped with the package, and a stage's output
    folder (``regenerate --out``) stands for the file it wrote."""
    out = []
    for p in paths:
        if str(p).startswith(BUILTIN_PREFIX):
            out.append(builtin_prompts(str(p)[len(BUILTIN_PREFIX):]))
        else:
            out.append(_stage_output(Path(p)) or Path(p))
    return out


def _reader(path: Path):
    suffix = path.suffix.lower()
    if _is_dataset_dir(path):
        return _read_dataset_dir
    if path.is_dir():
        raise UserError(f"{path} is a folder but neither a `datasets` save_to_disk folder nor a stage's output "
                        "folder (a summary.json naming its output file, as regenerate writes)")
    readers = {".jsonl": _read_jsonl, ".ndjson": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet,
               ".pq": _read_parquet, ".csv": _read_csv, ".tsv": _read_csv}
    if suffix not in readers:
        raise UserError(f"{path}: unknown data format '{suffix}' (use {FORMATS})")
    return readers[suffix]


def read_records(paths: Iterable[str | Path], field: str | None = None,
                 start: tuple[int, int] = (0, 0)) -> Iterator[Record]:
    """Every record of every file, in order. A missing or unreadable file is a ``UserError``.

    ``start = (i, n)`` begins at the ``n``-th record of the ``i``-th file (a resumed ``prepare``);
    each :class:`Record` says which file it came from in ``file``.
    """
    paths = [Path(p) for p in paths]
    for path in paths:
        if not path.exists():
            raise UserError(f"data file {path} does not exist")
    readers = [_reader(path) for path in paths]
    first, skip = start
    for i, (path, reader) in enumerate(zip(paths, readers, strict=True)):
        if i < first:
            continue
        for record in reader(path, field, skip if i == first else 0):
            record.file = i
            yield record


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
