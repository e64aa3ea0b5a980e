"""Benchmark ``regenerate``: the in-process backend against ``--backend vllm`` on the same prompts.

For each backend it runs the whole stage on the first N built-in train prompts (fp32 greedy) into a fresh folder
and prints new tokens per second excluding the start (loading the verifier, or starting and waiting for
``vllm serve``) and including it (the stage's wall time), whether each backend's answers equal the
in-process ones record for record (text, new-token and truncation counts), and the CPU seconds the run used
(this process and every process it started and waited for, i.e. the server): on a shared machine the wall-clock
numbers depend on the other jobs, tokens per CPU second much less.

    python benchmarks/regenerate.py                                   # 64 prompts, 128 new tokens
    python benchmarks/regenerate.py --prompts 8 --new-tokens 32 --backends transformers vllm
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import tempfile
import time
from importlib import resources
from pathlib import Path

BACKENDS = {  # name -> regenerate() keyword arguments (batch size filled in from the command line)
    "transformers": {},
    "vllm": {"backend": "vllm"},  # enforce_eager by default
    "vllm-compiled": {"backend": "vllm", "enforce_eager": False},
}


def answers(out: Path) -> dict[str, tuple]:
    rows = [json.loads(line) for line in (out / "partial.jsonl").read_text(encoding="utf-8").splitlines()]
    return {r["id"]: (r["messages"], r["new_tokens"], r["truncated_turns"]) for r in rows}


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished, waited-for descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm"], choices=list(BACKENDS))
    parser.add_argument("--hf-batch", type=int, default=32, help="in-process batch size")
    parser.add_argument("--vllm-batch", type=int, default=64, help="requests in flight to vllm serve")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from tiny_speculators.data.regenerate import regenerate

    data = Path(str(resources.files("tiny_speculators") / "resources" / "prompts" / "train.jsonl"))
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    rows = []
    for name in args.backends:
        batch = args.hf_batch if name == "transformers" else args.vllm_batch
        t0, c0, load = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]
        summary = regenerate("smollm2-135m", [data], root / name, max_new_tokens=args.new_tokens, batch_size=batch,
                             max_records=args.prompts, resume=False, **BACKENDS[name])
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        rows.append({"backend": name, "batch": batch, "records": summary["kept"], "new_tokens": summary["new_tokens"],
                     "start_s": summary["start_seconds"], "generation_s": summary["generation_seconds"],
                     "wall_s": round(wall, 1), "tok_s": summary["new_tokens_per_second"],
                     "tok_s_with_start": round(summary["new_tokens"] / wall, 1),
                     "cpu_s": round(cpu, 1), "tok_per_cpu_s": round(summary["new_tokens"] / cpu, 1),
                     "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1),
                     "equal_to_transformers": None})
        print(json.dumps(rows[-1]), flush=True)
    if "transformers" in args.backends:
        reference = answers(root / "transformers")
        for r in rows:
            got = answers(root / r["backend"])
            r["equal_to_transformers"] = sum(got.get(k) == v for k, v in reference.items())
    print(f"\n{'backend':14} {'batch':>5} {'tokens':>7} {'start s':>8} {'gen s':>7} {'tok/s':>7} "
          f"{'tok/s incl. start':>18} {'CPU s':>7} {'tok/CPU s':>10} {'= in-process':>13}")
    for r in rows:
        same = "-" if r["equal_to_transformers"] is None else f"{r['equal_to_transformers']}/{r['records']}"
        print(f"{r['backend']:14} {r['batch']:>5} {r['new_tokens']:>7} {r['start_s']:>8.1f} {r['generation_s']:>7.1f} "
              f"{r['tok_s']:>7.1f} {r['tok_s_with_start']:>18.1f} {r['cpu_s']:>7.1f} {r['tok_per_cpu_s']:>10.1f} "
              f"{same:>13}")
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
