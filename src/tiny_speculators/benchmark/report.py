"""The serving benchmark's results: one entry per concurrency, speed-up ratios, a PNG and a terminal table.

Every speed-up ratio reads "> 1: the draft helps": throughputs are draft / baseline, latencies are
baseline / draft.

    from tiny_speculators.benchmark.report import level_entry, print_table, save_plot
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tiny_speculators.atomic import atomic_write
from tiny_speculators.benchmark.load import LoadResult
from tiny_speculators.benchmark.metrics import ServerCounters, SpecDecodeCounters

__all__ = ["level_entry", "overall_acceptance", "print_table", "save_plot", "side_entry", "speedups"]


def side_entry(load: LoadResult, counters: ServerCounters) -> dict[str, Any]:
    """One server at one concurrency: GuideLLM's numbers plus what the server's /metrics counted meanwhile."""
    spec = counters.spec
    return {
        **load.to_json(),
        "acceptance_length": spec.acceptance_length if spec else None,
        "per_position_acceptance": spec.per_position_acceptance if spec else None,
        "server": counters.to_json(),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def speedups(draft: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, float | None] | None:
    if baseline is None:
        return None
    return {
        "output_tokens_per_s": _ratio(draft["output_tokens_per_s"], baseline["output_tokens_per_s"]),
        "requests_per_s": _ratio(draft["requests_per_s"], baseline["requests_per_s"]),
        **{f"itl_{p}": _ratio(baseline["itl_ms"][p], draft["itl_ms"][p]) for p in ("p50", "p90", "p99")},
        **{f"ttft_{p}": _ratio(baseline["ttft_ms"][p], draft["ttft_ms"][p]) for p in ("p50", "p90", "p99")},
    }


def level_entry(concurrency: int, draft: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    return {"concurrency": concurrency, "draft": draft, "baseline": baseline, "speedup": speedups(draft, baseline)}


def overall_acceptance(counters: Sequence[ServerCounters]) -> dict[str, Any] | None:
    """The draft's counters summed over every concurrency (None when the server reported no drafts)."""
    specs = [c.spec for c in counters if c.spec is not None]
    if not specs:
        return None
    return sum(specs, SpecDecodeCounters(0, 0, 0, ())).to_json()


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: dict[str, Any]) -> None:
    """Per concurrency: latency and throughput with and without the draft, speed-up, acceptance."""
    k = f" (k={results['k']})" if results.get("k") else ""
    table = Table(title=f"vllm serve {results['served_model']} + {results['draft_name']}{k}, "
                        f"{results['requests']} requests x {results['output_tokens']} tokens per concurrency")
    for column in ("conc.", "server", "TTFT p50", "ITL mean", "ITL p50", "ITL p99", "tok/s", "req/s", "τ",
                   "accepted per pos.", "speed-up"):
        table.add_column(column, justify="left" if column in ("server", "accepted per pos.") else "right")
    for level in results["levels"]:
        for side in ("draft", "baseline"):
            entry = level[side]
            if entry is None:
                continue
            itl, per_pos = entry["itl_ms"], entry["per_position_acceptance"]
            speedup = (level["speedup"] or {}).get("output_tokens_per_s") if side == "draft" else None
            table.add_row(str(level["concurrency"]) if side == "draft" else "",
                          "draft" if side == "draft" else "alone", _fmt(entry["ttft_ms"]["p50"], 0),
                          _fmt(itl["mean"], 0), _fmt(itl["p50"], 0), _fmt(itl["p99"], 0),
                          _fmt(entry["output_tokens_per_s"], 1), _fmt(entry["requests_per_s"], 3),
                          _fmt(entry["acceptance_length"]), " ".join(f"{a:.2f}" for a in per_pos) if per_pos else "",
                          f"{speedup:.2f}x" if speedup is not None else "")
    console = Console()
    if not console.is_terminal:  # logs and pipes: no 80-column wrapping
        console = Console(width=120)
    console.print(table)
    console.print("latencies in ms; speed-up = output tokens/s with the draft / without; "
                  "draft = verifier + draft, alone = verifier alone", style="dim")


def save_plot(path: Path, results: dict[str, Any]) -> None:
    """PNG: TTFT p50, ITL p50 and output tokens/s against concurrency, with and without the draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = results["levels"]
    xs = [level["concurrency"] for level in levels]
    panels = (("TTFT p50 (ms)", lambda e: e["ttft_ms"]["p50"]),
              ("ITL mean (ms; the p50 hides slow steps)", lambda e: e["itl_ms"]["mean"]),
              ("output tokens/s", lambda e: e["output_tokens_per_s"]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for side, label, style in (("draft", "with draft" + (f" (k={results['k']})" if results.get("k") else ""),
                                    "o-"),
                                   ("baseline", "verifier alone", "s--")):
            points = [(x, value(level[side])) for x, level in zip(xs, levels, strict=True) if level[side]]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    tau = (results.get("acceptance") or {}).get("acceptance_length")
    fig.suptitle(f"{results['served_model']} served by vLLM with and without {results['draft_name']}"
                 + (f" (τ = {tau:.2f})" if tau else ""))
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
