"""Draft families side by side on the embedded verifier: same data, same optimizer steps, same seed.

For each family configuration: train offline (in a subprocess, to read its peak memory), export, and evaluate
with real speculative decoding on held-out built-in prompts at k = 3, 5, 7: held-out τ, draft forwards and
draft milliseconds per verification step, end-to-end tokens/s with the verifier, and its ratio to the
verifier alone measured in the same run; plus training tokens/s and peak RSS. Prints a table, writes
``results.json`` and ``families.png`` into ``--work``.

Data: a pipeline run's prepare / vocab / extract folders (``--run``) so every family trains on the same stored
hidden states. A family reads any subset of the stored aux layers (``aux_layer_ids=2/15/28`` in its spec), so the
DFlash config's extraction (five layers) serves all families:

    python benchmarks/families.py --run runs/smollm2-135m-dflash --steps 120 --work /tmp/families \
        --families eagle3:aux_layer_ids=2/15/28 peagle:aux_layer_ids=2/15/28,num_layers=2 dflash:block_size=4 \
        --ks 3 5 7 --max-prompts 6

Drafts that predict acceptance (a confidence head) are also evaluated with each ``--confidence-thresholds`` value
(``off`` = verify every drafted token): the rows then differ in draft tokens verified per step, e.g. DFlash against
DSpark at the same budget, with and without the cut (DSpark's block of B drafts B tokens, DFlash's B - 1)::

    python benchmarks/families.py --run runs/smollm2-135m-dflash --steps 120 --work /tmp/dspark \
        --families dflash:block_size=5 dspark:block_size=4 --ks 4 --confidence-thresholds off 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml


def parse_family(spec: str) -> tuple[str, dict, list[int] | None]:
    """``peagle:aux_layer_ids=2/15/28,num_layers=2`` -> ("peagle", {"num_layers": 2}, [2, 15, 28])."""
    name, _, rest = spec.partition(":")
    options, aux = {}, None
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "aux_layer_ids":
            aux = [int(v) for v in value.split("/")]
        else:
            options[key] = yaml.safe_load(value)
    return name, options, aux


def run_with_peak_rss(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run ``cmd``; returns (seconds, peak RSS in MB from /proc/PID/status VmHWM, polled until it exits)."""
    peak = [0.0]
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})

        def poll() -> None:
            while proc.poll() is None:
                try:
                    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak[0] = max(peak[0], int(line.split()[1]) / 1024)
                except OSError:
                    pass
                time.sleep(0.5)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        rc = proc.wait()
        watcher.join()
    if rc:
        raise SystemExit(f"{' '.join(cmd[:4])} failed (rc {rc}); see {log}")
    return time.perf_counter() - t0, peak[0]


