"""Held-out τ against training data: the user's prompts, the verifier's own (``synthesize``), or both, at a fraction
of each, at equal optimizer steps (``--steps``) or equal passes over the data (``--epochs``).

Data: a pipeline run with a ``synthesize:`` section (``--run``, read only): its regenerate output holds the answered
built-in and synthesized prompts (told apart by the synthesized user turns in ``synthesize/prompts.jsonl``), its
extraction their hidden states. Each subset (source x fraction: the first records of each source, greedy answer and
sampled one together) gets its own prepare, vocab (``--vocab-size``) and an extraction that copies the run's
(``extract --reuse``: no verifier compute), then the embedded default's EAGLE-3 recipe trains on it (a subprocess),
and the exported draft is evaluated with real speculative decoding on both held-out sets: ``builtin`` (first
``--max-prompts``) and ``user`` (written by hand). Prints a markdown table with the ratio of each τ to the baseline
row (``builtin`` at fraction 1 at the same budget), train / validation top-1 accuracy (their gap: whether more data
closed it) and the seconds; writes ``results.json`` and ``curve.png`` into ``--work``. A row already measured there
is reused, so an interrupted benchmark continues.

    python benchmarks/data_curve.py --run /tmp/pool --work /tmp/curve --sources builtin synth both \\
        --fractions 0.5 1 --steps 380
    # tiny smoke run
    python benchmarks/data_curve.py --run /tmp/pool --work /tmp/curve-smoke --sources builtin --fractions 0.1 \\
        --steps 4 --max-prompts 1 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

RECIPE = ["--batch-tokens", "2048", "--pack", "--lr", "0.001", "--warmup-steps", "10", "--algorithm", "eagle3",
          "--eagle3-ttt-steps", "3", "--eagle3-fc-norm", "--eagle3-norm-before-residual", "--eagle3-init", "verifier",
          "--eval-every", "25", "--save-every", "50", "--no-progress"]  # configs/smollm2-135m.yaml's train section


def cli(*args: str, log: Path) -> None:
    with log.open("w") as f:
        code = subprocess.run([sys.executable, "-m", "tiny_speculators.cli", *args], stdout=f, stderr=subprocess.STDOUT)
    if code.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed: see {log}")


def sources(run: Path) -> dict[str, list[str]]:
    """The run's answered records (JSONL lines), by source."""
    synthesized = {_first_user_turn(line) for line in (run / "synthesize" / "prompts.jsonl").read_text().splitlines()
                   if line.strip()}
    out: dict[str, list[str]] = {"builtin": [], "synth": []}
    for line in (run / "regenerate" / "chats.jsonl").read_text().splitlines():
        out["synth" if _first_user_turn(line) in synthesized else "builtin"].append(line)
    return out


