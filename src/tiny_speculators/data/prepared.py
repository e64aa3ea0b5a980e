"""Read a ``prepare`` output folder (the input of ``vocab``, ``extract`` and online training).

    from tiny_speculators.data.prepared import load_prepared
    prepared = load_prepared("runs/prepared")
    print(len(prepared.dataset), prepared.summary["masked_tokens"])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from tiny_speculators.errors import UserError

__all__ = ["PreparedData", "load_prepared"]


@dataclass
class PreparedData:
    """``dataset`` has columns ``input_ids``, ``loss_mask`` (0/1, same length) and ``source``."""

    path: Path
    dataset: Any  # datasets.Dataset
    summary: dict[str, Any]

    def token_counts(self):
        """int64 tensor ``[vocab_size]``: how often each token id is a loss-masked target."""
        file = self.path / "token_counts.safetensors"
        if not file.is_file():
            raise UserError(f"{self.path} has no token_counts.safetensors; run `tiny-speculators prepare` again")
        return load_file(str(file))["counts"]


def load_prepared(path: str | Path) -> PreparedData:
    """Open the output folder of ``tiny-speculators prepare``; a wrong folder is a ``UserError``."""
    import datasets

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"prepared data folder {path} does not exist")
    summary_file, dataset_dir = path / "summary.json", path / "dataset"
    if not summary_file.is_file() or not dataset_dir.is_dir():
        raise UserError(f"{path} is not a prepare output (no summary.json or dataset/); "
                        "run `tiny-speculators prepare --out` into it first")
    summary = json.loads(summary_file.read_text())
    dataset = datasets.load_from_disk(str(dataset_dir))
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise UserError(f"{dataset_dir} lacks column(s) {', '.join(sorted(missing))}")
    return PreparedData(path=path, dataset=dataset, summary=summary)
