"""Test helper: prepared-dataset folders in the prepare stage's format (dataset/ + summary.json), made directly."""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_prepared(path: Path, verifier: str, vocab_size: int, lengths: list[int], seed: int = 0,
                  summary_vocab: int | None = None) -> Path:
    """A prepared folder (dataset/ + summary.json) with random token ids < vocab_size and random loss masks."""
    import datasets

    rng = random.Random(seed)
    ids = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    masks = [[int(rng.random() < 0.6) for _ in range(n)] for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    summary = {"verifier": verifier, "verifier_id": verifier, "vocab_size": summary_vocab or vocab_size,
               "records_read": len(lengths), "kept": len(lengths), "dropped": {}, "tokens": sum(lengths),
               "masked_tokens": sum(map(sum, masks))}
    (path / "summary.json").write_text(json.dumps(summary))
    return path
