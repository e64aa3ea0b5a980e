"""The ``prepare`` stage: chat data -> token ids + assistant loss mask, with the verifier's own template.

Reads chats in any common layout (ShareGPT ``from``/``value``, OpenAI/SpecForge/speculators
``role``/``content``, under ``conversations``/``messages``, decided per record; tool calls, tool
results and ``tools`` definitions; reasoning) from JSON, JSONL, Parquet, CSV/TSV or ``datasets``
folders (see :mod:`tiny_speculators.data.layouts`), renders each with the verifier tokenizer's chat
template and writes, into ``--out``:

* ``dataset/``: a ``datasets`` folder with ``input_ids``, ``loss_mask`` (1 on what the assistant
  writes: its text, its tool calls and its end-of-turn token) and ``source`` (file and line/record);
* ``token_counts.safetensors``: ``counts`` (int64, ``[len(tokenizer)]``), how often each token is
  a loss-masked target (the input of the ``vocab`` stage);
* ``summary.json``: records read / kept / dropped by reason, tokens, masked tokens, options;
* ``bad_records.jsonl``: one line per unusable record (where, reason, detail).

Bad records are reported (``file:line: reason``) and skipped; ``--strict`` makes the first one an
error. Only the tokenizer is loaded, never the weights (a tokenizer-only folder is enough). The
output folder appears atomically; work is committed every ``--chunk-records`` records, so a killed
run, started again with the same command, resumes after the last committed chunk and writes the
same bytes as an uninterrupted run (:mod:`tiny_speculators.data.resume`).

    tiny-speculators prepare --verifier smollm2-135m --data examples/chats.jsonl --out runs/prepared
    tiny-speculators prepare --verifier Qwen/Qwen3-8B --data chats.parquet --out runs/q3 --no-enable-thinking
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from tiny_speculators.data import tokenizer as tok
from tiny_speculators.data.chat import ChatRenderer, RecordError
from tiny_speculators.data.layouts import image_refs
from tiny_speculators.data.readers import count_records, read_records, resolve_data
from tiny_speculators.data.redact import Redactor
from tiny_speculators.data.resume import ChunkStore, input_fingerprint
from tiny_speculators.errors import UserError
from tiny_speculators.tables import print_summary_table
from tiny_speculators.verifier.load import verifier_id
from tiny_speculators.verifier.vision import IMAGE_DIR, ImageError, Vision, open_image, store_reference

log = logging.getLogger(__name__)

__all__ = ["prepare"]

_MAX_WARNINGS = 50  # individual bad-record warnings; the rest go to bad_records.jsonl and the summary


def _claim_output(out: Path) -> None:
    """Check that ``out`` may be (re)written."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "summary.json").is_file())):
        raise UserError(f"output {out} exists and is not an earlier prepare output; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)


def _publish(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def prepare(
    verifier: str,
    data: list[Path],
    out: Path,
    field: str | None = None,
    max_length: int | None = None,
    overflow: Literal["truncate", "drop"] = "truncate",
    last_turn_only: bool = False,
    enable_thinking: bool | None = None,
    rewritten_turns: Literal["split", "drop"] = "split",
    chat_template: Path | None = None,
    strict: bool = False,
    chunk_records: int = 1000,
    trust_remote_code: bool = False,
    redact: list[str] | None = None,
) -> dict[str, Any]:
    """Tokenize chats with the verifier's chat template and mask the assistant tokens.

    Args:
        verifier: HF id, local folder (a tokenizer-only folder is enough), or an embedded name (smollm2-135m);
            only its tokenizer is loaded.
        data: chat files: .jsonl, .json, .parquet, .csv/.tsv (turns as a JSON column), or `datasets` folders;
            turns under conversations/messages/conversation, as role/content or from/value, per record.
        out: output folder (dataset/, token_counts.safetensors, summary.json, bad_records.jsonl).
        field: the key that holds the turns, for data that uses another name than conversations/messages.
        max_length: longest sequence in tokens; longer ones are truncated or dropped (see overflow).
        overflow: what to do with sequences longer than max_length: truncate them or drop them.
        last_turn_only: mask only the final assistant turn of each conversation.
        enable_thinking: passed to the chat template (Qwen3: thinking on/off); unset leaves the template default.
        rewritten_turns: templates that re-render earlier assistant turns (Qwen3 drops old ``<think>`` blocks):
            split such turns into their own samples, or drop the record.
        chat_template: a .jinja file used instead of the tokenizer's own chat template.
        strict: fail on the first bad record instead of skipping it.
        chunk_records: records per committed chunk; a killed run resumes after the last committed chunk.
        trust_remote_code: allow the tokenizer's custom code from the hub.
        redact: regular expressions whose matches in any message text (and tool call arguments) are replaced by
            [REDACTED] before rendering; the count goes into summary.json.
    """
    started = time.perf_counter()
    data = resolve_data(data)  # regenerate's output folder stands for its chats.jsonl
    template_text = _check_arguments(data, max_length, chunk_records, field, chat_template)
    redactor = Redactor(redact)

    tokenizer = tok.load_prepare_tokenizer(verifier, trust_remote_code=trust_remote_code)
    vision = None if tok.tokenizer_only_folder(verifier) else Vision.load(verifier, trust_remote_code)
    if vision is not None and template_text is None:  # a vision model's own template lives in its processor
        template_text = getattr(vision.processor, "chat_template", None)
    renderer = ChatRenderer(tokenizer, enable_thinking=enable_thinking, chat_template=template_text,
                            last_turn_only=last_turn_only, rewritten_turns=rewritten_turns)
    vocab_size = len(tokenizer)
    model_vocab = tok.model_vocab_size(verifier, trust_remote_code)
    if model_vocab is None:
        log.warning("no model config for %s: `vocab` will size t2d to the tokenizer's %d ids; if the model's "
                    "embedding has more rows, pass --target-vocab-size to vocab", verifier, vocab_size)
    out = Path(out)
    _claim_output(out)
    options = {"field": field, "max_length": max_length, "overflow": overflow, "last_turn_only": last_turn_only,
               "enable_thinking": enable_thinking, "rewritten_turns": rewritten_turns,
               "chat_template": str(chat_template) if chat_template else None, "redact": list(redact or [])}
    template_sha = hashlib.sha256(renderer.chat_template.encode()).hexdigest()
    store = ChunkStore(out.parent / f".{out.name}.partial", {
        "inputs": input_fingerprint(data), "options": options, "strict": strict, "chunk_records": chunk_records,
        "chat_template_sha256": template_sha, "tokenizer_sha256": _tokenizer_fingerprint(tokenizer),
    })
    loop_started = time.perf_counter()
    try:
        resumed = _run(renderer, data, store, vocab_size, field, max_length, overflow, strict, chunk_records,
                       redactor, vision)
    except UserError:
        store.remove()  # bad input (--strict) or options: nothing worth resuming
        raise
    loop_seconds = time.perf_counter() - loop_started
    tmp, totals = _assemble_into_tmp(store, data, out, vocab_size, vision is not None)
    summary = {
        "verifier": str(verifier),
        "verifier_id": verifier_id(verifier),
        "vocab_size": vocab_size,
        "model_vocab_size": model_vocab,
        **totals,
        "data": [str(p) for p in data],
        "options": options,
        "chat_template_sha256": template_sha,
        "resumed_records": resumed,
        "seconds": round(time.perf_counter() - started, 3),
        "records_per_second": round((totals["records_read"] - resumed) / loop_seconds, 1) if loop_seconds > 0
        else None,
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _publish(tmp, out)
    store.remove()
    _print_summary(summary, out)
    return summary


def _check_arguments(data: list[Path], max_length: int | None, chunk_records: int, field: str | None,
                     chat_template: Path | None) -> str | None:
    """One-line errors for unusable options; the text of ``chat_template`` (None without one)."""
    if not data:
        raise UserError("prepare needs at least one --data file")
    for path in data:
        if not path.exists():
            raise UserError(f"data file {path} does not exist")
    if max_length is not None and max_length < 2:
        raise UserError(f"max_length must be at least 2, not {max_length}")
    if chunk_records < 1:
        raise UserError(f"chunk_records must be at least 1, not {chunk_records}")
    if field is not None and not field.strip():
        raise UserError("--field must name a key, not an empty string")
    if chat_template is None:
        return None
    if not Path(chat_template).is_file():
        raise UserError(f"chat template file {chat_template} does not exist")
    return Path(chat_template).read_text(encoding="utf-8")


def _assemble_into_tmp(store: ChunkStore, data: list[Path], out: Path, vocab_size: int,
                       images: bool) -> tuple[Path, dict[str, Any]]:
    """The committed chunks assembled into a fresh temporary folder next to ``out`` (removed on errors; the
    chunks too when the input holds nothing usable): the folder and its totals."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        return tmp, _assemble(store, data, tmp, vocab_size, images)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, UserError):  # no records, none usable: nothing worth resuming
            store.remove()
        raise


@functools.cache
def _features(images: bool) -> Any:
    """The prepared columns; a vision verifier's data adds each sample's image references and grids."""
    import datasets

    columns = {
        "input_ids": datasets.List(datasets.Value("int64")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "source": datasets.Value("string"),
    }
    if images:
        columns["images"] = datasets.List(datasets.Value("string"))
        columns["image_grid_thw"] = datasets.List(datasets.List(datasets.Value("int64")))
    return datasets.Features(columns)


class _Chunk:
    """Rows and counters of the records read since the last commit."""

    def __init__(self, images: bool) -> None:
        self.rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "source": []}
        if images:
            self.rows |= {"images": [], "image_grid_thw": []}
        self.bad: list[dict[str, str]] = []
        self.dropped: Counter[str] = Counter()
        self.samples_dropped: Counter[str] = Counter()
        self.n = {"records_read": 0, "kept": 0, "samples": 0, "tokens": 0, "masked_tokens": 0, "truncated": 0,
                  "split_records": 0, "boundary_tokens": 0, "redacted": 0, "images": 0}

    def stats(self, end: list[int]) -> dict[str, Any]:
        return {**self.n, "dropped": dict(self.dropped), "samples_dropped": dict(self.samples_dropped),
                "bad": self.bad, "end": end}


def _run(renderer: ChatRenderer, data: list[Path], store: ChunkStore, vocab_size: int, field: str | None,
         max_length: int | None, overflow: str, strict: bool, chunk_records: int, redactor: Redactor,
         vision: Vision | None) -> int:
    """Render every record not yet committed; returns how many records earlier runs had committed."""
    index, start = store.open()
    images = _Images(vision, data, store.folder / IMAGE_DIR)
    resumed = sum(stats["records_read"] for _, stats in store.chunks())
    warned = sum(len(stats["bad"]) for _, stats in store.chunks())
    position = list(start)
    chunk = _Chunk(vision is not None)
    total = count_records(data)
    progress = tqdm(read_records(data, field=field, start=start), total=total, initial=resumed, unit="rec",
                    desc="prepare", disable=None, mininterval=1.0)

    def bad(where: str, error: RecordError, policy: bool = False) -> None:
        nonlocal warned
        if strict and not policy:  # drops chosen by max_length/overflow are not bad input
            raise UserError(f"{where}: {error} (--strict stops at the first bad record)")
        chunk.dropped[error.reason] += 1
        chunk.bad.append({"where": where, "reason": error.reason, "detail": error.detail})
        if warned < _MAX_WARNINGS:
            log.warning("%s: %s", where, error)
        elif warned == _MAX_WARNINGS:
            log.warning("more bad records: see bad_records.jsonl in the output folder")
        warned += 1

    for record in progress:
        if record.file != position[0]:
            position = [record.file, 0]
        position[1] += 1
        chunk.n["records_read"] += 1
        if redactor and record.messages is not None:
            record.messages, replaced = redactor.apply(record.messages)
            chunk.n["redacted"] += replaced
        _render(renderer, record, chunk, bad, vocab_size, max_length, overflow, images)
        if chunk.n["records_read"] == chunk_records:
            store.commit(index, chunk.rows, _features(vision is not None), chunk.stats(position))
            index, chunk = index + 1, _Chunk(vision is not None)
    progress.close()
    if chunk.n["records_read"]:
        store.commit(index, chunk.rows, _features(vision is not None), chunk.stats(position))
    return resumed


class _Images:
    """The images of a record for the verifier's processor: their stored references (a relative path resolved
    against its data file's folder; an inline image written once into ``folder``) and the decoded images."""

    def __init__(self, vision: Vision | None, data: list[Path], folder: Path):
        self.vision, self.data, self.folder = vision, data, folder

    def of(self, record: Any) -> tuple[list[str], list[Any]]:
        refs = image_refs(record.messages)
        if not refs:
            return [], []
        if self.vision is None:
            raise RecordError("images for a text-only verifier",
                              f"{len(refs)} image(s), but the verifier has no image processor")
        base = self.data[record.file] if self.data[record.file].is_dir() else self.data[record.file].parent
        try:
            stored = [store_reference(ref, base, self.folder) for ref in refs]
            return stored, [open_image(ref, self.folder.parent) for ref in stored]
        except ImageError as e:
            raise RecordError("bad image", str(e)) from None

    def expand(self, sample: Any, pictures: list[Any]) -> tuple[list[int], list[int], list[list[int]]]:
        """The sample's ids and mask with its images' tokens expanded as the processor does, and their grids."""
        if self.vision is None or not pictures:
            return sample.input_ids, sample.loss_mask, []
        n = sample.input_ids.count(self.vision.image_token_id)
        try:
            return self.vision.expand(sample.text, sample.input_ids, sample.loss_mask, pictures[:n])
        except ImageError as e:
            raise RecordError("bad image", str(e)) from None

    def cut(self, ids: list[int], max_length: int) -> int:
        """Where to truncate ``ids`` to at most ``max_length`` tokens without cutting through an image."""
        cut = max_length
        if self.vision is not None:
            image = self.vision.image_token_id
            while 0 < cut < len(ids) and ids[cut] == image and ids[cut - 1] == image:
                cut -= 1
        return cut

    def count(self, ids: list[int]) -> int:
        """How many (whole) images ``ids`` hold: runs of the image token."""
        if self.vision is None:
            return 0
        image = self.vision.image_token_id
        return sum(1 for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] != image))


def _render(renderer: ChatRenderer, record: Any, chunk: _Chunk, bad: Any, vocab_size: int,
            max_length: int | None, overflow: str, images: _Images) -> None:
    """Add the samples of one record to ``chunk`` (or report it as bad)."""
    if record.error is not None:
        bad(record.where, record.error)
        return
    try:
        refs, pictures = images.of(record)
        produced = [(sample, *images.expand(sample, pictures))
                    for sample in renderer.samples(record.messages, tools=record.tools)]
    except RecordError as e:
        bad(record.where, e)
        return
    usable, local_drops = [], Counter()
    truncated = 0
    for sample, ids, mask, grids in produced:
        if max_length is not None and len(ids) > max_length:
            if overflow == "drop":
                local_drops["too long"] += 1
                continue
            cut = images.cut(ids, max_length)
            ids, mask = ids[:cut], mask[:cut]
            if not any(mask):
                local_drops["no assistant tokens within max_length"] += 1
                continue
            truncated += 1
        n_images = images.count(ids)
        usable.append((ids, mask, sample.boundary_tokens, refs[:n_images], grids[:n_images]))
    if not usable:
        reason = next(iter(local_drops))
        bad(record.where, RecordError(reason, f"longer than max_length={max_length} tokens"), policy=True)
        return
    chunk.samples_dropped.update(local_drops)
    chunk.n["kept"] += 1
    chunk.n["truncated"] += truncated
    chunk.n["split_records"] += len(usable) > 1
    for ids, mask, n_boundary, sample_refs, sample_grids in usable:
        top = max(ids) if ids else 0
        if top >= vocab_size:
            raise UserError(f"{record.where}: token id {top} is outside the tokenizer's {vocab_size} tokens")
        chunk.rows["input_ids"].append(ids)
        chunk.rows["loss_mask"].append(mask)
        chunk.rows["source"].append(record.where)
        if "images" in chunk.rows:
            chunk.rows["images"].append(sample_refs)
            chunk.rows["image_grid_thw"].append(sample_grids)
        chunk.n["samples"] += 1
        chunk.n["tokens"] += len(ids)
        chunk.n["masked_tokens"] += sum(mask)
        chunk.n["boundary_tokens"] += n_boundary
        chunk.n["images"] += len(sample_refs)


def _assemble(store: ChunkStore, data: list[Path], tmp: Path, vocab_size: int, images: bool) -> dict[str, Any]:
    """The committed chunks -> ``dataset/``, ``token_counts.safetensors``, ``bad_records.jsonl`` (and the inline
    images, ``images/``); the totals."""
    import datasets
    import pyarrow.compute as pc
    from datasets.table import MemoryMappedTable, concat_tables

    chunks = store.chunks()
    totals: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    samples_dropped: Counter[str] = Counter()
    counts = np.zeros(vocab_size, dtype=np.int64)
    digest = hashlib.sha256()
    tables = []
    with open(tmp / "bad_records.jsonl", "w", encoding="utf-8") as bad_file:
        for rows_file, stats in chunks:
            totals.update({k: v for k, v in stats.items() if isinstance(v, int)})
            dropped.update(stats["dropped"])
            samples_dropped.update(stats["samples_dropped"])
            for line in stats["bad"]:
                bad_file.write(json.dumps(line) + "\n")
            table = MemoryMappedTable.from_file(str(rows_file))
            if table.num_rows:
                ids = pc.list_flatten(table.table.column("input_ids")).to_numpy()
                mask = pc.list_flatten(table.table.column("loss_mask")).to_numpy().astype(bool)
                counts += np.bincount(ids[mask], minlength=vocab_size)
                tables.append(table)
            digest.update(rows_file.read_bytes())
    read, kept = totals["records_read"], totals["kept"]
    if read == 0:
        raise UserError(f"{', '.join(map(str, data))} holds no records")
    if kept == 0:
        reasons = ", ".join(f"{r}: {n}" for r, n in dropped.most_common())
        raise UserError(f"no usable records in {', '.join(map(str, data))} ({read} read; {reasons})")
    # the fingerprint is the content's hash, so that a resumed run writes the same bytes as an uninterrupted one
    dataset = datasets.Dataset(concat_tables(tables), info=datasets.DatasetInfo(features=_features(images)),
                               fingerprint=digest.hexdigest()[:16])
    dataset.save_to_disk(str(tmp / "dataset"))
    del dataset, tables
    save_file({"counts": torch.from_numpy(counts)}, str(tmp / "token_counts.safetensors"))
    if (store.folder / IMAGE_DIR).is_dir():  # copied, not moved: the chunks stay whole until the output is published
        shutil.copytree(store.folder / IMAGE_DIR, tmp / IMAGE_DIR)
    tokens, masked = totals["tokens"], totals["masked_tokens"]
    return {
        "records_read": read,
        "kept": kept,
        "dropped": dict(sorted(dropped.items())),
        "samples": totals["samples"],
        "samples_dropped": {k: v for k, v in sorted(samples_dropped.items()) if v > 0},
        "split_records": totals["split_records"],
        "truncated": totals["truncated"],
        "tokens": tokens,
        "masked_tokens": masked,
        "masked_fraction": round(masked / tokens, 4) if tokens else 0.0,
        "distinct_masked_tokens": int((counts > 0).sum()),
        "boundary_tokens": totals["boundary_tokens"],
        "redacted": totals["redacted"],
        **({"images": totals["images"]} if images else {}),
    }


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    keys = ("verifier_id", "records_read", "kept", "samples", "tokens", "masked_tokens", "masked_fraction",
            "truncated", "records_per_second")
    print_summary_table(f"prepare -> {out}", [*((key, str(summary[key])) for key in keys),
                                               *((f"dropped: {reason}", str(n))
                                                 for reason, n in summary["dropped"].items())])
