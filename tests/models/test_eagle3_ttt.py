"""TTT: masks, rollout == vLLM-style chain drafting, packing, sdpa == flex, chunked loss, metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from draft_fixtures import DRAFT_VOCAB, HIDDEN, VOCAB, fixed_init, tiny_kwargs

from tiny_speculators.models.attention import KVCache, flex_available, ttt_mask_dense, ttt_mask_mod
from tiny_speculators.models.eagle3 import Eagle3Draft
from tiny_speculators.models.ttt import (
    positions_from_documents,
    rollout,
    summarize_metrics,
    ttt_step,
)


def _batch(b=2, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * HIDDEN, generator=g)
    last = torch.randn(b, t, HIDDEN, generator=g)
    head_w = torch.randn(VOCAB, HIDDEN, generator=g) * 2
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    return ids, aux, last, mask, (lambda h: h @ head_w.T)


# ------------------------------------------------------------------------------------------------ masks


def test_mask_who_attends_to_whom_with_packing():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    m = ttt_mask_dense(2, 5, doc)[0, 0]  # (5, 15): keys = step0 | step1 | step2
    assert m.shape == (5, 15)
    step0, step1, step2 = m[:, :5], m[:, 5:10], m[:, 10:]
    # step-0 keys: causal inside each document only
    expected0 = torch.tensor([[1, 0, 0, 0, 0],
                              [1, 1, 0, 0, 0],
                              [0, 0, 1, 0, 0],
                              [0, 0, 1, 1, 0],
                              [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(step0, expected0)
    # later steps: only the key at the same anchor
    assert torch.equal(step1, torch.eye(5, dtype=torch.bool)) and torch.equal(step2, torch.eye(5, dtype=torch.bool))
    assert ttt_mask_dense(0, 5, doc).shape == (1, 1, 5, 5)
    # without documents: plain causal over step-0 keys
    assert torch.equal(ttt_mask_dense(1, 4)[0, 0, :, :4], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("step", [0, 2, 3])
def test_a_sliding_window_keeps_the_keys_less_than_w_positions_back(step):
    """The query of step k at anchor t sits at position t + k; a step-0 key j at j, the step-i key at t + i."""
    t, window = 9, 3
    m = ttt_mask_dense(step, t, window=window)[0, 0]
    for q in range(t):
        for key in range((step + 1) * t):
            i, j = divmod(key, t)
            key_pos, seen = (j, j <= q) if i == 0 else (q + i, j == q)
            assert bool(m[q, key]) == (seen and q + step - key_pos < window), (q, key)
    if step >= window:  # the anchor's own step-0 key is `step` positions back: outside the window
        assert not m[:, :t].diagonal().any()


@pytest.mark.parametrize("window", [None, 2])
def test_flex_mask_mod_equals_dense_mask(window):
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    t, steps = 6, 3
    dense = ttt_mask_dense(steps - 1, t, doc, window=window)[:, 0]
    mod = ttt_mask_mod(t, doc, steps - 1, window)
    b = torch.arange(2)[:, None, None]
    q = torch.arange(t)[None, :, None]
    kv = torch.arange(steps * t)[None, None, :]
    assert torch.equal(mod(b, 0, q, kv), dense)


@pytest.mark.parametrize(("step", "window"), [(0, None), (1, None), (3, None), (3, 4)])
def test_document_by_document_attention_equals_the_dense_packed_mask(step, window):
    from tiny_speculators.models.attention import attend, packed_ttt_mask

    g = torch.Generator().manual_seed(step)
    doc = torch.tensor([[0] * 5 + [1] * 9 + [2] * 1 + [3] * 7, [0] * 12 + [1] * 10])  # B=2, T=22
    t, steps = doc.shape[1], step + 1
    q = torch.randn(2, 4, t, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, steps * t, 8, generator=g, requires_grad=True)  # GQA, step-major keys
    v = torch.randn(2, 2, steps * t, 8, generator=g, requires_grad=True)
    dense = attend(q, k, v, ttt_mask_dense(step, t, doc, window=window), scale=0.3)
    blocks = attend(q, k, v, packed_ttt_mask(step, doc, window), scale=0.3)
    torch.testing.assert_close(blocks, dense)
    w = torch.randn(dense.shape, generator=g)
    grads_dense = torch.autograd.grad((dense * w).sum(), (q, k, v))
    grads_blocks = torch.autograd.grad((blocks * w).sum(), (q, k, v))
    for a, b in zip(grads_blocks, grads_dense, strict=True):
        torch.testing.assert_close(a, b)


def test_positions_from_documents():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert positions_from_documents(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


# ------------------------------------------------------------------------------------------------ rollout


@pytest.mark.parametrize(("num_layers", "window"), [(1, None), (2, None), (1, 3), (2, 2)])
def test_rollout_equals_chain_drafting_with_kv_cache(num_layers, window):
    """Step k at anchor t == what a serving engine computes: prefill keys 0..t, then k appended steps (a
    sliding-window draft's window over the cache's positions)."""
    tiny_draft = fixed_init(Eagle3Draft(**tiny_kwargs(num_layers=num_layers, sliding_window=window)))
    ids, aux, _, _, _ = _batch(b=1, t=8)
    pos = torch.arange(8)[None]
    steps = 3
    with torch.no_grad():
        outs = rollout(tiny_draft, ids, aux, pos, steps=steps)
        fused = tiny_draft.fuse(aux)
        for t in range(8 - steps):
            cache = KVCache()
            # prefill: position j carries token x_{j+1} and the verifier state at j
            o = tiny_draft(ids[:, 1:t + 2], fused[:, :t + 1], pos[:, :t + 1], cache=cache)
            torch.testing.assert_close(o.hidden_states[:, -1], outs[0][:, t], atol=1e-5, rtol=1e-5)
            h = o.hidden_states[:, -1:]
            for k in range(1, steps):  # teacher-forced token x_{t+k+1}, own hidden, position t+k
                o = tiny_draft(ids[:, t + k + 1:t + k + 2], h, pos[:, t:t + 1] + k, cache=cache)
                torch.testing.assert_close(o.hidden_states[:, 0], outs[k][:, t], atol=1e-5, rtol=1e-5)
                h = o.hidden_states


@pytest.mark.parametrize("num_layers", [1, 2])
def test_packed_documents_equal_separate_documents(num_layers):
    tiny_draft = fixed_init(Eagle3Draft(**tiny_kwargs(num_layers=num_layers)))
    ids, aux, last, mask, head = _batch(b=1, t=11, seed=4)
    doc = torch.tensor([[0] * 6 + [1] * 5])
    packed = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                      target_head=head, document_ids=doc, steps=3, decay=0.7)
    separate = [ttt_step(tiny_draft, input_ids=ids[:, s], aux_hidden_states=aux[:, s], last_hidden_state=last[:, s],
                         loss_mask=mask[:, s], target_head=head, steps=3, decay=0.7)
                for s in (slice(0, 6), slice(6, 11))]
    for key in ("count", "correct", "cond_correct", "cond_count"):
        assert torch.equal(packed.metrics[key], separate[0].metrics[key] + separate[1].metrics[key]), key
    torch.testing.assert_close(packed.loss_sums, separate[0].loss_sums + separate[1].loss_sums)


def _sdpa_vs_flex(device, window=None):
    kw = tiny_kwargs(sliding_window=window)
    ids, aux, last, mask, head = (x.to(device) if torch.is_tensor(x) else x for x in _batch(b=2, t=9, seed=5))
    head_w = head(torch.eye(HIDDEN)).T.to(device)  # the same linear head, on the device
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9], device=device)
    backward = device != "cpu"  # torch has no flex-attention backward on CPU
    results = []
    for attention in ("sdpa", "flex"):
        draft = fixed_init(Eagle3Draft(**kw)).to(device)
        with torch.set_grad_enabled(backward):
            out = ttt_step(draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                           target_head=lambda h, w=head_w: h @ w.T, document_ids=doc, steps=3, decay=0.8,
                           attention=attention)
        if backward:
            out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], atol=1e-4, rtol=1e-5)
    assert ga.keys() == gb.keys() and (len(ga) > 0) == backward
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
def test_sdpa_and_flex_agree_forward_cpu():
    """Forward only: torch's flex-attention raises NotImplementedError for backward on CPU."""
    _sdpa_vs_flex("cpu")
    _sdpa_vs_flex("cpu", window=3)
    ids, aux, _, mask, head = _batch(b=1, t=4)
    with pytest.raises(ValueError, match="no backward on CPU"):
        ttt_step(fixed_init(Eagle3Draft(**tiny_kwargs())), input_ids=ids, aux_hidden_states=aux, target_logits=head(
            torch.zeros(1, 4, HIDDEN)), loss_mask=mask, attention="flex")


