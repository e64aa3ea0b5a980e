"""Acceptance metrics (vLLM ``SpecDecodingStats`` definitions), the terminal table, results.json and a plot.

Definitions (one "draft" = one verification forward of the verifier, prefill excluded):
``acceptance_length = 1 + accepted_tokens / drafts`` (tokens committed per verification forward, the
bonus/replacement token included: SGLang's / EAGLE's tau), ``per_position_acceptance[i] =
(drafts whose first i+1 draft tokens were all accepted) / drafts``, ``draft_acceptance_rate =
accepted_tokens / draft_tokens``. Accepted counts are taken before truncation at EOS / max_new_tokens,
as vLLM counts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_speculators.atomic import atomic_write
from tiny_speculators.tables import print_summary_table

__all__ = ["acceptance_metrics", "calibration", "print_table", "save_calibration_plot", "save_plot"]


def acceptance_metrics(accepted: list[int], proposed: list[int], positions: int) -> dict[str, Any]:
    """Aggregate per-verification-step accepted / proposed counts into vLLM-style metrics."""
    drafts = len(accepted)
    total = sum(accepted)
    per_pos = [sum(1 for a in accepted if a > i) for i in range(positions)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": sum(proposed),
        "num_accepted_tokens": total,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_length": 1.0 + total / drafts if drafts else None,
        "per_position_acceptance": [c / drafts for c in per_pos] if drafts else [None] * positions,
        "draft_acceptance_rate": total / sum(proposed) if sum(proposed) else None,
        "verified_tokens_per_step": sum(proposed) / drafts if drafts else None,  # draft tokens sent per forward
    }


def calibration(confidences: list[list[float]], accepted: list[int], bins: int = 10) -> dict[str, Any] | None:
    """Calibration of a proposer's predicted acceptance (``confidences[s][i]``: token i of verification step s,
    ``accepted[s]``: how many of that step's tokens were accepted). Token i's outcome is observed only when every
    token before it was accepted (``i <= accepted``): accepted iff ``i < accepted``. None without confidences.

    Returns ``num_tokens``, ``mean_confidence``, ``observed_acceptance``, ``ece`` (expected calibration error:
    bin-count-weighted |mean confidence - acceptance| over ``bins`` equal-width bins), ``brier`` and the ``bins``
    (``lo``, ``hi``, ``count``, ``mean_confidence``, ``acceptance``)."""
    pairs = [(c, i < a) for cs, a in zip(confidences, accepted, strict=True) for i, c in enumerate(cs) if i <= a]
    if not pairs:
        return None
    n = len(pairs)
    table = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [(c, y) for c, y in pairs if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        table.append({"lo": lo, "hi": hi, "count": len(inside),
                      "mean_confidence": sum(c for c, _ in inside) / len(inside) if inside else None,
                      "acceptance": sum(y for _, y in inside) / len(inside) if inside else None})
    ece = sum(t["count"] / n * abs(t["mean_confidence"] - t["acceptance"]) for t in table if t["count"])
    return {"num_tokens": n, "mean_confidence": sum(c for c, _ in pairs) / n,
            "observed_acceptance": sum(y for _, y in pairs) / n, "ece": ece,
            "brier": sum((c - y) ** 2 for c, y in pairs) / n, "bins": table}


def save_calibration_plot(path: Path, cal: dict[str, Any], title: str) -> None:
    """PNG: reliability diagram (observed acceptance per confidence bin against the diagonal, left) and how many
    verified tokens fell in each bin (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = cal["bins"]
    centers = [(b["lo"] + b["hi"]) / 2 for b in bins]
    width = bins[0]["hi"] - bins[0]["lo"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(centers, [b["acceptance"] or 0.0 for b in bins], width=width * 0.9, color="tab:blue",
            label="observed acceptance")
    ax1.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=0.8, label="perfect calibration")
    ax1.plot([b["mean_confidence"] for b in bins if b["count"]], [b["acceptance"] for b in bins if b["count"]],
             "o", color="tab:red", label="bin mean confidence")
    ax1.set_xlim(0, 1)
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("predicted acceptance (confidence)")
    ax1.set_ylabel("observed acceptance")
    ax1.set_title(f"reliability (ECE {cal['ece']:.3f}, {cal['num_tokens']} tokens)")
    ax1.legend(fontsize=7)
    ax2.bar(centers, [b["count"] for b in bins], width=width * 0.9, color="tab:orange")
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("predicted acceptance (confidence)")
    ax2.set_ylabel("verified tokens")
    ax2.set_title("tokens per confidence bin")
    fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def print_table(summary: dict[str, Any]) -> None:
    """The stage's final summary on the terminal (rich)."""
    rows = [
        ("prompts", summary["num_prompts"]),
        ("acceptance length τ", summary["acceptance_length"]),
        ("draft acceptance rate", summary["draft_acceptance_rate"]),
        ("drafts (verifier forwards)", summary["num_drafts"]),
        ("draft forwards per step", summary.get("draft_forwards_per_step")),
        ("draft ms per step", summary.get("draft_ms_per_step")),
        ("draft tokens proposed / accepted", f"{summary['num_draft_tokens']} / {summary['num_accepted_tokens']}"),
        ("draft tokens verified per step", summary.get("verified_tokens_per_step")),
        ("tokens generated", summary["tokens_generated"]),
        ("tokens/s with draft", summary["tokens_per_second"]),
        ("tokens/s verifier alone", summary.get("baseline_tokens_per_second")),
        ("speed-up", summary.get("speedup")),
    ]
    cal = summary.get("confidence_calibration")
    if cal is not None:
        rows.append(("confidence: mean / observed / ECE",
                     f"{cal['mean_confidence']:.3f} / {cal['observed_acceptance']:.3f} / {cal['ece']:.3f}"))
    if summary.get("matches_baseline") is not None:
        rows.append(("greedy output == verifier alone", summary["matches_baseline"]))
    cells = [(name, _fmt(value, 2) if isinstance(value, float) else _fmt(value)) for name, value in rows]
    cells += [(f"acceptance at position {i + 1}", _fmt(rate))
              for i, rate in enumerate(summary["per_position_acceptance"])]
    print_summary_table(f"speculative decoding: {summary['mode']}", cells, header=("metric", "value"),
                        justify="right", stderr=False)


def save_plot(path: Path, per_position: list[float | None], per_prompt_tau: list[tuple[str, float | None]],
              title: str) -> None:
    """PNG: per-position acceptance (left) and τ per prompt (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(1, len(per_position) + 1))
    ax1.bar(xs, [r or 0.0 for r in per_position], color="tab:blue")
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance rate")
    ax1.set_ylim(0, 1)
    ax1.set_xticks(xs)
    ax1.set_title("per-position acceptance")
    names = [n for n, _ in per_prompt_tau]
    ax2.bar(range(len(names)), [t or 0.0 for _, t in per_prompt_tau], color="tab:orange")
    ax2.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=70, fontsize=7)
    ax2.set_ylabel("τ (tokens per verifier forward)")
    ax2.set_title("acceptance length per prompt")
    fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
