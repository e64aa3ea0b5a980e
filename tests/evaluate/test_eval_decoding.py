"""Speculative decoding is lossless (greedy == verifier's own generate), accepts what it should, and
samples from exactly the verifier's distribution."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import (
    OracleProposer,
    chi2_pvalue,
    exact_marginals,
    hf_greedy,
    load_model,
    random_draft,
    random_prompts,
)

from tiny_speculators.evaluate.decoding import (
    TreeParams,
    autoregressive_generate,
    speculative_generate,
)
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.sampling import SamplingParams
from tiny_speculators.verifier.capture import default_aux_layer_ids

TREE = TreeParams(depth=3, topk=3, total_tokens=8)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_lossless_with_random_draft(arch, tiny_llama_dir, tiny_qwen3_dir):
    model = load_model(tiny_llama_dir if arch == "llama" else tiny_qwen3_dir)
    target = TargetRunner(model, default_aux_layer_ids(model.config.num_hidden_layers))
    proposer = Eagle3Proposer(random_draft(model, draft_vocab=2000))
    for prompt in random_prompts(model.config.vocab_size, n=2):
        ref = hf_greedy(model, prompt, 16)
        chain = speculative_generate(target, proposer, prompt, k=3, max_new_tokens=16)
        tree = speculative_generate(target, proposer, prompt, max_new_tokens=16, tree=TREE)
        base = autoregressive_generate(target, prompt, max_new_tokens=16)
        assert chain.tokens == ref and tree.tokens == ref and base.tokens == ref
        # a random draft (almost) never matches: tau ~ 1
        assert sum(chain.accepted) <= 1 and sum(tree.accepted) <= 2
        assert len(chain.accepted) == chain.verifier_forwards - 1


@pytest.mark.parametrize("use_tree", [False, True])
def test_perfect_draft_accepts_everything(use_tree, tiny_llama_dir):
    """A draft that predicts the verifier's greedy continuation gives tau = k + 1 (chain) / depth + 1 (tree),
    exercising acceptance, cache rollback and (tree) cache compaction on non-contiguous paths."""
    model = load_model(tiny_llama_dir)
    target = TargetRunner(model, [2, 4, 5])
    k, n_new = 4, 20
    for prompt in random_prompts(model.config.vocab_size, n=2, seed=1):
        ref = hf_greedy(model, prompt, n_new + 8)
        proposer = OracleProposer(random_draft(model), prompt + ref)
        res = speculative_generate(target, proposer, prompt, k=k, max_new_tokens=n_new,
                                   tree=TREE if use_tree else None)
        assert res.tokens == ref[:n_new]
        per_step = TREE.depth if use_tree else k
        assert res.accepted == [per_step] * len(res.accepted)
        assert len(res.accepted) == -(-(n_new - 1) // (per_step + 1))  # ceil: first token comes from prefill
        # the verifier cache holds exactly the prompt plus each step's pending + accepted tokens
        assert target.length == len(prompt) + sum(res.accepted) + len(res.accepted)


def test_eos_stops_generation(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    target = TargetRunner(model, [2, 4, 5])
    prompt = random_prompts(model.config.vocab_size, n=1, seed=2)[0]
    ref = hf_greedy(model, prompt, 20)
    eos = ref[7]
    cut = ref[: ref.index(eos) + 1]
    proposer = OracleProposer(random_draft(model), prompt + ref + [0] * 8)
    assert speculative_generate(target, proposer, prompt, k=4, max_new_tokens=20, eos_ids={eos}).tokens == cut
    assert autoregressive_generate(target, prompt, max_new_tokens=20, eos_ids={eos}).tokens == cut


@pytest.mark.parametrize("use_tree", [False, True])
def test_sampling_matches_verifier_distribution(use_tree, small_vocab_verifier):
    """2nd and 3rd emitted tokens (both produced by draft + verification) follow the verifier's exact
    marginals: chi-square p-value > 1e-3 over 1000 seeded runs; a visibly different distribution fails it."""
    model = load_model(small_vocab_verifier)
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        m2, m3 = exact_marginals(model, prompt, params)
    target = TargetRunner(model, [1, 2, 3])
    proposer = Eagle3Proposer(random_draft(model, draft_vocab=12, seed=1, std=0.3))
    gen = torch.Generator().manual_seed(1234)
    n = 1000
    c2, c3 = torch.zeros(16), torch.zeros(16)
    accepted = proposed = 0
    for _ in range(n):
        res = speculative_generate(target, proposer, prompt, k=2, max_new_tokens=3, params=params,
                                   tree=TreeParams(depth=2, topk=3, total_tokens=6) if use_tree else None,
                                   generator=gen)
        c2[res.tokens[1]] += 1
        c3[res.tokens[2]] += 1
        accepted += sum(res.accepted)
        proposed += len(res.accepted)
    # both the accept and the reject/residual paths were exercised many times
    assert 0.1 * proposed < accepted < 1.5 * proposed, (accepted, proposed)
    assert chi2_pvalue(c2, m2) > 1e-3 and chi2_pvalue(c3, m3) > 1e-3
    # the test has power: a visibly different distribution (the uniform one over the support) fails
    uniform = (m2 > 0).double() / (m2 > 0).sum()
    assert chi2_pvalue(c2, uniform) < 1e-6


def test_rejection_rule_emits_the_verifier_distribution():
    """The acceptance rule alone, many draws: the first emitted token ~ p[0] whatever q is (chi-square),
    and the acceptance rate equals sum(min(p, q)) (the theoretical value)."""
    from tiny_speculators.sampling import accept_chain, sample

    g = torch.Generator().manual_seed(0)
    v = 8
    p = torch.softmax(torch.randn(3, v, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, v, generator=g) * 1.5, dim=-1)
    q[:, 0] = 0  # the draft cannot propose token 0 (outside its vocabulary)
    q = q / q.sum(-1, keepdim=True)
    counts, first_accepted, n = torch.zeros(v), 0, 20000
    for _ in range(n):
        draft = [sample(q[0], g), sample(q[1], g)]
        accepted, nxt = accept_chain(p, q, draft, g)
        counts[draft[0] if accepted else nxt] += 1
        first_accepted += accepted > 0
    assert chi2_pvalue(counts, p[0]) > 1e-3
    assert abs(first_accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.015
