"""A draft trained in the test (self-distillation with the TTT loss) speeds decoding up (tau clearly > 1),
stays lossless, and inference-time drafting reproduces the training-time rollout exactly."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import self_distilled_draft
from transformers import AutoModelForCausalLM

from tiny_speculators.evaluate.decoding import TreeParams, speculative_generate
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.models.ttt import rollout

AUX = [2, 4, 5]
K = 3


@pytest.fixture(scope="module")
def trained(tiny_llama_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest._one_torch_thread
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval().requires_grad_(False)
        return model, self_distilled_draft(model, AUX, steps=100, ttt_steps=K)
    finally:
        torch.set_num_threads(before)


def test_trained_draft_is_lossless_and_matches_training_rollout(trained):
    model, t = trained
    draft, seqs, p_len = t["draft"], t["seqs"], t["prompt_len"]
    target, proposer = TargetRunner(model, AUX), Eagle3Proposer(draft)
    with torch.no_grad():  # teacher-forced predictions of TTT step j at every anchor
        outs = rollout(draft, seqs, t["aux"], torch.arange(seqs.shape[1]).expand_as(seqs), steps=K)
        preds = [draft.to_target_ids(torch.argmax(draft.compute_logits(o), dim=-1)) for o in outs]  # K x (B, T)
    n_new = seqs.shape[1] - p_len - 4
    accepted_all = []
    for b in range(4):
        seq = seqs[b].tolist()
        res = speculative_generate(target, proposer, seq[:p_len], k=K, max_new_tokens=n_new)
        assert res.tokens == seq[p_len:p_len + n_new]  # the data IS the verifier's greedy output
        # replay the chain acceptance process on the training-time rollout: anchor = last verified position
        expected, anchor = [], p_len - 1
        for _ in res.accepted:
            n = 0
            while n < K and int(preds[n][b, anchor]) == seq[anchor + n + 2]:
                n += 1
            expected.append(n)
            anchor += n + 1
        assert res.accepted == expected
        accepted_all += res.accepted
    tau = 1 + sum(accepted_all) / len(accepted_all)
    assert tau > 1.5, (tau, t["metrics"])


def test_trained_draft_tree_accepts_more_than_random(trained):
    model, t = trained
    draft, seqs, p_len = t["draft"], t["seqs"], t["prompt_len"]
    target, proposer = TargetRunner(model, AUX), Eagle3Proposer(draft)
    accepted = []
    for b in range(4, 8):
        seq = seqs[b].tolist()
        res = speculative_generate(target, proposer, seq[:p_len], max_new_tokens=40,
                                   tree=TreeParams(depth=3, topk=3, total_tokens=8))
        assert res.tokens == seq[p_len:p_len + 40]
        accepted += res.accepted
    assert 1 + sum(accepted) / len(accepted) > 1.5
