"""Benchmark ``extract --backend vllm``: its tokens/s against vLLM's plain prefill of the same tokens and against HF.

On the same prepared samples it runs, each from a cold start (engine start-up and model loading excluded):

- vLLM plain prefill: the extraction worker without the ``extract_hidden_states`` method (same engine settings,
  the same per-shard requests, ``max_tokens=1``): what vLLM costs anyway;
- ``extract --backend vllm``: the stage itself (hidden states through the connector, shards written and
  checksummed);
- ``extract --backend hf``: the in-process reference;

in the order extract vllm, extract hf, plain prefill, extract vllm again, plain prefill again (the load of a
shared machine drifts: the two plain runs bracket the others and their mean is the baseline),

and prints tokens/s and the ratios (target: vllm extract >= 0.8x plain prefill).

    python benchmarks/extract_vllm.py                              # embedded SmolLM2-135M, 32 random samples
    python benchmarks/extract_vllm.py --samples 8 --max-len 128    # a quicker CPU run
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch
from extract import make_prepared  # benchmarks/extract.py: random samples in the prepare stage's format


def plain_prefill(python: Path, model: str, dataset, plan: list[dict], dtype: str, max_model_len: int,
                  max_tokens: int, scratch: Path, log_path: Path) -> float:
    """Seconds vLLM takes to prefill the shards' samples (``max_tokens=1``, no extraction), start-up excluded."""
    from tiny_speculators.verifier.vllm_extract import VllmHiddenStates

    with VllmHiddenStates(python, model, None, 0, dtype, scratch, log_path, max_model_len=max_model_len,
                          max_num_batched_tokens=max_tokens) as worker:
        start = time.perf_counter()
        for shard in plan:
            worker.send(dataset[shard["start"]:shard["end"]]["input_ids"])
        for _ in plan:
            worker.receive()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-tokens-per-batch", type=int, default=2048)
    parser.add_argument("--shard-mb", type=float, default=24.0,
                        help="shard size: one vLLM call per shard, and small calls cost (8 MB here: 0.64-0.70x)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF backend")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from tiny_speculators.storage.manifest import load_manifest
    from tiny_speculators.verifier.extract import extract, load_prepared_dir
    from tiny_speculators.verifier.load import resolve_verifier
    from tiny_speculators.verifier.vllm_extract import vllm_extract_python

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=g).tolist()
    tokens = sum(lengths)
    common = dict(verifier=args.verifier, dtype=args.dtype, device="cpu", progress=False, shard_mb=args.shard_mb,
                  max_tokens_per_batch=args.max_tokens_per_batch)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-extract-vllm-") as tmp:
        tmp = Path(tmp)
        prepared = make_prepared(tmp / "prepared", args.verifier, 49152, lengths)
        python = vllm_extract_python(None, tmp, allow_untested=False)
        summary = extract(data=prepared, out=tmp / "vllm", backend="vllm", **common)
        assert summary["tokens"] == tokens, summary
        plan = load_manifest(tmp / "vllm")["shards"]
        dataset, _ = load_prepared_dir(prepared)
        rows.append(("extract --backend vllm", summary["tokens_per_second"], summary["seconds"]))
        if not args.skip_hf:
            hf = extract(data=prepared, out=tmp / "hf", **common)
            rows.append(("extract --backend hf", hf["tokens_per_second"], hf["seconds"]))
        plain = []
        for run in range(2):  # before and after the others on a shared machine: their mean is the baseline
            seconds = plain_prefill(python, resolve_verifier(args.verifier), dataset, plan, args.dtype,
                                    max(lengths) + 1, args.max_tokens_per_batch, tmp / "plain-scratch",
                                    tmp / "plain.log")
            plain.append(seconds)
            if run == 0:
                summary = extract(data=prepared, out=tmp / "vllm-2", backend="vllm", **common)
                rows.append(("extract --backend vllm (again)", summary["tokens_per_second"], summary["seconds"]))
        plain_s = sum(plain) / len(plain)
        rows.insert(0, (f"vLLM plain prefill, mean of {[round(s, 2) for s in plain]} s", tokens / plain_s, plain_s))

    plain_tps = rows[0][1]
    print(f"verifier {args.verifier} ({args.dtype}, CPU): {args.samples} samples, {tokens} tokens, "
          f"{len(plan)} shards, max_tokens_per_batch {args.max_tokens_per_batch}; start-up excluded")
    print(f"{'':44s} {'tokens/s':>10s} {'seconds':>9s} {'x plain prefill':>16s}")
    for name, tps, seconds in rows:
        print(f"{name:44s} {tps:10.1f} {seconds:9.2f} {tps / plain_tps:16.3f}")
    print("target: extract --backend vllm >= 0.8x plain prefill")


if __name__ == "__main__":
    main()