@pytest.mark.gpu
@pytest.mark.skipif(not (flex_available() and torch.cuda.is_available()), reason="needs CUDA and flex_attention")
def test_sdpa_and_flex_agree_forward_and_backward_cuda():
    _sdpa_vs_flex("cuda")


# ------------------------------------------------------------------------------------------------ loss


def reference_loss(draft, ids, aux, last, mask, head, steps, decay):
    """Unchunked loss written from the definition with per-position loops (no documents)."""
    b, t = ids.shape
    outs = rollout(draft, ids, aux, torch.arange(t)[None].expand(b, t), steps=steps)
    target = head(last).float()  # (B, T, V) all at once
    cols = torch.arange(DRAFT_VOCAB) + draft.d2t
    total = 0.0
    for k in range(steps):
        logq = F.log_softmax(draft.compute_logits(outs[k]).float(), dim=-1)  # (B, T, Vd)
        s, n = 0.0, 0
        for bi in range(b):
            for a in range(t):
                if a + k + 2 < t and mask[bi, a + k + 2]:
                    p = F.softmax(target[bi, a + k + 1, cols], dim=-1)
                    s = s + (p * (p.log() - logq[bi, a])).sum()
                    n += 1
        total = total + decay**k * s / max(n, 1)
    return total


@pytest.mark.parametrize(("chunk_size", "checkpoint"), [(3, True), (4, False), (1000, True)])
def test_chunked_loss_equals_reference_and_same_grads(chunk_size, checkpoint):
    kw = tiny_kwargs()
    ids, aux, last, mask, head = _batch(b=2, t=10, seed=1)
    d1, d2 = fixed_init(Eagle3Draft(**kw)), fixed_init(Eagle3Draft(**kw))
    out = ttt_step(d1, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                   target_head=head, steps=3, decay=0.6, chunk_size=chunk_size, checkpoint=checkpoint)
    ref = reference_loss(d2, ids, aux, last, mask, head, steps=3, decay=0.6)
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref.backward()
    for (n, p1), (_, p2) in zip(d1.named_parameters(), d2.named_parameters(), strict=True):
        if p1.requires_grad:
            torch.testing.assert_close(p1.grad, p2.grad, atol=1e-6, rtol=1e-4, msg=n)
    assert d1.embed_tokens.weight.grad is None  # frozen


