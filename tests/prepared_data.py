"""Test helper: prepared-dataset folders in the prepare stage's format (dataset/, summary.json, token_counts), made
directly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_prepared(path: Path, verifier: str, vocab_size: int, lengths: list[int], seed: int = 0,
                  summary_vocab: int | None = None, ids: list[list[int]] | None = None,
                  masks: list[list[int]] | None = None) -> Path:
    """A prepared folder (dataset/, summary.json, token_counts.safetensors) with random token ids < vocab_size and
    random loss masks, or the given ``ids`` and ``masks`` (``lengths`` is then theirs)."""
    import datasets

    rng = random.Random(seed)
    ids = ids or [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    masks = masks or [[int(rng.random() < 0.6) for _ in range(n)] for n in lengths]
    lengths = [len(i) for i in ids]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    summary = {"verifier": verifier, "verifier_id": verifier, "vocab_size": summary_vocab or vocab_size,
               "records_read": len(lengths), "kept": len(lengths), "dropped": {}, "tokens": sum(lengths),
               "masked_tokens": sum(map(sum, masks))}
    (path / "summary.json").write_text(json.dumps(summary))
    targets = [t for row, mask in zip(ids, masks, strict=True) for t, m in zip(row, mask, strict=True) if m]
    counts = torch.bincount(torch.tensor(targets, dtype=torch.int64), minlength=summary["vocab_size"])
    save_file({"counts": counts}, str(path / "token_counts.safetensors"))
    return path