def _first_user_turn(line: str) -> str | None:
    """A chat's first user turn (multi-turn synthesized chats are told apart by it too)."""
    return next((m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"), None)


def subset(records: dict[str, list[str]], source: str, fraction: float) -> list[str]:
    names = ["builtin", "synth"] if source == "both" else [source]
    return [line for name in names for line in records[name][: math.ceil(fraction * len(records[name]))]]


def measure(a, lines: list[str], row: dict, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    run = a.run
    layers = json.loads((run / "pipeline.json").read_text())["stages"]["extract"]["options"].get("layers")
    cli("prepare", "--verifier", a.verifier, "--data", str(data), "--out", str(folder / "prepare"), "--max-length",
        "512", log=folder / "prepare.log")
    cli("vocab", "--data", str(folder / "prepare"), "--out", str(folder / "vocab"), "--size", str(a.vocab_size),
        log=folder / "vocab.log")
    cli("extract", "--verifier", a.verifier, "--data", str(folder / "prepare"), "--out", str(folder / "extract"),
        "--layout", "fp8-topk", "--reuse", str(run / "extract"), "--no-progress",
        *(["--layers", *map(str, layers)] if layers else []), log=folder / "extract.log")
    budget = ["--max-steps", str(row["steps"])] if row["steps"] else ["--epochs", str(row["epochs"])]
    t0 = time.perf_counter()
    cli("train", "--verifier", a.verifier, "--hidden-states", str(folder / "extract"), "--vocab",
        str(folder / "vocab"), "--out", str(folder / "train"), *budget, *RECIPE, log=folder / "train.log")
    seconds = time.perf_counter() - t0
    cli("export", str(folder / "train"), "--out", str(folder / "export"), log=folder / "export.log")
    taus = {}
    for prompts in ("builtin", "user"):
        cli("evaluate", "--verifier", a.verifier, "--draft", str(folder / "export"), "--out",
            str(folder / f"eval-{prompts}"), "--prompts", prompts, "--k", str(a.k), "--max-new-tokens",
            str(a.max_new_tokens), *(["--max-prompts", str(a.max_prompts)] if prompts == "builtin" else []),
            log=folder / f"eval-{prompts}.log")
        result = json.loads((folder / f"eval-{prompts}" / "results.json").read_text())
        if result["matches_baseline"] is False:
            raise SystemExit(f"{folder}: the speculative output differs from the verifier's: not lossless")
        taus[prompts] = result["acceptance_length"]
    summary = json.loads((folder / "train" / "summary.json").read_text())
    samples = json.loads((folder / "extract" / "summary.json").read_text())["total_samples"]
    return {**row, "samples": samples, "steps_run": summary["steps"], "tau_builtin": taus["builtin"],
            "tau_user": taus["user"], "train_acc": summary["final_train"]["acc"][0],
            "val_acc": summary["final_val"]["acc"][0], "train_seconds": round(seconds, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| source | fraction | samples | steps | τ builtin | vs builtin-only | τ user | vs builtin-only | "
             "train / val top-1 | train s |", "|" + "---|" * 10]
    for r in rows:
        base = next((b for b in rows if b["source"] == "builtin" and b["fraction"] == 1 and
                     (b["steps"], b["epochs"]) == (r["steps"], r["epochs"])), None)
        vs = {key: f"{r[key] / base[key]:.3f}x" if base else "-" for key in ("tau_builtin", "tau_user")}
        lines.append(f"| {r['source']} | {r['fraction']} | {r['samples']} | {r['steps_run']} | "
                     f"{r['tau_builtin']:.3f} | {vs['tau_builtin']} | {r['tau_user']:.3f} | {vs['tau_user']} | "
                     f"{r['train_acc']:.2f} / {r['val_acc']:.2f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for source in sorted({r["source"] for r in rows}):
        for budget in sorted({(r["steps"], r["epochs"]) for r in rows}, key=str):
            points = sorted((r["samples"], r["tau_builtin"]) for r in rows
                            if r["source"] == source and (r["steps"], r["epochs"]) == budget)
            label = f"{source}, {budget[0]} steps" if budget[0] else f"{source}, {budget[1]} epochs"
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xlabel("training samples")
    ax.set_ylabel("held-out τ (builtin, k = 3)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a pipeline run with synthesize, through extract")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--sources", nargs="+", default=["builtin", "synth", "both"], choices=["builtin", "synth", "both"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 1.0])
    ap.add_argument("--steps", nargs="*", type=int, default=[380], help="equal optimizer steps (one row each)")
    ap.add_argument("--epochs", nargs="*", type=int, default=[], help="equal passes over each subset")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    results = a.work / "results.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    records = sources(a.run)
    print(f"{a.run}: {len(records['builtin'])} built-in and {len(records['synth'])} synthesized records", flush=True)
    budgets = [(s, None) for s in a.steps] + [(None, e) for e in a.epochs]
    for source in a.sources:
        for fraction in a.fractions:
            for steps, epochs in budgets:
                row = {"source": source, "fraction": fraction, "steps": steps, "epochs": epochs, "k": a.k,
                       "max_prompts": a.max_prompts, "max_new_tokens": a.max_new_tokens}
                if any(all(r.get(k) == v for k, v in row.items()) for r in rows):
                    continue
                name = f"{source}-{fraction}-" + (f"{steps}steps" if steps else f"{epochs}epochs")
                rows.append(measure(a, subset(records, source, fraction), row, a.work / name))
                results.write_text(json.dumps(rows, indent=2))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    plot(rows, a.work / "curve.png")


if __name__ == "__main__":
    main()