def test_target_logits_path_equals_target_head_path(tiny_draft):
    ids, aux, last, mask, head = _batch(seed=2)
    a = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                 target_head=head, steps=2)
    b = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, target_logits=head(last), loss_mask=mask,
                 steps=2)
    torch.testing.assert_close(a.loss, b.loss)
    with pytest.raises(ValueError):
        ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, loss_mask=mask, steps=2)


def test_topk_targets_with_every_token_equal_the_full_logits(tiny_draft):
    ids, aux, last, mask, head = _batch(seed=4)
    logits = head(last)
    values, indices = logits.topk(VOCAB, dim=-1)
    a = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, target_logits=logits, loss_mask=mask, steps=3)
    b = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, target_topk_ids=indices,
                 target_topk_logits=values, loss_mask=mask, steps=3)
    torch.testing.assert_close(b.loss, a.loss)
    for k in a.metrics:
        torch.testing.assert_close(b.metrics[k], a.metrics[k])


def test_topk_targets_renormalize_on_the_draft_tokens_they_hold(tiny_draft):
    """Row 0: its top-3 holds two draft tokens -> their renormalized probabilities; the argmax (a non-draft
    token) stays the full-vocab argmax. Row 1: no draft token in its top-3 -> no distribution (all -inf)."""
    from tiny_speculators.models.losses import DenseTargets, TopKTargets

    draft_cols = torch.arange(DRAFT_VOCAB) + tiny_draft.d2t
    outside = sorted(set(range(VOCAB)) - set(draft_cols.tolist()))
    d0, d1 = draft_cols[3].item(), draft_cols[7].item()
    ids = torch.tensor([[outside[0], d0, d1], [outside[1], outside[2], outside[3]]])
    logits = torch.tensor([[5.0, 2.0, 1.0], [4.0, 3.0, 2.0]])
    argmax, logp = TopKTargets(ids, logits, VOCAB).chunk(0, 2, draft_cols)
    assert argmax.tolist() == [outside[0], outside[1]]
    expected = torch.full((DRAFT_VOCAB,), float("-inf"))
    expected[[3, 7]] = torch.log_softmax(torch.tensor([2.0, 1.0]), dim=0)
    torch.testing.assert_close(logp[0], expected)
    assert torch.isneginf(logp[1]).all()
    # the dense path on the same row, with -inf outside the top-3, agrees
    dense = torch.full((1, VOCAB), float("-inf"))
    dense[0, ids[0]] = logits[0]
    _, dense_logp = DenseTargets(dense).chunk(0, 1, draft_cols)
    torch.testing.assert_close(dense_logp[0], expected)


