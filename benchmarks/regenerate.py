"""Benchmark ``regenerate``: the in-process backend against ``--backend vllm`` on the same prompts.

For each backend it runs the whole stage on the first N built-in train prompts (fp32 greedy) into a fresh folder
and prints new tokens per second excluding the start (loading the verifier, or starting and waiting for
``vllm serve``) and including it (the stage's wall time), and whether each backend's answers equal the
in-process ones record for record (text, new-token and truncation counts).

    python benchmarks/regenerate.py                                   # 64 prompts, 128 new tokens
    python benchmarks/regenerate.py --prompts 8 --new-tokens 32 --backends transformers vllm-eager
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from importlib import resources
from pathlib import Path

BACKENDS = {  # name -> regenerate() keyword arguments (batch size filled in from the command line)
    "transformers": {},
    "vllm": {"backend": "vllm"},
    "vllm-eager": {"backend": "vllm", "enforce_eager": True},
}


def answers(out: Path) -> dict[str, tuple]:
    rows = [json.loads(line) for line in (out / "partial.jsonl").read_text(encoding="utf-8").splitlines()]
    return {r["id"]: (r["messages"], r["new_tokens"], r["truncated_turns"]) for r in rows}


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
    rows, reference = [], None
    for name in args.backends:
        batch = args.hf_batch if name == "transformers" else args.vllm_batch
        t0 = time.perf_counter()
        summary = regenerate("smollm2-135m", [data], root / name, max_new_tokens=args.new_tokens, batch_size=batch,
                             max_records=args.prompts, resume=False, **BACKENDS[name])
        wall = time.perf_counter() - t0
        got = answers(root / name)
        reference = reference if reference is not None else (got if name == "transformers" else None)
        same = None if reference is None else sum(got[k] == v for k, v in reference.items())
        rows.append({"backend": name, "batch": batch, "records": summary["kept"], "new_tokens": summary["new_tokens"],
                     "start_s": summary["start_seconds"], "generation_s": summary["generation_seconds"],
                     "wall_s": round(wall, 1), "tok_s": summary["new_tokens_per_second"],
                     "tok_s_with_start": round(summary["new_tokens"] / wall, 1),
                     "equal_to_transformers": same})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'backend':14} {'batch':>5} {'tokens':>7} {'start s':>8} {'gen s':>7} {'tok/s':>7} "
          f"{'tok/s incl. start':>18} {'= in-process':>13}")
    for r in rows:
        same = "-" if r["equal_to_transformers"] is None else f"{r['equal_to_transformers']}/{r['records']}"
        print(f"{r['backend']:14} {r['batch']:>5} {r['new_tokens']:>7} {r['start_s']:>8.1f} {r['generation_s']:>7.1f} "
              f"{r['tok_s']:>7.1f} {r['tok_s_with_start']:>18.1f} {same:>13}")
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
