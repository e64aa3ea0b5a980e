"""TTT rollout length: train the same draft with K=3 and K=7 TTT steps on the embedded verifier (same data,
same number of optimizer steps) and compare accuracy per step and expected acceptance length on a held-out
split, all evaluated with a 7-step rollout, against the training time each took.

Data: the first N built-in training prompts answered greedily by the verifier itself (what the draft must
imitate), then prepare -> vocab -> extract -> train, all through the real stages.

    python benchmarks/ttt_compare.py --prompts 48 --train-steps 30 --work /tmp/ttt-compare
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def self_answers(n: int, max_new_tokens: int, out: Path) -> Path:
    import torch

    from tiny_speculators.verifier.load import load_verifier

    prompts = []
    src = Path(__file__).resolve().parents[1] / "src/tiny_speculators/resources/prompts/train.jsonl"
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        if len(rec["messages"]) == 1 and rec["messages"][0]["role"] == "user":
            prompts.append(rec["messages"])
        if len(prompts) == n:
            break
    model, tok = load_verifier("smollm2-135m")
    tok.padding_side = "left"
    rows = []
    for i in range(0, len(prompts), 16):
        chunk = prompts[i:i + 16]
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chunk]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        for m, g in zip(chunk, gen[:, enc["input_ids"].shape[1]:], strict=True):
            rows.append({"messages": [*m, {"role": "assistant", "content": tok.decode(g, skip_special_tokens=True)}]})
    path = out / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def evaluate_at(draft_dir: Path, hs: Path, val_idx: list[int], steps: int) -> dict:
    import torch

    from tiny_speculators.models.eagle3.objective import TTTModule
    from tiny_speculators.models.importing import load_draft
    from tiny_speculators.models.metrics import METRIC_KEYS, summarize
    from tiny_speculators.train.sources import OfflineSource
    from tiny_speculators.verifier.head import load_verifier_head

    draft, _ = load_draft(draft_dir)
    head = load_verifier_head("smollm2-135m")
    module = TTTModule(draft, head.target_head, steps, 1.0, "sdpa").eval()
    src = OfflineSource(hs)
    sums = None
    with torch.no_grad():
        for i in range(0, len(val_idx), 4):
            batch = src.batch(val_idx[i:i + 4], torch.device("cpu"), pack=False)
            m = module(batch).metrics
            sums = m if sums is None else {k: sums[k] + m[k] for k in METRIC_KEYS}
    return summarize(sums, 1.0)


def accept_prefix(cond_acc: list[float], k: int) -> float:
    run, total = 1.0, 1.0
    for c in cond_acc[:k]:
        run *= c
        total += run
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--eval-k", type=int, default=7, help="rollout length of the final evaluation")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ttt-compare"))
    ap.add_argument("--prepared", type=Path, help="use this prepared folder (e.g. a pipeline run's regenerated data)")
    ap.add_argument("--vocab", type=Path, help="with --prepared: its vocab folder")
    a = ap.parse_args()
    from tiny_speculators.data.prepare import prepare
    from tiny_speculators.data.vocab import vocab
    from tiny_speculators.train.data import split_train_val
    from tiny_speculators.train.stage import train
    from tiny_speculators.verifier.extract import extract

    a.work.mkdir(parents=True, exist_ok=True)
    prepared, vocab_dir = a.prepared or a.work / "prepared", a.vocab or a.work / "vocab"
    if not (a.work / "hs" / "manifest.json").is_file():
        if a.prepared is None:
            chats = self_answers(a.prompts, a.max_new_tokens, a.work)
            prepare(verifier="smollm2-135m", data=[chats], out=prepared, max_length=384)
            vocab(data=prepared, out=vocab_dir, size=4096)
        extract(verifier="smollm2-135m", data=prepared, out=a.work / "hs", dtype="float32", device="cpu",
                progress=False)
    results = {}
    for k in a.ks:
        out = a.work / f"k{k}"
        t0 = time.perf_counter()
        s = train(verifier="smollm2-135m", vocab=vocab_dir, out=out, hidden_states=a.work / "hs",
                  max_steps=a.train_steps, batch_size=a.batch_size, lr=2e-3, warmup_steps=3, eval_fraction=0.15,
                  eval_every=0, save_every=0, eagle3={"ttt_steps": k}, seed=0, progress=False,
                  resume=(out / "final").exists())
        results[k] = {"train_s": time.perf_counter() - t0, "loop_s": s["train_seconds"]}
    from tiny_speculators.storage.reader import HiddenStateReader

    n = len(HiddenStateReader(a.work / "hs"))
    _, val_idx = split_train_val(n, 0.15, 0)
    eval_k = a.eval_k
    print(f"{prepared}: {n} samples ({len(val_idx)} val), {a.train_steps} steps x batch "
          f"{a.batch_size}; all evaluated with a {eval_k}-step rollout")
    for k, r in results.items():
        m = evaluate_at(a.work / f"k{k}" / "final", a.work / "hs", val_idx, eval_k)
        r.update(m)
        acc = " ".join(f"{x:.3f}" for x in m["acc"])
        cond = " ".join(f"{x:.3f}" for x in m["cond_acc"])
        print(f"K={k}: loop {r['loop_s']:.0f} s | acc/step {acc} | cond {cond} | E[accept] "
              f"@3 {accept_prefix(m['cond_acc'], 3):.3f} @{eval_k} {m['accept_len']:.3f} | "
              f"(E[accept@{eval_k}]-1)/loop-minute {(m['accept_len'] - 1) / (r['loop_s'] / 60):.3f}")
    for k, v in results.items():
        (a.work / f"results_k{k}.json").write_text(json.dumps(v, indent=2))


if __name__ == "__main__":
    main()
