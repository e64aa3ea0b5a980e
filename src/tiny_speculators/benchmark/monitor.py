"""The ``monitor`` stage: a running ``vllm serve``'s acceptance over time, against the τ its draft was validated at.

Every ``interval`` seconds it reads the server's ``/metrics`` and takes the spec-decode counters' change over that
window: verification steps (drafts), accepted tokens, accepted tokens per draft position. Served τ = 1 + accepted /
drafts, as vLLM counts it and as our evaluator does. Each window becomes a line of ``OUT/monitor.jsonl``; a window
whose τ is below the threshold prints an ALERT line. The threshold is ``--alert-below``, else the validated τ less
``--tolerance`` (a fraction): the validated τ is ``--expected-tau``, else what ``--draft``'s ``summary.json``
records (``export --eval-results``, or ``promote`` when it compared the draft). A window with fewer than
``--min-drafts`` steps is logged but not judged (too little traffic to say). With ``--windows N`` it stops after N
windows and exits with 4 when one raised an alert (one-shot, for cron); with 0 it runs until Ctrl-C and only
prints the alerts. ``OUT/monitor.png`` plots τ per window with the threshold.

    tiny-speculators monitor --endpoint http://127.0.0.1:8000 --draft deploy/current --out runs/monitor \
        --interval 300 --windows 1
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.benchmark.metrics import fetch_metrics, server_counters
from tiny_speculators.errors import UserError

__all__ = ["ServedTauAlert", "monitor"]

log = logging.getLogger(__name__)


class ServedTauAlert(UserError):
    """A one-shot monitor saw served τ below the threshold: its windows are written, and the command exits 4."""

    exit_code = 4


def monitor(
    endpoint: str,
    out: Path,
    draft: Path | None = None,
    expected_tau: float | None = None,
    tolerance: float = 0.1,
    alert_below: float | None = None,
    interval: float = 60.0,
    windows: int = 0,
    min_drafts: int = 20,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Watch a vLLM server's served acceptance in windows; alert when τ falls below the threshold.

    Args:
        endpoint: the server's base URL (http://host:port).
        out: output folder: monitor.jsonl (one line per window, appended), monitor.png, summary.json.
        draft: the draft the server loaded (an export or a promoted release): its summary.json's validated τ.
        expected_tau: the τ the draft was validated at (overrides the draft's record).
        tolerance: the share of the validated τ served τ may fall before an alert (0.1: 10%).
        alert_below: an absolute τ threshold instead of validated τ x (1 - tolerance).
        interval: seconds per window.
        windows: stop after this many windows and exit with 4 if one alerted; 0 runs until Ctrl-C.
        min_drafts: windows with fewer verification steps are logged, not judged.
        timeout: seconds to wait for /metrics.
    """
    if interval <= 0 or windows < 0 or min_drafts < 1 or not 0 <= tolerance < 1:
        raise UserError("interval must be > 0, windows >= 0, min_drafts >= 1 and tolerance in [0, 1)")
    out = Path(out)
    expected = expected_tau if expected_tau is not None else _validated_tau(draft)
    threshold = alert_below if alert_below is not None else (expected * (1 - tolerance) if expected else None)
    before = _spec(endpoint, timeout)
    out.mkdir(parents=True, exist_ok=True)
    log.info("monitor: %s every %.0f s, validated τ %s, alert below %s", endpoint, interval,
             "unknown" if expected is None else f"{expected:.3f}",
             "nothing" if threshold is None else f"{threshold:.3f}")
    rows: list[dict[str, Any]] = []
    try:
        while windows == 0 or len(rows) < windows:
            t0 = time.time()
            time.sleep(interval)
            after = _spec(endpoint, timeout)
            rows.append(_window(after - before, t0, expected, threshold, min_drafts))
            before = after
            with (out / "monitor.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            _report(rows[-1])
    except KeyboardInterrupt:
        log.info("monitor: stopped after %d windows", len(rows))
    summary = _summary(endpoint, rows, expected, threshold)
    write_json_atomic(out / "summary.json", summary)
    if rows:
        _plot(out / "monitor.png", rows, expected, threshold)
    if windows and summary["alerts"]:
        raise ServedTauAlert(f"served τ fell below {threshold:.3f} in {summary['alerts']} of {len(rows)} windows "
                             f"(lowest {summary['lowest_tau']:.3f}; see {out / 'monitor.jsonl'})")
    return summary


def _validated_tau(draft: Path | None) -> float | None:
    if draft is None:
        return None
    summary = Path(draft) / "summary.json"
    if not summary.is_file():
        raise UserError(f"{draft} has no summary.json: pass the exported or promoted draft, or --expected-tau")
    validated = json.loads(summary.read_text(encoding="utf-8")).get("validated") or {}
    if validated.get("acceptance_length") is None:
        raise UserError(f"{summary} records no validated τ (export --eval-results, or a promoted draft): pass "
                        "--expected-tau")
    return float(validated["acceptance_length"])


def _spec(endpoint: str, timeout: float):
    counters = server_counters(fetch_metrics(endpoint, timeout)).spec
    if counters is None:
        raise UserError(f"{endpoint} reports no spec-decode counters: it serves no draft")
    return counters


def _window(delta, t0: float, expected: float | None, threshold: float | None, min_drafts: int) -> dict[str, Any]:
    tau = delta.acceptance_length
    judged = delta.drafts >= min_drafts
    return {"start": round(t0, 3), "end": round(time.time(), 3), "drafts": delta.drafts,
            "accepted": delta.accepted, "accepted_per_position": list(delta.per_position), "tau": tau,
            "per_position_acceptance": delta.per_position_acceptance, "expected_tau": expected,
            "threshold": threshold, "judged": judged,
            "alert": bool(judged and threshold is not None and tau is not None and tau < threshold)}


def _report(row: dict[str, Any]) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(row["end"]))
    tau = "n/a" if row["tau"] is None else f"{row['tau']:.3f}"
    if row["alert"]:
        validated = "unknown" if row["expected_tau"] is None else f"{row['expected_tau']:.3f}"
        print(f"{when} ALERT: served τ {tau} below {row['threshold']:.3f} over {row['drafts']} verification steps "
              f"(validated τ {validated})", flush=True)
    elif not row["judged"]:
        print(f"{when} served τ {tau} over {row['drafts']} verification steps: too little traffic to judge", flush=True)
    else:
        print(f"{when} served τ {tau} over {row['drafts']} verification steps", flush=True)


