"""Training throughput and memory of the EAGLE-3 draft at the embedded verifier's sizes (H 576, vocab 49152,
30 layers), offline (hidden states given) and online (the verifier runs first), printed as ratios against a
baseline measured in the same run: the eager loss (all target rows in one chunk, no recomputation).

Each configuration runs in its own subprocess, so its peak resident memory (``ru_maxrss``) is its own; the
memory reported is the peak minus the resident size after setup (model, verifier, inputs).

    python benchmarks/train.py                       # B=2, T=512, K=3, draft vocab 32000
    python benchmarks/train.py --seq 256 --steps 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {
    "offline-eager": dict(online=False, chunk=None, checkpoint=False),
    "offline-chunked": dict(online=False, chunk=1024, checkpoint=True),
    "online-eager": dict(online=True, chunk=None, checkpoint=False),
    "online-chunked": dict(online=True, chunk=1024, checkpoint=True),
}


def rss_mb() -> float:
    import os

    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(name: str, batch: int, seq: int, steps: int, ttt_steps: int, draft_vocab: int) -> dict:
    import torch

    from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
    from tiny_speculators.models.eagle3.objective import TTTModule
    from tiny_speculators.models.ttt import step_counts
    from tiny_speculators.train.schedule import build_optimizer
    from tiny_speculators.verifier.capture import capture_hidden_states, default_aux_layer_ids
    from tiny_speculators.verifier.head import head_from_model
    from tiny_speculators.verifier.load import load_verifier

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    verifier, _ = load_verifier("smollm2-135m", with_tokenizer=False)
    head = head_from_model(verifier)
    aux_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    vocab = verifier.config.vocab_size
    d2t = torch.zeros(draft_vocab, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft = build_draft(draft_kwargs_from_verifier(verifier.config, draft_vocab), d2t, t2d,
                        embed_weight=head.embed_weight)
    module = TTTModule(draft, head.target_head, ttt_steps, 0.8, "sdpa",
                       chunk_size=cfg["chunk"] or batch * seq, checkpoint=cfg["checkpoint"])
    opt = build_optimizer(module, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, vocab, (batch, seq))
    base = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(seq)[None].expand(batch, seq)}
    aux, last = capture_hidden_states(verifier, ids, base["attention_mask"], aux_ids)
    offline_batch = {**base, "aux_hidden_states": aux.clone(), "last_hidden_state": last.clone()}

    def one_step():
        if cfg["online"]:
            a, h = capture_hidden_states(verifier, ids, base["attention_mask"], aux_ids)
            b = {**base, "aux_hidden_states": a.clone(), "last_hidden_state": h.clone()}
        else:
            b = offline_batch
        out = module(b, step_counts(b, ttt_steps).float().clamp(min=1))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up (allocator, optimizer state)
    setup_rss = rss_mb()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"name": name, "tokens_per_s": batch * seq * steps / dt, "step_s": dt / steps,
            "peak_rss_mb": peak, "step_mem_mb": max(0.0, peak - setup_rss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--one", choices=list(CONFIGS))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.batch, a.seq, a.steps, a.ttt_steps, a.draft_vocab)))
        return
    results = {}
    for name in CONFIGS:
        cmd = [sys.executable, __file__, "--one", name, "--batch", str(a.batch), "--seq", str(a.seq), "--steps",
               str(a.steps), "--ttt-steps", str(a.ttt_steps), "--draft-vocab", str(a.draft_vocab)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        print("measured", json.dumps(results[name]), flush=True)  # raw numbers as they come (runs are long on CPU)
    print(f"B={a.batch} T={a.seq} K={a.ttt_steps} draft_vocab={a.draft_vocab} (embedded verifier sizes), "
          f"{a.steps} timed steps each")
    print(f"{'config':<18}{'tok/s':>9}{'s/step':>8}{'peak RSS MB':>13}{'step mem MB':>13}{'speed x':>9}{'mem x':>8}")
    for name, r in results.items():
        base = results["online-eager" if name.startswith("online") else "offline-eager"]
        print(f"{name:<18}{r['tokens_per_s']:>9.0f}{r['step_s']:>8.2f}{r['peak_rss_mb']:>13.0f}"
              f"{r['step_mem_mb']:>13.0f}{r['tokens_per_s'] / base['tokens_per_s']:>9.2f}"
              f"{r['step_mem_mb'] / max(base['step_mem_mb'], 1e-9):>8.2f}")


if __name__ == "__main__":
    main()
