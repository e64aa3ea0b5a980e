"""The ``prepare`` stage: chat data -> token ids + assistant loss mask, with the verifier's own template.

Reads ShareGPT or OpenAI-style chats (JSON, JSONL, Parquet, ``datasets`` folders), renders each
with the verifier tokenizer's chat template and writes, into ``--out``:

* ``dataset/``: a ``datasets`` folder with ``input_ids``, ``loss_mask`` (1 on assistant tokens,
  end-of-turn token included) and ``source`` (file and line/record of the chat);
* ``token_counts.safetensors``: ``counts`` (int64, ``[len(tokenizer)]``), how often each token is
  a loss-masked target (the input of the ``vocab`` stage);
* ``summary.json``: records read / kept / dropped by reason, tokens, masked tokens, options;
* ``bad_records.jsonl``: one line per unusable record (where, reason, detail).

Bad records are reported (``file:line: reason``) and skipped; ``--strict`` makes the first one an
error. Only the tokenizer is loaded, never the weights. The output folder appears atomically.

    tiny-speculators prepare --verifier smollm2-135m --data examples/chats.jsonl --out runs/prepared
    tiny-speculators prepare --verifier Qwen/Qwen3-8B --data chats.parquet --out runs/q3 --no-enable-thinking
"""

from __future__ import annotations

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

from tiny_speculators.data.chat import ChatRenderer, RecordError
from tiny_speculators.data.readers import count_records, read_records
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["prepare"]

_MAX_WARNINGS = 50  # individual bad-record warnings; the rest go to bad_records.jsonl and the summary