def _summary(endpoint: str, rows: list[dict[str, Any]], expected: float | None,
             threshold: float | None) -> dict[str, Any]:
    drafts = sum(r["drafts"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    judged = [r for r in rows if r["judged"] and r["tau"] is not None]
    return {"endpoint": endpoint, "windows": len(rows), "drafts": drafts, "accepted": accepted,
            "served_tau": 1 + accepted / drafts if drafts else None, "expected_tau": expected, "threshold": threshold,
            "alerts": sum(r["alert"] for r in rows),
            "lowest_tau": min((r["tau"] for r in judged), default=None)}


def _plot(path: Path, rows: list[dict[str, Any]], expected: float | None, threshold: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = [(r["end"] - rows[0]["start"]) / 60 for r in rows]
    ax.plot(xs, [r["tau"] if r["tau"] is not None else float("nan") for r in rows], marker="o", label="served τ")
    alerts = [(x, r["tau"]) for x, r in zip(xs, rows, strict=True) if r["alert"]]
    if alerts:
        ax.plot(*zip(*alerts, strict=True), "o", color="tab:red", label="alert")
    if expected is not None:
        ax.axhline(expected, color="tab:green", linestyle="--", label=f"validated τ {expected:.2f}")
    if threshold is not None:
        ax.axhline(threshold, color="tab:red", linestyle=":", label=f"alert below {threshold:.2f}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("τ (tokens per verification step)")
    ax.set_title("served acceptance per window")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
