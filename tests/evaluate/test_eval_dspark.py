"""Speculative decoding with the DSpark proposer (one block forward per step, the Markov chain left to right, the
chain cut where the running confidence product drops) against an independent reference decode written with plain
loops: the verifier re-run on the whole sequence every step (no KV cache, no rollback), the draft's context rebuilt
from every verified position every step, the heads applied by hand. Token for token and count for count; greedy is
also the verifier's own generate, and sampling emits exactly the verifier's distribution."""

from __future__ import annotations

import json

import pytest
import torch
from eval_helpers import chi2_pvalue, exact_marginals, hf_greedy, load_model, random_prompts

from tiny_speculators.evaluate.decoding import speculative_generate
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.dspark.model import DSparkDraft
from tiny_speculators.models.dspark.proposer import DSparkProposer
from tiny_speculators.sampling import SamplingParams

AUX = [1, 2, 3]


def dspark_draft(model, aux: list[int], block_size: int = 4, rank: int = 24, seed: int = 0,
                 bigrams: dict[int, int] | None = None) -> DSparkDraft:
    """A random DSpark draft on ``model``'s embeddings / lm_head. With ``bigrams`` (token -> the verifier's usual
    next token) the Markov head is set to propose that successor and the confidence head to be sure exactly when the
    previous token has one (so chains get accepted and cut for real)."""
    c = model.config
    torch.manual_seed(seed)
    draft = DSparkDraft(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        intermediate_size=c.intermediate_size, draft_vocab_size=c.vocab_size, num_layers=2,
                        block_size=block_size, mask_token_id=0, num_aux=len(aux), aux_layer_ids=aux,
                        markov_rank=rank)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
        draft.confidence_head.proj.weight.normal_(0.0, 0.3)
        if bigrams:
            assert len(bigrams) <= rank
            draft.markov_head.markov_w1.weight.zero_()
            draft.markov_head.markov_w2.weight.zero_()
            for i, (prev, nxt) in enumerate(sorted(bigrams.items())):
                draft.markov_head.markov_w1.weight[prev, i] = 1.0
                draft.markov_head.markov_w2.weight[nxt, i] = 30.0
            draft.confidence_head.proj.weight[0, c.hidden_size:] = 4.0
            draft.confidence_head.proj.bias.fill_(-2.0)
    return draft.eval().requires_grad_(False)


def greedy_bigrams(model, prompts: list[list[int]], n: int) -> dict[int, int]:
    """The most frequent next token after each token of the verifier's greedy continuations."""
    counts: dict[tuple[int, int], int] = {}
    for p in prompts:
        seq = p + hf_greedy(model, p, n)
        for a, b in zip(seq[len(p) - 1:], seq[len(p):], strict=False):
            counts[a, b] = counts.get((a, b), 0) + 1
    best: dict[int, tuple[int, int]] = {}
    for (a, b), c in counts.items():
        if c > best.get(a, (0, -1))[0]:
            best[a] = (c, b)
    return {a: b for a, (_, b) in best.items()}


