"""Storage layout vs draft quality: extract the same prepared data in each layout (full, fp8, topk, fp8-topk),
train the same draft on each (same seed, same steps, same batches), then evaluate every draft on the SAME
held-out samples of the full layout (the hidden states a server gives the draft) and print, per layout:
bytes per token, training seconds per step, per-step accuracy and expected acceptance length, each as a
ratio against the full layout measured in the same run.

    python benchmarks/layout_accuracy.py --prepared runs/smollm2-135m/prepare --vocab runs/smollm2-135m/vocab \
        --train-steps 100 --work /tmp/layouts

Finished extractions and trainings in ``--work`` (``hs-<layout>``, ``train-<layout>``) are reused, so a run
can be resumed, or can start from a pipeline run's extract/train folders linked there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

LAYOUTS = ("full", "fp8", "topk", "fp8-topk")


def median_step_seconds(out: Path) -> float:
    """Median optimizer-step time from the run's metrics.jsonl (an earlier, resumed run counts too)."""
    from tiny_speculators.train.metrics import read_metrics

    rows = [r for r in read_metrics(out) if r.get("tokens_per_s")]
    times = sorted(b["tokens_seen"] - a["tokens_seen"] for a, b in itertools.pairwise(rows))
    rates = sorted(r["tokens_per_s"] for r in rows[1:])
    return statistics.median(times) / statistics.median(rates)


def evaluate_on(draft_dir: Path, verifier: str, hs: Path, val_idx: list[int], steps: int) -> dict:
    """Per-step accuracy / expected acceptance of ``draft_dir`` on samples ``val_idx`` of extraction ``hs``."""
    import torch

    from tiny_speculators.models.eagle3.objective import TTTModule
    from tiny_speculators.models.importing import load_draft
    from tiny_speculators.models.metrics import METRIC_KEYS, summarize
    from tiny_speculators.train.sources import OfflineSource
    from tiny_speculators.verifier.head import load_verifier_head

    draft, _ = load_draft(draft_dir)
    module = TTTModule(draft, load_verifier_head(verifier).target_head, steps, 1.0, "sdpa").eval()
    source = OfflineSource(hs)
    sums = None
    with torch.no_grad():
        for i in range(0, len(val_idx), 8):
            m = module(source.batch(val_idx[i:i + 8], torch.device("cpu"), pack=False)).metrics
            sums = m if sums is None else {k: sums[k] + m[k] for k in METRIC_KEYS}
    return summarize(sums, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prepared", type=Path, required=True, help="a prepared dataset (e.g. a pipeline run's prepare/)")
    ap.add_argument("--vocab", type=Path, required=True, help="its draft vocabulary folder")
    ap.add_argument("--work", type=Path, default=Path("/tmp/layout-accuracy"))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the full layout")
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    a = ap.parse_args()

    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.train.data import split_train_val
    from tiny_speculators.train.stage import train
    from tiny_speculators.verifier.extract import extract

    a.work.mkdir(parents=True, exist_ok=True)
    layouts = ["full", *[x for x in a.layouts if x != "full"]]  # full is the baseline and the evaluation data
    results: dict[str, dict] = {}
    for layout in layouts:
        hs = a.work / f"hs-{layout}"
        ex = extract(verifier=a.verifier, data=a.prepared, out=hs, dtype=a.dtype, device="cpu", layout=layout,
                     topk=a.topk, progress=False)
        out = a.work / f"train-{layout}"
        t0 = time.perf_counter()
        train(verifier=a.verifier, vocab=a.vocab, out=out, hidden_states=hs, max_steps=a.train_steps,
                   batch_tokens=a.batch_tokens, pack=True, lr=a.lr, warmup_steps=a.warmup_steps,
                   eagle3={"ttt_steps": a.ttt_steps}, eval_fraction=a.eval_fraction, eval_every=0, save_every=0, seed=0,
                   progress=False, resume=(out / "final").exists())
        results[layout] = {"bytes_per_token": ex["bytes_per_token"], "tokens": sum(HiddenStateReader(hs).lengths()),
                           "train_s_per_step": median_step_seconds(out), "wall_s": time.perf_counter() - t0}

    n = len(HiddenStateReader(a.work / "hs-full"))
    _, val_idx = split_train_val(n, a.eval_fraction, 0)  # the trainer's own split (seed 0): never trained on
    for layout in layouts:
        results[layout].update(evaluate_on(a.work / f"train-{layout}" / "final", a.verifier, a.work / "hs-full",
                                           val_idx, a.ttt_steps))

    base = results["full"]
    lines = [f"{a.prepared}: {results['full']['tokens']} tokens, {n} samples ({len(val_idx)} held out, evaluated "
             f"on the full layout); {a.train_steps} steps x {a.batch_tokens} packed tokens, K={a.ttt_steps}, "
             f"top-k {a.topk}, full = {a.dtype}",
             "| layout | bytes/token | vs full | s/step | vs full | accuracy per step | E[accept] | vs full |",
             "|---|---|---|---|---|---|---|---|"]
    for layout in layouts:
        r = results[layout]
        acc = " / ".join(f"{x:.3f}" for x in r["acc"])
        lines.append(f"| {layout} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / base['bytes_per_token']:.2f} "
                     f"| {r['train_s_per_step']:.2f} | {r['train_s_per_step'] / base['train_s_per_step']:.2f} "
                     f"| {acc} | {r['accept_len']:.3f} | {(r['accept_len'] - 1) / (base['accept_len'] - 1):.2f} |")
    table = "\n".join(lines)
    print(table)
    (a.work / "results.md").write_text(table + "\n", encoding="utf-8")
    (a.work / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
