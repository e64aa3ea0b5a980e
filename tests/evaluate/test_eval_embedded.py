"""Lossless speculative decoding on the embedded SmolLM2-135M verifier (chat-template prompts)."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import random_draft
from transformers import AutoModelForCausalLM

from tiny_speculators.evaluate.decoding import TreeParams, speculative_generate
from tiny_speculators.evaluate.prompts import load_prompts, render_prompt
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.verifier.capture import default_aux_layer_ids


@pytest.mark.slow
def test_embedded_verifier_greedy_is_lossless(smollm2_dir, smollm2_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval().requires_grad_(False)
    target = TargetRunner(model, default_aux_layer_ids(model.config.num_hidden_layers))
    proposer = Eagle3Proposer(random_draft(model, draft_vocab=8000))
    for prompt in load_prompts("builtin", max_prompts=2):
        ids = render_prompt(prompt, smollm2_tokenizer)
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=smollm2_tokenizer.pad_token_id)[0, len(ids):].tolist()
        chain = speculative_generate(target, proposer, ids, k=3, max_new_tokens=12)
        tree = speculative_generate(target, proposer, ids, max_new_tokens=12,
                                    tree=TreeParams(depth=3, topk=2, total_tokens=5))
        assert chain.tokens == ref and tree.tokens == ref
        assert sum(chain.accepted) <= 2  # a random draft: tau ~ 1


@pytest.mark.slow
def test_embedded_verifier_trained_draft_tau_above_one(smollm2_dir):
    """A small draft self-distilled on SmolLM2's own greedy continuations (IN-SAMPLE: decoded on the
    prompts it was trained on) accepts clearly more than a random draft, and stays lossless."""
    from eval_helpers import self_distilled_draft

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval().requires_grad_(False)
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    t = self_distilled_draft(model, aux, num_seqs=4, new_tokens=32, steps=40, intermediate_size=256)
    target, proposer = TargetRunner(model, aux), Eagle3Proposer(t["draft"])
    seqs, p_len = t["seqs"], t["prompt_len"]
    accepted = []
    for b in range(2):
        seq = seqs[b].tolist()
        res = speculative_generate(target, proposer, seq[:p_len], k=3, max_new_tokens=28)
        assert res.tokens == seq[p_len:p_len + 28]
        accepted += res.accepted
    tau = 1 + sum(accepted) / len(accepted)
    assert tau > 1.5, (tau, t["metrics"])
