"""Training step time and memory of the drafts whose training forwards score only the keys each query may see, at
the embedded verifier's sizes (H 576, 9 heads, draft vocab 4096, 2 layers) on packed rows of several documents,
printed as ratios against a baseline measured in the same run: every forward scoring the whole row's keys.

* ``--family dflash`` (block 4, 5 aux layers): each block forward over its own document's context keys
  (``anchor_chunks``, session 30) against forwards of up to ``anchor_chunk`` blocks over the whole row.
* ``--family peagle`` (4 depths, COD ratio 0.7 / 0.2, 3 aux layers): each depth's mask slots in a forward per run
  of documents over those documents' keys (``key_chunks``, session 31) against one forward over every depth-0 key
  of the flattened batch.

Forwards split at document boundaries only once they hold ``--min-keys`` keys (``key_chunks``' ``min_keys``,
512 by default since session 32; 0 splits at every document). Every way computes the same loss; the benchmark
checks it. Each configuration runs in its own subprocess, so its peak resident memory is its own.

    python benchmarks/document_keys.py                              # DFlash, T=2048 in 12 documents, 16/32/64 anchors
    python benchmarks/document_keys.py --family peagle --docs 4 12 24
    python benchmarks/document_keys.py --family peagle --seq 256 --docs 4 --min-keys 0 512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from functools import partial

H, DRAFT_VOCAB = 576, 4096
SHAPE = {"vocab_size": 49152, "hidden_size": H, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "intermediate_size": 1536, "draft_vocab_size": DRAFT_VOCAB}


def dflash(keys: str, anchors: int, seq: int):
    """(objective, num_aux) of the embedded DFlash config's shape; with ``keys == "row"``, the pre-session-30 keys,
    else forwards of at least ``int(keys)`` keys split at document boundaries."""
    from tiny_speculators.models.dflash import objective as obj
    from tiny_speculators.models.dflash.model import DFlashDraft

    if keys == "row":  # forwards of up to anchor_chunk columns, each over every key of the row
        def row_chunks(anchors_, starts, max_anchors, min_anchors=16):
            n, t = anchors_.shape[1], starts.shape[1]
            return [(slice(s, min(s + max_anchors, n)), (0, t)) for s in range(0, n, max_anchors)]

        obj.anchor_chunks = row_chunks
    else:
        obj.anchor_chunks = partial(obj.anchor_chunks, min_keys=int(keys))
    draft = DFlashDraft(**SHAPE, num_aux=5, num_layers=2, block_size=4, mask_token_id=2)
    return obj.DFlashObjective(draft, None, anchors=anchors, weighting="dpace", gamma=4.0), 5


def peagle(keys: str, anchors: int, seq: int):
    """(objective, num_aux) of the embedded P-EAGLE config's shape; with ``keys == "row"``, the pre-session-31 keys,
    else forwards of at least ``int(keys)`` keys split at document boundaries."""
    from tiny_speculators.models.peagle import objective as obj
    from tiny_speculators.models.peagle.model import PEagleDraft

    if keys == "row":  # one forward per depth over every depth-0 key of the flattened batch
        obj.key_chunks = lambda lo, hi, max_queries, min_queries=16: [(slice(0, len(lo)), (0, seq))]
    else:
        obj.key_chunks = partial(obj.key_chunks, min_keys=int(keys))
    draft = PEagleDraft(**SHAPE, num_aux=3, num_layers=2, mask_token_id=2, num_depths=4, norm_before_residual=True)
    return obj.PEagleObjective(draft, None, depths=4, ratio=0.7, ratio_min=0.2, decay=0.7), 3


FAMILIES = {"dflash": dflash, "peagle": peagle}


def run_one(family: str, keys: str, seq: int, docs: int, anchors: int, steps: int) -> dict:
    import torch

    torch.manual_seed(0)
    module, num_aux = FAMILIES[family](keys, anchors, seq)
    draft = module.draft
    draft.t2d.zero_()
    draft.t2d[:DRAFT_VOCAB] = True
    doc = (torch.arange(seq) * docs // seq)[None]
    pos = torch.cat([torch.arange(int((doc == d).sum())) for d in range(docs)])[None]
    batch = {"input_ids": torch.randint(0, DRAFT_VOCAB, (1, seq)), "document_ids": doc, "position_ids": pos,
             "loss_mask": torch.ones(1, seq), "aux_hidden_states": torch.randn(1, seq, num_aux * H),
             "target_topk_ids": torch.randint(0, DRAFT_VOCAB, (1, seq, 64)),
             "target_topk_logits": torch.randn(1, seq, 64)}
    module.train()
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
    return {"keys": keys, "step_s": dt, "loss": loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="dflash")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, nargs="+", default=[12], help="documents per packed row")
    ap.add_argument("--anchors", type=int, nargs="+", default=None,
                    help="DFlash anchors per document (default 16 32 64); P-EAGLE samples its own")
    ap.add_argument("--min-keys", type=int, nargs="+", default=[512],
                    help="the document-split forwards' smallest key range, each against the row baseline")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", nargs=3, metavar=("KEYS", "DOCS", "ANCHORS"))
    a = ap.parse_args()
    if a.one:
        keys, docs, anchors = a.one
        print(json.dumps(run_one(a.family, keys, a.seq, int(docs), int(anchors), a.steps)))
        return
    anchors_list = a.anchors or ([16, 32, 64] if a.family == "dflash" else [0])
    print(f"{a.family}: T={a.seq}, {a.steps} timed steps each")
    print(f"{'docs':>5}{'anchors/doc':>12}{'keys':>14}{'s/step':>8}{'peak RSS MB':>13}{'speed x':>9}{'loss':>10}")
    for docs in a.docs:
        for anchors in anchors_list:
            base = None
            for keys in ["row", *map(str, a.min_keys)]:  # the baseline first
                cmd = [sys.executable, __file__, "--family", a.family, "--one", keys, str(docs), str(anchors),
                       "--seq", str(a.seq), "--steps", str(a.steps)]
                r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                base = base or r
                if abs(r["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]):
                    raise SystemExit(f"the {keys} keys' loss {r['loss']} differs from the row keys' {base['loss']}")
                label = keys if keys == "row" else f"docs, >={keys}"
                print(f"{docs:>5}{anchors or '-':>12}{label:>14}{r['step_s']:>8.2f}{r['peak_rss_mb']:>13.0f}"
                      f"{base['step_s'] / r['step_s']:>9.2f}{r['loss']:>10.4f}", flush=True)


if __name__ == "__main__":
    main()
