"""Training recipes side by side on the embedded verifier: same data, same optimizer steps, same seed, one draft family.

A recipe is ``LOSS/OPTIMIZER/NOISE[/WEIGHTS][/OVERRIDES]``: ``LOSS`` is ``term[:weight]`` joined by ``+`` (``kl``,
``ce:0.1+tv:0.9``, ``lk``; terms from ``models/losses.py``), ``OPTIMIZER`` ``adamw`` or ``muon``, ``NOISE`` the std
of the Gaussian noise on the verifier's aux states, ``WEIGHTS`` ``decay`` (default), ``dpace`` or ``aligned``,
``OVERRIDES`` other train options as ``key=value`` joined by ``,`` (YAML values; ``a.b=v`` nests:
``precision=bf16,lr=0.002``, ``batch_tokens=1024,max_steps=810``, ``eagle3.decay=1.0``,
``freeze=[lm_head,layers.0.mlp]``). For each recipe:
train offline (a subprocess), export, evaluate with real speculative decoding on the held-out built-in prompts at
k = 3 (``--ks``): held-out τ; plus train and validation accuracy per draft step and training seconds. Prints a
markdown table, writes ``results.json`` and ``recipe.png`` into ``--work`` (a recipe already measured there with the
same settings is reused, so an interrupted benchmark continues, and ``results.json`` keeps the rows of earlier
invocations; one ``--work`` holds one set of settings: a row measured with others stops the run before it trains).

Data: a pipeline run's vocab / extract folders (``--run``, read only), so every recipe trains on the same stored
hidden states (``--hidden-states``: another extraction of the same samples, e.g. at other aux layers).

    python benchmarks/recipe.py --run runs/smollm2-135m --steps 148 --work /tmp/recipe \
        --recipes kl/adamw/0 kl/muon/0 lk/muon/0.05 ce:0.1+tv:0.9/muon/0.05 kl/adamw/0/dpace
    # tiny smoke run
    python benchmarks/recipe.py --run runs/smollm2-135m --steps 4 --max-prompts 1 --max-new-tokens 16 \
        --recipes kl/adamw/0 lk/muon/0.05 --work /tmp/recipe-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

DEFAULT_RECIPES = ["kl/adamw/0", "kl/muon/0", "kl/adamw/0.05", "kl/muon/0.05", "lk/adamw/0", "lk/muon/0.05",
                   "ce:0.1+tv:0.9/muon/0.05", "jsd/adamw/0", "kl/adamw/0/dpace", "lk/muon/0.05/dpace"]


def parse_recipe(spec: str) -> dict:
    """``ce:0.1+tv:0.9/muon/0.05/dpace`` -> the train options it sets."""
    parts = spec.split("/")
    overrides: dict = {}
    if len(parts) > 3 and "=" in parts[-1]:
        for item in re.split(r",(?![^\[]*\])", parts.pop()):  # commas inside [..] belong to a YAML list
            key, _, value = item.partition("=")
            *outer, last = key.split(".")
            node = overrides
            for name in outer:
                node = node.setdefault(name, {})
            node[last] = yaml.safe_load(value)
    if not 3 <= len(parts) <= 4:
        raise SystemExit(f"recipe {spec!r}: expected LOSS/OPTIMIZER/NOISE[/WEIGHTS][/OVERRIDES], e.g. kl/adamw/0")
    loss = {}
    for term in parts[0].split("+"):
        name, _, weight = term.partition(":")
        loss[name] = float(weight) if weight else 1.0
    return {"loss": loss, "optimizer": parts[1], "aux_noise_std": float(parts[2]),
            "position_weights": parts[3] if len(parts) == 4 else "decay", **overrides}


def train_recipe(run: Path, out: Path, recipe: dict, a) -> dict:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump({
        "verifier": "smollm2-135m", "vocab": str(run / "vocab"),
        "hidden_states": str(a.hidden_states or run / "extract"), "out": str(out), "max_steps": a.steps,
        "batch_tokens": a.batch_tokens, "pack": True, "lr": a.lr,
        "warmup_steps": min(10, a.steps // 10), "eval_fraction": 0.05, "eval_every": 0, "save_every": 0,
        "seed": a.seed, "progress": False, "algorithm": a.algorithm, **recipe}))
    cmd = [sys.executable, "-m", "tiny_speculators.cli", "train", "--config", str(config)]
    t0 = time.perf_counter()
    if not (out / "summary.json").is_file():  # trained already (an interrupted benchmark): only evaluate again
        with (out.parent / f"{out.name}.train.log").open("w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(a.threads)}).returncode
        if rc:
            raise SystemExit(f"training {out.name} failed (rc {rc}); see {out.parent / f'{out.name}.train.log'}")
    summary = json.loads((out / "summary.json").read_text())
    train, val = summary["final_train"] or {}, summary["final_val"] or {}
    return {"train_wall_s": time.perf_counter() - t0, "train_loop_s": summary["train_seconds"],
            "train_loss": train.get("loss"), "train_acc": train.get("acc"), "val_acc": val.get("acc"),
            "val_accept_len": val.get("accept_len"), "recorded_recipe": summary["recipe"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/smollm2-135m"),
                    help="pipeline run dir with vocab/ and extract/ (read only)")
    ap.add_argument("--hidden-states", type=Path, default=None,
                    help="an extract folder of the same samples to train on instead of RUN/extract")
    ap.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--steps", type=int, default=148)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ks", type=int, nargs="+", default=[3])
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/recipe"))
    a = ap.parse_args()
    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.export.stage import export

    for sub in ("vocab", "extract"):
        if not (a.run / sub).is_dir():
            raise SystemExit(f"{a.run / sub} is missing: run the pipeline first (it needs vocab and extract)")
    recipes = {spec: parse_recipe(spec) for spec in a.recipes}  # all specs checked before the first run
    a.work.mkdir(parents=True, exist_ok=True)
    settings = {"run": str(a.run.resolve()), "hidden_states": str(a.hidden_states.resolve() if a.hidden_states else ""),
                "algorithm": a.algorithm, "steps": a.steps, "batch_tokens": a.batch_tokens, "lr": a.lr,
                "ks": a.ks, "max_prompts": a.max_prompts, "max_new_tokens": a.max_new_tokens, "seed": a.seed}
    total = a.work / "results.json"  # every row measured in --work, earlier invocations' too: one settings per --work
    results: dict[str, dict] = json.loads(total.read_text()) if total.is_file() else {}
    tags = {spec: spec.replace("/", "_").replace(":", "").replace("+", "-").replace("=", "").replace(",", "-")
            for spec in recipes}
    rows = [(str(total), row) for row in results.values()] + [
        (str(path), json.loads(path.read_text())) for path in (a.work / f"{t}.json" for t in tags.values())
        if path.is_file()]
    for where, row in rows:  # checked before the first run
        if row.get("settings") != settings:
            raise SystemExit(f"{where} holds a row measured with other settings ({row.get('settings')}); "
                             "use another --work")
    for spec, recipe in recipes.items():
        tag = tags[spec]
        if (a.work / f"{tag}.json").is_file():  # resume a partly measured benchmark
            results[spec] = json.loads((a.work / f"{tag}.json").read_text())
            continue
        out = a.work / tag
        row = {"recipe": recipe, "settings": settings, **train_recipe(a.run, out, recipe, a)}
        export(out, out=a.work / f"{tag}-export")
        row["k"] = {}
        for k in a.ks:
            ev = evaluate("smollm2-135m", a.work / f"{tag}-export", a.work / f"{tag}-eval-k{k}", prompts="builtin",
                          k=k, max_new_tokens=a.max_new_tokens, max_prompts=a.max_prompts, seed=a.seed)
            row["k"][str(k)] = {key: ev[key] for key in ("acceptance_length", "per_position_acceptance",
                                                          "matches_baseline")}
        (a.work / f"{tag}.json").write_text(json.dumps(row, indent=2))
        results[spec] = row
    (a.work / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results, a)
    plot(results, a.work / "recipe.png")


def _fmt(values) -> str:
    return " ".join(f"{v:.3f}" for v in values) if values else "-"


def print_table(results: dict, a) -> None:
    print(f"\n{a.run} ({a.algorithm}): {a.steps} steps x {a.batch_tokens} packed tokens, lr {a.lr}, seed {a.seed}; "
          f"evaluated on {a.max_prompts} held-out prompts x {a.max_new_tokens} tokens (fp32, greedy)")
    ks = sorted({k for r in results.values() for k in r["k"]}, key=int)
    print("| recipe | " + " | ".join(f"τ k={k}" for k in ks) + " | train acc per step | val acc per step | "
          "val accept len | train s | lossless |")
    print("|---|" + "---|" * len(ks) + "---|---|---|---|---|")
    for spec, r in results.items():
        taus = " | ".join(f"{r['k'][k]['acceptance_length']:.3f}" for k in ks)
        lossless = all(r["k"][k]["matches_baseline"] for k in ks)
        val = r.get("val_accept_len")
        print(f"| {spec} | {taus} | {_fmt(r.get('train_acc'))} | {_fmt(r.get('val_acc'))} | "
              f"{val:.3f} | {r['train_loop_s']:.0f} | {lossless} |" if val is not None else
              f"| {spec} | {taus} | {_fmt(r.get('train_acc'))} | - | - | {r['train_loop_s']:.0f} | {lossless} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(results)
    k = min((k for r in results.values() for k in r["k"]), key=int)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(specs, [results[s]["k"][k]["acceptance_length"] for s in specs])
    ax1.set_xlabel(f"held-out τ at k = {k}")
    for spec in specs:
        for key, style in (("train_acc", "-"), ("val_acc", "--")):
            acc = results[spec].get(key)
            if acc:
                ax2.plot(range(len(acc)), acc, style, marker="o", label=f"{spec} ({key.split('_')[0]})")
    ax2.set_xlabel("draft step")
    ax2.set_ylabel("accuracy")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