def test_topk_row_without_draft_tokens_adds_no_loss_but_counts(tiny_draft):
    ids, aux, _, mask, _ = _batch(b=1, t=8, seed=5)
    draft_cols = torch.arange(DRAFT_VOCAB) + tiny_draft.d2t
    outside = torch.tensor(sorted(set(range(VOCAB)) - set(draft_cols.tolist())))
    topk_ids = outside[:4].expand(1, 8, 4)  # never a draft token
    out = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, target_topk_ids=topk_ids,
                   target_topk_logits=torch.randn(1, 8, 4), loss_mask=torch.ones_like(mask), steps=2)
    assert out.loss.item() == 0.0 and out.metrics["count"].sum() > 0
    assert out.metrics["correct"].sum() == 0  # the verifier's argmax is never a draft token
    out.loss.backward()  # still a graph (zero gradients)


def test_loss_normalizer_makes_micro_batches_sum_to_full_batch(tiny_draft):
    ids, aux, last, mask, head = _batch(b=4, t=8, seed=6)
    kwargs = dict(target_head=head, steps=3, decay=0.5)
    full = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                    **kwargs)
    halves = [ttt_step(tiny_draft, input_ids=ids[s], aux_hidden_states=aux[s], last_hidden_state=last[s],
                       loss_mask=mask[s], loss_normalizer=full.metrics["count"], **kwargs)
              for s in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(halves[0].loss + halves[1].loss, full.loss)


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_on_hand_made_logits():
    """Draft logits are all zero (norm weight 0) -> it always predicts draft id 0 = target id d2t[0]."""
    draft = fixed_init(Eagle3Draft(**tiny_kwargs()))
    with torch.no_grad():
        draft.norm.weight.zero_()
    guess = int(draft.to_target_ids(torch.tensor(0)))  # target id the draft always predicts
    outside = int(torch.nonzero(~draft.t2d)[0])  # a target id the draft vocab lacks
    other = int(draft.to_target_ids(torch.tensor(5)))
    t = 8
    ids = torch.zeros(1, t, dtype=torch.long)
    aux = torch.zeros(1, t, 3 * HIDDEN)
    target = torch.zeros(1, t, VOCAB)
    # row r is the target of step k at anchor r - k - 1
    winners = {1: guess, 2: guess, 3: outside, 4: guess, 5: other, 6: guess, 7: guess}
    for r, w in winners.items():
        target[0, r, w] = 5.0
        target[0, r, guess] = max(target[0, r, guess].item(), 4.0)  # guess is the best inside the draft vocab
    mask = torch.ones(1, t, dtype=torch.long)
    out = ttt_step(draft, input_ids=ids, aux_hidden_states=aux, target_logits=target, loss_mask=mask, steps=3)
    m = out.metrics
    # step k has anchors 0 .. t-k-3; anchor a, step k reads row a + k + 1
    correct = {k: [winners[a + k + 1] == guess for a in range(t - k - 2)] for k in range(3)}
    assert m["count"].tolist() == [6, 5, 4]
    assert m["correct"].tolist() == [sum(c) for c in correct.values()] == [4, 3, 2]  # row 3 (outside) is wrong
    chain = [True] * 6
    cond_counts, cond_correct = [], []
    for k in range(3):
        base = [chain[a] for a in range(t - k - 2)]
        cond_counts.append(sum(base))
        chain = [base[a] and correct[k][a] for a in range(t - k - 2)]
        cond_correct.append(sum(chain))
    assert m["cond_count"].tolist() == cond_counts == [6, 3, 1]
    assert m["cond_correct"].tolist() == cond_correct == [4, 1, 0]
    # uniform draft: KL(p || uniform) = sum p log p + log Vd
    p = F.softmax(target[0, 1, torch.arange(DRAFT_VOCAB) + draft.d2t], dim=-1)
    kl_row1 = (p * p.log()).sum() + math.log(DRAFT_VOCAB)
    s = summarize_metrics(m)
    assert s["acc_0"] == pytest.approx(4 / 6) and s["cond_acc_1"] == pytest.approx(1 / 3)
    assert s["acceptance_length"] == pytest.approx(1 + 4 / 6 + (4 / 6) * (1 / 3))
    assert s["cond_acc_2"] == 0.0
    assert m["loss_sum"][0] >= kl_row1 - 1e-5  # row 1 is one of step 0's rows; KL terms are >= 0


def test_kl_is_zero_when_draft_matches_target(tiny_draft):
    ids, aux, _, mask, _ = _batch(b=1, t=7, seed=8)
    outs = rollout(tiny_draft, ids, aux, torch.arange(7)[None], steps=1)
    draft_logits = tiny_draft.compute_logits(outs[0]).detach()  # (1, T, Vd)
    target = torch.full((1, 7, VOCAB), -1e4)
    cols = torch.arange(DRAFT_VOCAB) + tiny_draft.d2t
    target[0, 1:, cols] = draft_logits[0, :-1]  # row a + 1 holds anchor a's draft distribution
    out = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, target_logits=target, loss_mask=mask, steps=1)
    assert out.metrics["count"][0] > 0
    assert abs(out.loss.item()) < 1e-5
    assert out.metrics["correct"][0] == out.metrics["count"][0]


def test_summarize_metrics_sums_aggregate():
    m = {"loss_sum": torch.tensor([2.0, 3.0]), "count": torch.tensor([4, 3]), "correct": torch.tensor([2, 1]),
         "cond_correct": torch.tensor([2, 1]), "cond_count": torch.tensor([4, 2])}
    s = summarize_metrics(m, decay=0.5)
    assert s["loss_0"] == 0.5 and s["loss_1"] == 1.0 and s["loss"] == 0.5 + 0.5 * 1.0
    assert s["acc_1"] == pytest.approx(1 / 3) and s["cond_acc_1"] == 0.5
    assert s["acceptance_length"] == pytest.approx(1 + 0.5 + 0.25) and s["tokens"] == 4


def test_batch_without_valid_targets_still_backpropagates_zero_grads(tiny_draft):
    ids, aux, last, _, head = _batch(b=1, t=6, seed=9)
    out = ttt_step(tiny_draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last,
                   loss_mask=torch.zeros(1, 6, dtype=torch.long), target_head=head, steps=3)
    assert out.metrics["count"].tolist() == [0, 0, 0] and out.loss.item() == 0.0
    out.loss.backward()
    for n, p in tiny_draft.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and not p.grad.any(), n
