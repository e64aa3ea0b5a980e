"""Training logs: ``OUT/metrics.jsonl`` (one JSON object per logged step), TensorBoard under ``OUT/tb/``,
and at the end ``OUT/training.png`` (loss and per-TTT-step accuracy, train and validation).

Only rank 0 writes. Values arrive already reduced over ranks (sums and counts, see ``loop.py``).

    python -c "from tiny_speculators.train.metrics import plot_metrics; plot_metrics('runs/draft')"
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training.png"


class MetricsLogger:
    """Append-only JSONL + TensorBoard scalars. On resume, rows past the resumed step are dropped first,
    so the log reads as one uninterrupted run."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.path = Path(out) / METRICS_FILE
        self._tb = None
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(out) / "tb"), purge_step=resume_step)
        except ImportError:  # pragma: no cover - tensorboard is a dependency
            log.warning("tensorboard is not installed; writing metrics.jsonl only")

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **values}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        if isinstance(x, (int, float)) and math.isfinite(x):
                            self._tb.add_scalar(f"{k}/{i}", x, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_metrics(out: Path) -> Path | None:
    """Write ``OUT/training.png``: loss (train, val) and accuracy per TTT step over optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out)
    train = [r for r in rows if "train/loss" in r]
    val = [r for r in rows if "val/loss" in r]
    if not train:
        return None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="train")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val/loss"] for r in val], "o-", label="val")
    ax_loss.set(xlabel="step", ylabel="loss (decay-weighted forward KL)", title="loss")
    ax_loss.legend()
    steps = len(train[-1].get("train/acc", []))
    for k in range(steps):
        ax_acc.plot([r["step"] for r in train], [r["train/acc"][k] for r in train], label=f"train step {k}")
    for k in range(len(val[-1].get("val/acc", [])) if val else 0):
        ax_acc.plot([r["step"] for r in val], [r["val/acc"][k] for r in val], "o--", label=f"val step {k}")
    ax_acc.set(xlabel="step", ylabel="accuracy (full-vocab argmax match)", title="per-TTT-step accuracy", ylim=(0, 1))
    ax_acc.legend(fontsize="small")
    fig.tight_layout()
    path = Path(out) / PLOT_FILE
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path
