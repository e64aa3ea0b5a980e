"""The ``vocab`` stage: the draft model's vocabulary, the N most frequent loss-masked target tokens.

Writes ``vocab.safetensors`` with vLLM / speculators semantics:

* ``d2t`` (int64, ``[N]``): draft id ``i`` -> target id ``i + d2t[i]``; draft ids are the selected
  target ids in ascending order, so ``d2t`` is non-decreasing and ``d2t[0]`` = the smallest id;
* ``t2d`` (bool, ``[target_vocab]``): True for target ids that the draft can propose.

Selection: tokens by count, most frequent first, ties broken by the lower token id. When fewer
than N distinct tokens were seen, the rest is filled with the lowest unseen ids (logged and
recorded as ``filled`` in ``summary.json``). N is capped at the target vocabulary.

    tiny-speculators vocab --data runs/prepared --size 32000 --out runs/vocab
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.errors import UserError
from tiny_speculators.tables import print_summary_table

log = logging.getLogger(__name__)

__all__ = ["build_vocab", "load_vocab", "vocab"]


def build_vocab(counts: Any, size: int, target_vocab_size: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(d2t, t2d, info)`` for the ``size`` most frequent ids of ``counts`` (int tensor/array ``[V]``)."""
    counts = np.asarray(counts.cpu().numpy() if hasattr(counts, "cpu") else counts, dtype=np.int64)
    target = int(target_vocab_size or counts.shape[0])
    if target < counts.shape[0]:
        raise UserError(f"target vocab size {target} is smaller than the {counts.shape[0]} counted token ids")
    if size < 1:
        raise UserError(f"draft vocab size must be at least 1, not {size}")
    full = np.zeros(target, dtype=np.int64)
    full[: counts.shape[0]] = counts
    n = min(size, target)
    ids = np.arange(target)
    order = np.lexsort((ids, -full))  # primary: count descending; tie: lower id first
    seen = int((full > 0).sum())
    chosen = order[: min(n, seen)]
    filled = n - chosen.size
    if filled:
        unseen = ids[full == 0][:filled]  # the lowest ids that were never a target
        chosen = np.concatenate([chosen, unseen])
    selected = np.sort(chosen)
    d2t = torch.from_numpy(selected - np.arange(n, dtype=np.int64))
    t2d = torch.zeros(target, dtype=torch.bool)
    t2d[torch.from_numpy(selected)] = True
    total = int(full.sum())
    info = {
        "size": n,
        "requested_size": size,
        "capped": n < size,
        "target_vocab_size": target,
        "distinct_seen": seen,
        "filled": int(filled),
        "masked_tokens": total,
        "coverage": round(float(full[selected].sum()) / total, 6) if total else 0.0,
    }
    return d2t, t2d, info


def vocab(data: Path, out: Path, size: int = 32000, target_vocab_size: int | None = None) -> dict[str, Any]:
    """Pick the draft vocabulary: the N most frequent loss-masked tokens of a prepared dataset.

    Args:
        data: a prepare output folder (token_counts.safetensors + summary.json).
        out: output folder for vocab.safetensors (d2t, t2d) and summary.json.
        size: draft vocabulary size N (capped at the target vocabulary).
        target_vocab_size: length of t2d; default: the verifier's config vocab_size recorded by prepare,
            else the tokenizer length.
    """
    prepared = load_prepared(data)
    counts = prepared.token_counts()
    summary_in = prepared.summary
    target = target_vocab_size or summary_in.get("model_vocab_size") or summary_in.get("vocab_size") or len(counts)
    target = max(int(target), len(counts)) if target_vocab_size is None else int(target)
    if target_vocab_size is None and summary_in.get("model_vocab_size") is None:
        log.warning("%s records no model vocab size (prepared from a tokenizer-only folder?): t2d covers the "
                    "tokenizer's %d ids; pass --target-vocab-size if the model's embedding has more rows", data, target)
    d2t, t2d, info = build_vocab(counts, size, target)
    if info["capped"]:
        log.warning("draft vocab size %d capped at the target vocabulary (%d)", size, info["size"])
    if info["filled"]:
        log.warning("only %d distinct tokens were loss-masked; filled the draft vocab with the %d lowest unseen ids",
                    info["distinct_seen"], info["filled"])
    summary = {"verifier": summary_in.get("verifier"), "verifier_id": summary_in.get("verifier_id"),
               "data": str(data), **info}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"size": str(info["size"]), "target_vocab_size": str(info["target_vocab_size"])}
    atomic_write(out / "vocab.safetensors",
                 lambda tmp: save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, tmp, metadata=metadata))
    write_json_atomic(out / "summary.json", summary)
    log.info("draft vocab: %d of %d target tokens, covering %.2f%% of masked tokens", info["size"],
             info["target_vocab_size"], 100 * info["coverage"])
    _print_summary(summary, out)
    return summary


def load_vocab(path: str | Path) -> tuple[Any, Any]:
    """``(d2t int64 [N], t2d bool [target_vocab])`` from a vocab output folder (or its safetensors file)."""
    path = Path(path)
    file = path / "vocab.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path} has no vocab.safetensors; run `tiny-speculators vocab --out {path}` first")
    tensors = load_file(str(file))
    if "d2t" not in tensors or "t2d" not in tensors:
        raise UserError(f"{file} lacks d2t/t2d tensors")

    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise UserError(f"{file}: d2t must be int64 [N] and t2d bool [V]")
    if int(t2d.sum()) != d2t.numel():
        raise UserError(f"{file}: t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()}")
    return d2t, t2d


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    print_summary_table(f"vocab -> {out}", [(key, str(summary[key])) for key in
                                             ("size", "target_vocab_size", "distinct_seen", "filled", "coverage")])