def train_family(run: Path, out: Path, name: str, options: dict, aux: list[int] | None, steps: int, batch_tokens: int,
                 seed: int) -> dict:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump({
        "verifier": "smollm2-135m", "vocab": str(run / "vocab"), "hidden_states": str(run / "extract"),
        "out": str(out), "max_steps": steps, "batch_tokens": batch_tokens, "pack": True, "lr": 1e-3,
        "warmup_steps": 10, "eval_fraction": 0.05, "eval_every": 0, "save_every": 0, "seed": seed,
        "progress": False, "algorithm": name, name: options, "aux_layer_ids": aux}))
    cmd = [sys.executable, "-m", "tiny_speculators.cli", "train", "--config", str(config)]
    seconds, peak = run_with_peak_rss(cmd, out.parent / f"{out.name}.train.log")
    summary = json.loads((out / "summary.json").read_text())
    return {"train_wall_s": seconds, "train_loop_s": summary["train_seconds"], "peak_rss_mb": peak,
            "train_tokens_per_s": summary["tokens_seen"] / summary["train_seconds"],
            "draft_parameters": summary["draft_parameters"], "val_accept_len": (summary["final_val"] or {}).get(
                "accept_len")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/smollm2-135m"),
                    help="pipeline run dir with prepare/, vocab/ and extract/")
    ap.add_argument("--families", nargs="+", default=["eagle3", "peagle:num_layers=2"])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--max-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--confidence-thresholds", nargs="+", default=["off"],
                    help="for drafts with a confidence head: evaluate once per value (off = verify the whole chain)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/families"))
    a = ap.parse_args()
    from tiny_speculators.errors import UserError
    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.export.stage import export

    for sub in ("vocab", "extract"):
        if not (a.run / sub).is_dir():
            raise SystemExit(f"{a.run / sub} is missing: run the pipeline first (it needs prepare, vocab, extract)")
    a.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for spec in a.families:
        name, options, aux = parse_family(spec)
        tag = spec.replace(":", "_").replace(",", "_").replace("=", "").replace("/", "-")
        out = a.work / tag
        row: dict = {"family": name, "options": options}
        if (a.work / f"{tag}.json").is_file():  # resume a partly measured benchmark
            results[spec] = json.loads((a.work / f"{tag}.json").read_text())
            continue
        if not (out / "final").is_dir():
            row.update(train_family(a.run, out, name, options, aux, a.steps, a.batch_tokens, a.seed))
        export(out, out=a.work / f"{tag}-export")
        row["k"] = {}
        for k in a.ks:
            for threshold in a.confidence_thresholds:
                key = str(k) if threshold == "off" else f"{k}@{threshold}"
                try:
                    ev = evaluate("smollm2-135m", a.work / f"{tag}-export", a.work / f"{tag}-eval-k{key}",
                                  prompts="builtin", k=k, max_new_tokens=a.max_new_tokens, max_prompts=a.max_prompts,
                                  seed=a.seed, confidence_threshold=threshold if threshold == "off" else
                                  float(threshold))
                except UserError as e:  # no confidence head: only "off" applies
                    if threshold == "off":
                        raise
                    print(f"{spec}: threshold {threshold} skipped ({e})")
                    continue
                cal = ev.get("confidence_calibration") or {}
                row["k"][key] = {**{name: ev[name] for name in (
                    "acceptance_length", "per_position_acceptance", "verified_tokens_per_step",
                    "draft_forwards_per_step", "draft_ms_per_step", "tokens_per_second",
                    "baseline_tokens_per_second", "speedup", "matches_baseline")}, "confidence_ece": cal.get("ece")}
        (a.work / f"{tag}.json").write_text(json.dumps(row, indent=2))
        results[spec] = row
    (a.work / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results, a)
    plot(results, a.work / "families.png")


def print_table(results: dict, a) -> None:
    print(f"\n{a.run}: {a.steps} steps x {a.batch_tokens} packed tokens, seed {a.seed}; evaluated on "
          f"{a.max_prompts} held-out prompts x {a.max_new_tokens} tokens (fp32, greedy)")
    print("| family | params | train tok/s | peak RSS MB | k (@ confidence threshold) | τ | verified tok/step | "
          "draft fwd/step | draft ms/step | tok/s | vs verifier alone | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec, r in results.items():
        for k, e in r["k"].items():
            verified = e.get("verified_tokens_per_step")
            print(f"| {spec} | {r.get('draft_parameters', 0):,} | {r.get('train_tokens_per_s', 0):.0f} | "
                  f"{r.get('peak_rss_mb', 0):.0f} | {k} | {e['acceptance_length']:.3f} | "
                  f"{'-' if verified is None else f'{verified:.2f}'} | "
                  f"{e['draft_forwards_per_step']:.2f} | {e['draft_ms_per_step']:.1f} | {e['tokens_per_second']:.1f} | "
                  f"{e['speedup']:.2f}x | {e['matches_baseline']} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for spec, r in results.items():
        ks = sorted(int(k) for k in r["k"] if "@" not in str(k))  # the uncut rows
        ax1.plot(ks, [r["k"][k if k in r["k"] else str(k)]["acceptance_length"] for k in ks], marker="o", label=spec)
        ax2.plot(ks, [r["k"][k if k in r["k"] else str(k)]["draft_ms_per_step"] for k in ks], marker="o", label=spec)
    ax1.set_xlabel("k (draft tokens per step)")
    ax1.set_ylabel("held-out τ")
    ax2.set_xlabel("k (draft tokens per step)")
    ax2.set_ylabel("draft ms per verification step")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
