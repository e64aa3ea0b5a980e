"""Speculative decoding with a DFlash proposer (one forward per step, a block of k + 1 slots) is lossless: greedy
equals the verifier's own generate, and sampling emits exactly the verifier's distribution."""

from __future__ import annotations

import torch
from eval_helpers import chi2_pvalue, exact_marginals, hf_greedy, load_model, random_prompts

from tiny_speculators.evaluate.decoding import speculative_generate
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.models.dflash.proposer import DFlashProposer
from tiny_speculators.sampling import SamplingParams

AUX = [1, 2, 3]


def dflash_draft(model, block_size: int, seed: int = 0, std: float = 0.02) -> DFlashDraft:
    c = model.config
    torch.manual_seed(seed)
    draft = DFlashDraft(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        intermediate_size=c.intermediate_size, draft_vocab_size=c.vocab_size, num_layers=2,
                        block_size=block_size, mask_token_id=0, num_aux=len(AUX), aux_layer_ids=AUX)
    draft.reset_parameters(std)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
    return draft.eval().requires_grad_(False)


def test_dflash_greedy_is_lossless(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    target = TargetRunner(model, AUX)
    proposer = DFlashProposer(dflash_draft(model, block_size=5))
    for prompt in random_prompts(model.config.vocab_size, n=2):
        res = speculative_generate(target, proposer, prompt, k=4, max_new_tokens=16)
        assert res.tokens == hf_greedy(model, prompt, 16)
        assert res.draft_forwards == len(res.accepted)  # one draft forward per verification step


def test_dflash_sampling_matches_verifier_distribution(small_vocab_verifier):
    """2nd and 3rd emitted tokens follow the verifier's exact marginals (chi-square over 1000 seeded runs)."""
    model = load_model(small_vocab_verifier)
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        m2, m3 = exact_marginals(model, prompt, params)
    target = TargetRunner(model, AUX)
    proposer = DFlashProposer(dflash_draft(model, block_size=3, seed=1, std=0.3))
    gen = torch.Generator().manual_seed(1234)
    c2, c3 = torch.zeros(16), torch.zeros(16)
    accepted = proposed = 0
    for _ in range(1000):
        res = speculative_generate(target, proposer, prompt, k=2, max_new_tokens=3, params=params, generator=gen)
        c2[res.tokens[1]] += 1
        c3[res.tokens[2]] += 1
        accepted += sum(res.accepted)
        proposed += len(res.accepted)
    assert 0.1 * proposed < accepted < 1.5 * proposed, (accepted, proposed)  # accept and reject paths both ran
    assert chi2_pvalue(c2, m2) > 1e-3 and chi2_pvalue(c3, m3) > 1e-3
