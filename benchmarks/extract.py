"""Benchmark ``extract``: plain verifier forward vs extraction with storage, and bytes/token per layout.

On the same model and data it prints: the plain forward throughput (the causal LM with logits, same padded
batches), extraction throughput with shards written and checksummed, their ratio (target >= 0.9), and
bytes/token of every storage layout against the "4 layers of bf16" layout other tools store
(3 aux + last hidden state, bf16), plus the fp8 layout's aux error.

    python benchmarks/extract.py                                  # embedded SmolLM2-135M, 24 random samples
    python benchmarks/extract.py --samples 8 --max-len 128        # a quicker CPU run
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_prepared(path: Path, verifier: str, vocab: int, lengths: list[int], seed: int = 0) -> Path:
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[1] * n for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    (path / "summary.json").write_text(json.dumps({"verifier": verifier, "verifier_id": verifier,
                                                   "vocab_size": vocab, "tokens": sum(lengths)}))
    return path


def plain_forward(model, dataset, max_tokens: int, shard_plan) -> float:
    """Seconds for the verifier's own forward (with logits) over the same padded batches extraction uses."""
    from tiny_speculators.verifier.extract import token_batches

    start = time.perf_counter()
    with torch.inference_mode():
        for shard in shard_plan:
            records = dataset[shard["start"]:shard["end"]]["input_ids"]
            lengths = [len(r) for r in records]
            for batch in token_batches(lengths, max_tokens):
                width = lengths[batch[0]]
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, : lengths[i]] = torch.tensor(records[i])
                    mask[row, : lengths[i]] = 1
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--max-tokens-per-batch", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of plain vs extract (best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    from tiny_speculators.storage.reader import HiddenStateReader
    from tiny_speculators.verifier.extract import extract, load_prepared_dir
    from tiny_speculators.verifier.load import load_verifier
    from tiny_speculators.verifier.modules import find_parts

    model, _ = load_verifier(args.verifier, dtype=args.dtype, with_tokenizer=False)
    parts = find_parts(model)
    vocab = parts.embed_tokens.num_embeddings
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=g).tolist()
    common = dict(verifier=args.verifier, dtype=args.dtype, device="cpu", progress=False,
                  max_tokens_per_batch=args.max_tokens_per_batch, shard_mb=1e6)  # one shard: same batches as below
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        tmp = Path(tmp)
        prepared = make_prepared(tmp / "prepared", args.verifier, vocab, lengths)
        dataset, _ = load_prepared_dir(prepared)
        tokens = sum(lengths)
        # warm-up (allocator, kernels) on the first shard's batches
        plan = [{"start": 0, "end": len(lengths), "tokens": tokens}]
        plain_forward(model, dataset.select(range(min(4, len(lengths)))), args.max_tokens_per_batch,
                      [{"start": 0, "end": min(4, len(lengths))}])
        plain_s, extract_s = [], []
        for r in range(args.repeats):
            plain_s.append(plain_forward(model, dataset, args.max_tokens_per_batch, plan))
            summary = extract(data=prepared, out=tmp / f"full-{r}", layout="full", **common)
            assert summary["tokens"] == tokens and summary["shards_total"] == 1, summary
            extract_s.append(summary["seconds"])
        plain_tps, extract_tps = tokens / min(plain_s), tokens / min(extract_s)

        hidden = parts.hidden_size
        reference = 4 + 1 + 4 * hidden * 2  # 3 aux + last in bf16, plus ids and mask
        rows = []
        for layout in ("full", "fp8", "topk", "fp8-topk"):
            out = tmp / f"full-{args.repeats - 1}" if layout == "full" else tmp / layout
            if layout != "full":
                extract(data=prepared, out=out, layout=layout, **common)
            manifest = HiddenStateReader(out).manifest
            rows.append((layout, manifest["bytes"] / manifest["tokens"]))
        full, fp8 = HiddenStateReader(tmp / f"full-{args.repeats - 1}"), HiddenStateReader(tmp / "fp8")
        rel = []
        for i in range(min(4, len(full))):
            a, b = full[i]["aux_hidden_states"].float(), fp8[i]["aux_hidden_states"].float()
            rel.append(((a - b).norm(dim=-1) / a.norm(dim=-1)).mean().item())

    print(f"verifier {args.verifier} ({args.dtype}, {torch.get_num_threads()} threads): {args.samples} samples, "
          f"{tokens} tokens, hidden {hidden}, layers {parts.num_hidden_layers}")
    print(f"plain forward (with logits)   {plain_tps:10.1f} tokens/s   runs {[round(s, 2) for s in plain_s]} s")
    print(f"extract + storage (full)      {extract_tps:10.1f} tokens/s   runs {[round(s, 2) for s in extract_s]} s")
    print(f"ratio extract / plain         {extract_tps / plain_tps:10.3f}   (target >= 0.9)")
    print(f"bytes/token, reference '4 layers of bf16' = {reference} B")
    for layout, bpt in rows:
        print(f"  {layout:9s} {bpt:10.1f} B/token   {bpt / reference:6.3f} x reference")
    print(f"fp8 aux relative L2 error (mean over tokens): {statistics.mean(rel):.4f}")


if __name__ == "__main__":
    main()