@torch.no_grad()
def reference_decode(model, draft: DSparkDraft, prompt: list[int], k: int, max_new: int, threshold: float | None):
    """Greedy speculative decoding with plain loops. Returns (tokens, accepted, proposed, confidences) per step."""

    def verifier(seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(torch.tensor([seq]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in draft.kwargs["aux_layer_ids"]], dim=-1)  # (T, n_aux*H)
        return out.logits[0].float(), aux

    head = draft.markov_head
    seq = list(prompt)
    logits, _ = verifier(seq)
    pending = int(logits[-1].argmax())
    tokens, accepted, proposed, confidences = [pending], [], [], []
    while len(tokens) < max_new:
        _, aux = verifier(seq)  # every verified position's state, recomputed from scratch
        n_ctx = len(seq)
        slots = k if draft.sample_from_anchor else k + 1
        ctx = draft.context(aux[None], torch.arange(n_ctx)[None])
        hidden = draft(torch.tensor([[pending] + [draft.mask_token_id] * (slots - 1)]),
                       torch.arange(n_ctx, n_ctx + slots)[None], ctx, block_size=slots)[0, slots - k:]
        chain, confs, prev = [], [], pending
        for i in range(k):
            normed = draft.norm(hidden[i])
            e = head.markov_w1.weight[prev]
            logit = normed @ draft.lm_head.weight.T + head.markov_w2.weight @ e
            confs.append(float(torch.sigmoid(draft.confidence_head.proj.weight[0] @ torch.cat([normed, e])
                                             + draft.confidence_head.proj.bias[0])))
            prev = int(logit.argmax())  # full vocabulary: draft id = target id
            chain.append(prev)
        m, run = 0, 1.0
        if threshold is None:
            m = k
        else:
            for c in confs:
                run *= c
                if run < threshold:
                    break
                m += 1
            m = max(m, 1)
        logits, _ = verifier([*seq, pending, *chain[:m]])
        n = 0
        while n < m and chain[n] == int(logits[n_ctx + n].argmax()):
            n += 1
        nxt = int(logits[n_ctx + n].argmax())
        seq += [pending, *chain[:n]]
        tokens += [*chain[:n], nxt]
        pending = nxt
        accepted.append(n)
        proposed.append(m)
        confidences.append(confs[:m])
    return tokens[:max_new], accepted, proposed, confidences


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_dspark_matches_the_reference_decode_and_is_lossless(small_vocab_verifier, threshold):
    model = load_model(small_vocab_verifier)
    prompts = random_prompts(model.config.vocab_size, n=3, seed=2)
    draft = dspark_draft(model, AUX, block_size=4, bigrams=greedy_bigrams(model, prompts, 24))
    target = TargetRunner(model, AUX)
    proposer = DSparkProposer(draft, confidence_threshold=threshold)
    total_accepted = total_cut = 0
    for prompt in prompts:
        res = speculative_generate(target, proposer, prompt, k=4, max_new_tokens=24)
        tokens, accepted, proposed, confidences = reference_decode(model, draft, prompt, 4, 24, threshold)
        assert res.tokens == tokens == hf_greedy(model, prompt, 24)
        assert res.accepted == accepted and res.proposed == proposed
        assert len(res.confidences) == len(confidences)
        for ours, ref in zip(res.confidences, confidences, strict=True):
            assert ours == pytest.approx(ref, abs=1e-5)
        assert res.draft_forwards == len(res.accepted)  # one draft forward per verification step
        total_accepted += sum(accepted)
        total_cut += sum(1 for p in proposed if p < 4)
    assert total_accepted > 10  # the Markov head drafts the verifier's continuations: chains do get accepted
    assert (total_cut > 0) == (threshold is not None)


def test_dspark_sampling_matches_verifier_distribution(small_vocab_verifier):
    """With the confidence cut on, the 2nd and 3rd emitted tokens follow the verifier's exact marginals
    (chi-square over 1000 seeded runs)."""
    model = load_model(small_vocab_verifier)
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        m2, m3 = exact_marginals(model, prompt, params)
    target = TargetRunner(model, AUX)
    draft = dspark_draft(model, AUX, block_size=3, seed=1, bigrams=greedy_bigrams(model, [prompt], 12))
    proposer = DSparkProposer(draft, confidence_threshold=0.5)
    gen = torch.Generator().manual_seed(1234)
    c2, c3 = torch.zeros(16), torch.zeros(16)
    accepted = steps = cut = 0
    for _ in range(1000):
        res = speculative_generate(target, proposer, prompt, k=3, max_new_tokens=3, params=params, generator=gen)
        c2[res.tokens[1]] += 1
        c3[res.tokens[2]] += 1
        accepted += sum(res.accepted)
        steps += len(res.accepted)
        cut += sum(1 for p in res.proposed if p < 3)
    assert 0.1 * steps < accepted < 2.5 * steps and cut > 0, (accepted, steps, cut)  # accept, reject and cut ran
    assert chi2_pvalue(c2, m2) > 1e-3 and chi2_pvalue(c3, m3) > 1e-3


@pytest.mark.slow
def test_dspark_matches_the_reference_decode_on_the_embedded_verifier(smollm2_dir, smollm2_tokenizer):
    from tiny_speculators.evaluate.prompts import load_prompts, render_prompt
    from tiny_speculators.models.dspark.family import FAMILY

    model = load_model(smollm2_dir)
    aux = FAMILY.default_aux_layer_ids(model.config.num_hidden_layers)
    prompts = [render_prompt(p, smollm2_tokenizer) for p in load_prompts("builtin", max_prompts=2)]
    draft = dspark_draft(model, aux, block_size=8, rank=64, bigrams=greedy_bigrams(model, prompts, 16))
    proposer = DSparkProposer(draft, confidence_threshold=0.3)
    target = TargetRunner(model, aux)
    for prompt in prompts:
        res = speculative_generate(target, proposer, prompt, k=8, max_new_tokens=16)
        tokens, accepted, proposed, _ = reference_decode(model, draft, prompt, 8, 16, 0.3)
        assert res.tokens == tokens == hf_greedy(model, prompt, 16)
        assert res.accepted == accepted and res.proposed == proposed


def test_evaluate_stage_reports_verified_tokens_and_calibration(tiny_llama_dir, tmp_path):
    """The stage with a DSpark checkpoint: --confidence-threshold off verifies the whole block, a threshold sends
    fewer tokens per step; both report the confidence calibration and write calibration.png. A draft without a
    confidence estimate refuses a threshold."""
    from tiny_speculators.cli import main
    from tiny_speculators.errors import UserError
    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.models.checkpoint import save_draft

    model = load_model(tiny_llama_dir)
    aux = [2, 4, 5]
    meta = {"verifier": {"name_or_path": str(tiny_llama_dir), "architectures": ["LlamaForCausalLM"],
                         "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size}}
    save_draft(tmp_path / "draft", dspark_draft(model, aux, block_size=4), meta)
    common = ["evaluate", "--verifier", str(tiny_llama_dir), "--draft", str(tmp_path / "draft"), "--prompts",
              "builtin", "--max-prompts", "2", "--max-new-tokens", "12", "--k", "4", "--no-baseline"]
    assert main([*common, "--out", str(tmp_path / "off"), "--confidence-threshold", "off"]) == 0
    assert main([*common, "--out", str(tmp_path / "cut"), "--confidence-threshold", "0.6"]) == 0
    off = json.loads((tmp_path / "off" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert off["confidence_threshold"] is None and cut["confidence_threshold"] == 0.6
    assert off["verified_tokens_per_step"] == 4.0 > cut["verified_tokens_per_step"] >= 1.0
    for run, summary in (("off", off), ("cut", cut)):
        cal = summary["confidence_calibration"]
        assert cal["num_tokens"] > 0 and 0.0 <= cal["ece"] <= 1.0 and len(cal["bins"]) == 10
        assert sum(b["count"] for b in cal["bins"]) == cal["num_tokens"]
        assert (tmp_path / run / "calibration.png").stat().st_size > 1000
    with pytest.raises(UserError, match="must be in \\[0, 1\\]"):
        evaluate(str(tiny_llama_dir), tmp_path / "draft", tmp_path / "bad", max_prompts=1, max_new_tokens=4,
                 confidence_threshold=2.0, baseline=False)
    from eval_helpers import random_draft

    save_draft(tmp_path / "eagle", random_draft(model, draft_vocab=4000), {**meta, "aux_layer_ids": aux})
    with pytest.raises(UserError, match="a eagle3 draft predicts no acceptance confidence"):
        evaluate(str(tiny_llama_dir), tmp_path / "eagle", tmp_path / "bad", max_prompts=1, max_new_tokens=4,
                 confidence_threshold=0.5, baseline=False)
    assert not (tmp_path / "bad").exists()
