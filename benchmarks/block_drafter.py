"""Training step time and memory of the DFlash draft at the embedded verifier's sizes (H 576, 9 heads, 5 aux layers,
draft vocab 4096, block 4, 2 layers) on packed rows of several documents, printed as ratios against a baseline
measured in the same run: every block forward scoring the whole row's context keys (as before session 30), against
the default, where each forward scores only the keys its blocks may see (``anchor_chunks``: a packed row's blocks
see their own document's keys). Both compute the same loss; the benchmark checks it.

Each configuration runs in its own subprocess, so its peak resident memory is its own.

    python benchmarks/block_drafter.py                          # T=2048 in 12 documents, 16/32/64 anchors each
    python benchmarks/block_drafter.py --docs 4 --anchors 32    # longer documents
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

KEYS = ("row", "document")  # the baseline first


def run_one(keys: str, seq: int, docs: int, anchors: int, steps: int) -> dict:
    import torch

    from tiny_speculators.models.dflash import objective as obj
    from tiny_speculators.models.dflash.model import DFlashDraft

    if keys == "row":  # the baseline: forwards of up to anchor_chunk columns, each over every key of the row
        def row_chunks(anchors_, starts, max_anchors, min_anchors=16):
            n, t = anchors_.shape[1], starts.shape[1]
            return [(slice(s, min(s + max_anchors, n)), (0, t)) for s in range(0, n, max_anchors)]

        obj.anchor_chunks = row_chunks
    torch.manual_seed(0)
    h, draft_vocab = 576, 4096
    draft = DFlashDraft(vocab_size=49152, hidden_size=h, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        intermediate_size=1536, draft_vocab_size=draft_vocab, num_aux=5, num_layers=2, block_size=4,
                        mask_token_id=2)
    draft.t2d.zero_()
    draft.t2d[:draft_vocab] = True
    doc = (torch.arange(seq) * docs // seq)[None]
    pos = torch.cat([torch.arange(int((doc == d).sum())) for d in range(docs)])[None]
    batch = {"input_ids": torch.randint(0, draft_vocab, (1, seq)), "document_ids": doc, "position_ids": pos,
             "loss_mask": torch.ones(1, seq), "aux_hidden_states": torch.randn(1, seq, 5 * h),
             "target_topk_ids": torch.randint(0, draft_vocab, (1, seq, 64)),
             "target_topk_logits": torch.randn(1, seq, 64)}
    module = obj.DFlashObjective(draft, None, anchors=anchors, weighting="dpace", gamma=4.0).train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)

    def one_step() -> float:
        torch.manual_seed(1)  # the same anchors in both configurations
        b = dict(batch)
        module.loss_counts(b)
        out = module(b)
        out.loss.backward()
        opt.zero_grad(set_to_none=True)  # no update: every step sees the same weights, so losses compare
        return float(out.loss)

    loss = one_step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    dt = (time.perf_counter() - t0) / steps
    return {"keys": keys, "anchors": anchors, "step_s": dt, "loss": loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--anchors", type=int, nargs="+", default=[16, 32, 64], help="anchors per document")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", nargs=2, metavar=("KEYS", "ANCHORS"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], a.seq, a.docs, int(a.one[1]), a.steps)))
        return
    print(f"T={a.seq} in {a.docs} documents, {a.steps} timed steps each")
    print(f"{'anchors/doc':>12}{'keys':>10}{'s/step':>8}{'peak RSS MB':>13}{'speed x':>9}{'loss':>10}")
    for anchors in a.anchors:
        base = None
        for keys in KEYS:
            cmd = [sys.executable, __file__, "--one", keys, str(anchors), "--seq", str(a.seq), "--docs", str(a.docs),
                   "--steps", str(a.steps)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            base = base or r
            if abs(r["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]):
                raise SystemExit(f"the {keys} keys' loss {r['loss']} differs from the row keys' {base['loss']}")
            print(f"{anchors:>12}{keys:>10}{r['step_s']:>8.2f}{r['peak_rss_mb']:>13.0f}"
                  f"{base['step_s'] / r['step_s']:>9.2f}{r['loss']:>10.4f}", flush=True)


if __name__ == "__main__":
    main()