def _model_vocab_size(verifier: str, trust_remote_code: bool) -> int | None:
    """``config.vocab_size`` of the verifier (the embedding rows, often > len(tokenizer)), if readable."""
    try:
        from transformers import AutoConfig

        from tiny_speculators.verifier.load import resolve_verifier

        config = AutoConfig.from_pretrained(resolve_verifier(verifier), trust_remote_code=trust_remote_code)
    except Exception as e:  # a tokenizer-only folder, or no network for a hub id
        log.debug("no model config for %s (%s)", verifier, e)
        return None
    config = getattr(config, "get_text_config", lambda: config)()
    size = getattr(config, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def _claim_output(out: Path) -> Path:
    """Check that ``out`` may be (re)written and return the temporary folder to write into."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "summary.json").is_file())):
        raise UserError(f"output {out} exists and is not an earlier prepare output; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(
    verifier: str,
    data: list[Path],
    out: Path,
    max_length: int | None = None,
    overflow: Literal["truncate", "drop"] = "truncate",
    last_turn_only: bool = False,
    enable_thinking: bool | None = None,
    rewritten_turns: Literal["split", "drop"] = "split",
    chat_template: Path | None = None,
    strict: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Tokenize chats with the verifier's chat template and mask the assistant tokens.

    Args:
        verifier: HF id, local folder, or an embedded name (smollm2-135m); only its tokenizer is loaded.
        data: chat files: .jsonl, .json, .parquet, or `datasets` save_to_disk folders.
        out: output folder (dataset/, token_counts.safetensors, summary.json).
        max_length: longest sequence in tokens; longer ones are truncated or dropped (see overflow).
        overflow: what to do with sequences longer than max_length: truncate them or drop them.
        last_turn_only: mask only the final assistant turn of each conversation.
        enable_thinking: passed to the chat template (Qwen3: thinking on/off); unset leaves the template default.
        rewritten_turns: templates that re-render earlier assistant turns (Qwen3 drops old <think> blocks):
            split such turns into their own samples, or drop the record.
        chat_template: a .jinja file used instead of the tokenizer's own chat template.
        strict: fail on the first bad record instead of skipping it.
        trust_remote_code: allow the tokenizer's custom code from the hub.
    """
    from tqdm.auto import tqdm

    from tiny_speculators.verifier.load import load_tokenizer, verifier_id

    started = time.perf_counter()
    data = [Path(p) for p in data]
    if not data:
        raise UserError("prepare needs at least one --data file")
    for path in data:
        if not path.exists():
            raise UserError(f"data file {path} does not exist")
    if max_length is not None and max_length < 2:
        raise UserError(f"max_length must be at least 2, not {max_length}")
    template_text = None
    if chat_template is not None:
        if not Path(chat_template).is_file():
            raise UserError(f"chat template file {chat_template} does not exist")
        template_text = Path(chat_template).read_text(encoding="utf-8")

    tokenizer = load_tokenizer(verifier, trust_remote_code=trust_remote_code)
    renderer = ChatRenderer(tokenizer, enable_thinking=enable_thinking, chat_template=template_text,
                            last_turn_only=last_turn_only, rewritten_turns=rewritten_turns)
    vocab_size = len(tokenizer)
    out = Path(out)
    tmp = _claim_output(out)
    loop_started = time.perf_counter()
    try:
        summary = _run(renderer, data, tmp, vocab_size, max_length, overflow, strict, tqdm)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    loop_seconds = time.perf_counter() - loop_started
    elapsed = time.perf_counter() - started
    summary = {
        "verifier": str(verifier),
        "verifier_id": verifier_id(verifier),
        "vocab_size": vocab_size,
        "model_vocab_size": _model_vocab_size(verifier, trust_remote_code),
        **summary,
        "data": [str(p) for p in data],
        "options": {"max_length": max_length, "overflow": overflow, "last_turn_only": last_turn_only,
                    "enable_thinking": enable_thinking, "rewritten_turns": rewritten_turns,
                    "chat_template": str(chat_template) if chat_template else None},
        "chat_template_sha256": hashlib.sha256(renderer.chat_template.encode()).hexdigest(),
        "seconds": round(elapsed, 3),
        "records_per_second": round(summary["records_read"] / loop_seconds, 1) if loop_seconds > 0 else None,
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _publish(tmp, out)
    _print_summary(summary, out)
    return summary


def _run(renderer: ChatRenderer, data: list[Path], tmp: Path, vocab_size: int, max_length: int | None,
         overflow: str, strict: bool, tqdm: Any) -> dict[str, Any]:
    import datasets
    import torch
    from datasets.arrow_writer import ArrowWriter
    from safetensors.torch import save_file

    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int64")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "source": datasets.Value("string"),
    })
    rows_path = tmp / "rows.arrow"
    counts = np.zeros(vocab_size, dtype=np.int64)
    dropped: Counter[str] = Counter()
    samples_dropped: Counter[str] = Counter()
    read = kept = samples = tokens = masked = truncated = split_records = boundary = 0
    warned = 0

    with ArrowWriter(features=features, path=str(rows_path)) as writer, \
            open(tmp / "bad_records.jsonl", "w", encoding="utf-8") as bad_file:

        def bad(where: str, error: RecordError, policy: bool = False) -> None:
            nonlocal warned
            if strict and not policy:  # drops chosen by max_length/overflow are not bad input
                raise UserError(f"{where}: {error} (--strict stops at the first bad record)")
            dropped[error.reason] += 1
            bad_file.write(json.dumps({"where": where, "reason": error.reason, "detail": error.detail}) + "\n")
            if warned < _MAX_WARNINGS:
                log.warning("%s: %s", where, error)
            elif warned == _MAX_WARNINGS:
                log.warning("more bad records: see bad_records.jsonl in the output folder")
            warned += 1

        progress = tqdm(read_records(data), total=count_records(data), unit="rec", desc="prepare",
                        disable=None, mininterval=1.0)
        for record in progress:
            read += 1
            if record.error is not None:
                bad(record.where, record.error)
                continue
            try:
                produced = renderer.samples(record.messages)
            except RecordError as e:
                bad(record.where, e)
                continue
            usable, local_drops = [], Counter()
            for sample in produced:
                ids, mask = sample.input_ids, sample.loss_mask
                if max_length is not None and len(ids) > max_length:
                    if overflow == "drop":
                        local_drops["too long"] += 1
                        continue
                    ids, mask = ids[:max_length], mask[:max_length]
                    if not any(mask):
                        local_drops["no assistant tokens within max_length"] += 1
                        continue
                    truncated += 1
                usable.append((ids, mask, sample.boundary_tokens))
            if not usable:
                reason = next(iter(local_drops))
                bad(record.where, RecordError(reason, f"longer than max_length={max_length} tokens"), policy=True)
                continue
            samples_dropped.update(local_drops)
            kept += 1
            split_records += len(usable) > 1
            for ids, mask, n_boundary in usable:
                ids_arr = np.asarray(ids, dtype=np.int64)
                mask_arr = np.asarray(mask, dtype=bool)
                if ids_arr.size and int(ids_arr.max()) >= vocab_size:
                    raise UserError(f"{record.where}: token id {int(ids_arr.max())} is outside the tokenizer's "
                                    f"{vocab_size} tokens")
                counts += np.bincount(ids_arr[mask_arr], minlength=vocab_size)
                writer.write({"input_ids": ids, "loss_mask": mask, "source": record.where})
                samples += 1
                tokens += len(ids)
                masked += int(mask_arr.sum())
                boundary += n_boundary
        progress.close()
        if kept:
            writer.finalize()

    if read == 0:
        raise UserError(f"{', '.join(map(str, data))} holds no records")
    if kept == 0:
        reasons = ", ".join(f"{r}: {n}" for r, n in dropped.most_common())
        raise UserError(f"no usable records in {', '.join(map(str, data))} ({read} read; {reasons})")

    rows = datasets.Dataset.from_file(str(rows_path))
    rows.save_to_disk(str(tmp / "dataset"))
    del rows
    rows_path.unlink()
    save_file({"counts": torch.from_numpy(counts)}, str(tmp / "token_counts.safetensors"))
    return {
        "records_read": read,
        "kept": kept,
        "dropped": dict(sorted(dropped.items())),
        "samples": samples,
        "samples_dropped": {k: v for k, v in sorted(samples_dropped.items()) if v > 0},
        "split_records": split_records,
        "truncated": truncated,
        "tokens": tokens,
        "masked_tokens": masked,
        "masked_fraction": round(masked / tokens, 4) if tokens else 0.0,
        "distinct_masked_tokens": int((counts > 0).sum()),
        "boundary_tokens": boundary,
    }


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prepare -> {out}", show_header=False)
    for key in ("verifier_id", "records_read", "kept", "samples", "tokens", "masked_tokens", "masked_fraction",
                "truncated", "records_per_second"):
        table.add_row(key, str(summary[key]))
    for reason, n in summary["dropped"].items():
        table.add_row(f"dropped: {reason}", str(n))
    Console(stderr=True).print(table)
