"""models/losses.py: every loss term, their weighted combinations, LK, D-PACE and the aligned mask, chunked,
against a direct unchunked reference written from the definitions (full softmaxes, explicit loops), on dense and
top-k verifier targets: same loss, same gradients, whatever the chunk size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from draft_fixtures import DRAFT_VOCAB, HIDDEN, VOCAB, fixed_init, tiny_kwargs

from tiny_speculators.models.eagle3.model import Eagle3Draft
from tiny_speculators.models.losses import LOGP_FLOOR, DenseTargets, LossSpec, TopKTargets, chunked_step_losses

K, N = 3, 14


def _case(seed: int, topk: int | None):
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(N, HIDDEN, generator=g) for _ in range(K)]
    valid = torch.rand(K, N, generator=g) < 0.8
    for k in range(K):
        valid[k, N - k - 1:] = False  # target row n + k + 1 must exist
    logits = 3 * torch.randn(N, VOCAB, generator=g)
    if topk is None:
        return hidden, valid, logits, DenseTargets(logits)
    values, ids = logits.topk(topk, dim=-1)
    return hidden, valid, logits, TopKTargets(ids, values, VOCAB)


def _reference_p(draft, logits: torch.Tensor, topk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``p [N, Vd]`` on the draft vocab (zeros where the verifier stored no mass) and the argmax as a draft id."""
    cols = torch.arange(DRAFT_VOCAB) + draft.d2t
    full = logits.clone()
    if topk is not None:
        keep = torch.zeros_like(full, dtype=torch.bool).scatter(1, full.topk(topk, dim=-1).indices, True)
        full = full.masked_fill(~keep, float("-inf"))
    restricted = full[:, cols]
    mass = torch.isfinite(restricted).any(dim=1, keepdim=True)
    p = torch.where(mass, F.softmax(restricted.masked_fill(~mass, 0.0), dim=-1), torch.zeros_like(restricted))
    p = p.masked_fill(~torch.isfinite(restricted), 0.0)
    target_of = {int(t): i for i, t in enumerate(cols)}
    argmax = torch.tensor([target_of.get(int(a), -1) for a in logits.argmax(dim=-1)])
    return p, argmax


def _terms(p: torch.Tensor, q: torch.Tensor, tid: int) -> dict[str, torch.Tensor]:
    """Each loss of one row, from its definition (p: verifier, q: draft, both [Vd])."""
    has = bool((p > 0).any())
    support = p > 0
    zero = q.sum() * 0
    kl = (p[support] * (p[support].log() - q[support].log())).sum() if has else zero
    logp = torch.where(support, p.clamp(min=1e-45).log(), torch.full_like(p, -math.inf)).clamp(min=LOGP_FLOOR)
    rkl = (q * (q.log() - logp)).sum() if has else zero
    m = (p + q) / 2
    jsd = 0.5 * (p[support] * (p[support] / m[support]).log()).sum() + 0.5 * (q * (q / m).log()).sum() if has \
        else zero
    tv = 0.5 * (p - q).abs().sum() if has else zero
    ce = -q[tid].log() if tid >= 0 else zero
    return {"kl": kl, "rkl": rkl, "jsd": jsd, "tv": tv, "ce": ce, "has": torch.tensor(has)}


def reference(draft, hidden, valid, logits, topk, spec: LossSpec, decay: float) -> torch.Tensor:
    p_all, argmax = _reference_p(draft, logits, topk)
    per: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for k in range(K):
        for a in range(N):
            if valid[k, a]:
                q = F.softmax(draft.compute_logits(hidden[k][a][None]).float()[0], dim=-1)
                per[a, k] = _terms(p_all[a + k + 1], q, int(argmax[a + k + 1]))
                per[a, k]["right"] = bool(draft.to_target_ids(q.argmax()) == logits[a + k + 1].argmax())
    lam = {}
    for k in range(K):
        alphas = [1 - per[a, k]["tv"].detach() for a in range(N) if (a, k) in per and per[a, k]["has"]]
        lam[k] = math.exp(-3 * float(sum(alphas) / len(alphas))) if alphas else 1.0
    total = torch.zeros(())
    for k in range(K):
        count = int(valid[k].sum())
        for a in range(N):
            if (a, k) not in per:
                continue
            row = per[a, k]
            value = sum(w * (lam[k] * row["kl"] + (1 - lam[k]) * row["tv"] if name == "lk" else row[name])
                        for name, w in spec.terms)
            if spec.position_weights == "decay":
                weight = decay**k
            elif spec.position_weights == "aligned":  # decoding reaches step k only if every earlier step was right
                weight = decay**k if all(per[a, i]["right"] for i in range(k) if (a, i) in per) else 0.0
            else:  # D-PACE along the anchor's chain: sum_{j>=k} prod_{i<=j} smoothed q_i, over valid steps
                smooth = {i: (1 - spec.dpace_alpha) * math.exp(-per[a, i]["ce"].item()) + spec.dpace_alpha
                          for i in range(K) if (a, i) in per}
                weight = sum(math.prod(smooth[i] for i in smooth if i <= j) for j in smooth if j >= k)
            total = total + weight * value / count
    return total


SPECS = [{"kl": 1.0}, {"rkl": 1.0}, {"jsd": 1.0}, {"tv": 1.0}, {"ce": 1.0}, {"lk": 1.0}, {"ce": 0.1, "tv": 0.9},
         {"kl": 0.5, "lk": 0.5, "jsd": 0.2}]


@pytest.mark.parametrize("topk", [None, 4, 2])
@pytest.mark.parametrize("terms", SPECS, ids=lambda t: "+".join(t))
@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_chunked_losses_equal_the_direct_reference(terms, topk, weights):
    spec = LossSpec.from_mapping(terms, position_weights=weights, dpace_alpha=0.3)
    d1 = fixed_init(Eagle3Draft(**tiny_kwargs()))
    hidden, valid, logits, targets = _case(seed=len(terms) + (topk or 0), topk=topk)
    _, loss = _assert_equals_reference(d1, hidden, valid, logits, targets, topk, spec)
    assert loss.item() > 0


def _assert_equals_reference(d1, hidden, valid, logits, targets, topk, spec):
    """The chunked loss of draft ``d1`` equals :func:`reference` on an identical draft, and so do the gradients of
    lm_head and of the hidden states. Returns (the chunked output, its normalized loss)."""
    d2 = fixed_init(Eagle3Draft(**tiny_kwargs()))
    h1 = [h.clone().requires_grad_() for h in hidden]
    h2 = [h.clone().requires_grad_() for h in hidden]
    out = chunked_step_losses(d1, h1, valid, targets, spec, decay=0.7, chunk_size=5, checkpoint=True)
    loss = (out.weighted / valid.sum(dim=1).clamp(min=1)).sum()
    ref = reference(d2, h2, valid, logits, topk, spec, decay=0.7)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(d1.lm_head.weight.grad, d2.lm_head.weight.grad, atol=1e-6, rtol=1e-4)
    for a, b in zip(h1, h2, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
    return out, loss


def _plant_draft_guesses(draft, hidden, valid, logits, seed: int) -> torch.Tensor:
    """The verifier's logits with the draft's own argmax made the verifier's at about half the targets, so that
    chains continue past step 0 and the aligned mask both keeps and drops later steps."""
    g = torch.Generator().manual_seed(seed)
    logits = logits.clone()
    with torch.no_grad():
        for k in range(K):
            guess = draft.to_target_ids(draft.compute_logits(hidden[k]).argmax(dim=-1))
            for a in range(N):
                if valid[k, a] and torch.rand((), generator=g) < 0.6:
                    logits[a + k + 1, guess[a]] = logits[a + k + 1].max() + 2.0
    return logits


@pytest.mark.parametrize("topk", [None, 4])
@pytest.mark.parametrize("terms", [{"kl": 1.0}, {"lk": 1.0}, {"ce": 0.1, "tv": 0.9}], ids=lambda t: "+".join(t))
def test_aligned_weights_drop_the_steps_after_a_miss_like_the_direct_reference(terms, topk):
    spec = LossSpec.from_mapping(terms, position_weights="aligned")
    d1 = fixed_init(Eagle3Draft(**tiny_kwargs()))
    hidden, valid, logits, _ = _case(seed=3, topk=None)
    logits = _plant_draft_guesses(d1, hidden, valid, logits, seed=4)
    values, ids = logits.topk(topk or 1, dim=-1)
    targets = DenseTargets(logits) if topk is None else TopKTargets(ids, values, VOCAB)
    out, _ = _assert_equals_reference(d1, hidden, valid, logits, targets, topk, spec)
    reached = torch.cumprod(out.correct | ~valid, dim=0)  # the mask is not trivial: later steps kept and dropped
    assert bool((valid[1] & reached[0]).any()) and bool((valid[1] & ~reached[0]).any())
    unmasked = chunked_step_losses(d1, hidden, valid, targets, LossSpec.from_mapping(terms), decay=0.7)
    assert float(out.weighted[1].detach()) < float(unmasked.weighted[1].detach())
    torch.testing.assert_close(out.weighted[0], unmasked.weighted[0])  # the first step is always reached


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_chunk_size_does_not_change_loss_or_metrics(chunk_size):
    spec = LossSpec.from_mapping({"lk": 1.0, "ce": 0.2}, position_weights="dpace")
    draft = fixed_init(Eagle3Draft(**tiny_kwargs()))
    hidden, valid, _, targets = _case(seed=9, topk=3)
    a = chunked_step_losses(draft, hidden, valid, targets, spec, chunk_size=chunk_size, checkpoint=False)
    b = chunked_step_losses(draft, hidden, valid, targets, spec, chunk_size=N, checkpoint=False)
    torch.testing.assert_close(a.weighted, b.weighted)
    torch.testing.assert_close(a.sums, b.sums)
    assert torch.equal(a.correct, b.correct)


def test_default_spec_is_forward_kl_with_decay():
    spec = LossSpec().resolved("kl")
    assert spec.terms == (("kl", 1.0),) and spec.position_weights == "decay"
    assert LossSpec().resolved("ce").terms == (("ce", 1.0),)
    assert LossSpec.from_mapping({"tv": 1.0}).resolved("kl").terms == (("tv", 1.0),)


@pytest.mark.parametrize(("terms", "match"), [({"hinge": 1.0}, "unknown loss hinge"), ({"kl": -1.0}, "weights"),
                                              ({"kl": 0.0}, "weights"), ({"kl": float("nan")}, "weights")])
def test_bad_specs_name_the_problem(terms, match):
    with pytest.raises(ValueError, match=match):
        LossSpec.from_mapping(terms)
    with pytest.raises(ValueError, match="dpace_alpha"):
        LossSpec.from_mapping({"kl": 1.0}, position_weights="dpace", dpace_alpha=2.0)


@pytest.mark.parametrize("topk", [1, 2, 6])
def test_sparse_topk_columns_equal_the_dense_ones(topk):
    """Top-k targets with only kl / ce terms take the sparse path (k tokens per row, no [c, Vd] target tensor): the
    same values and gradients as the dense renormalized distribution, rows without a draft token included."""
    from tiny_speculators.models.losses import SparseLogp, draft_index, has_mass, row_columns

    g = torch.Generator().manual_seed(topk)
    draft = fixed_init(Eagle3Draft(**tiny_kwargs()))
    cols = torch.arange(DRAFT_VOCAB) + draft.d2t
    logits = 3 * torch.randn(N, VOCAB, generator=g)
    values, ids = logits.topk(topk, dim=-1)
    ids[0] = torch.tensor([i for i in range(VOCAB) if i not in set(cols.tolist())][:topk])  # no draft token
    targets = TopKTargets(ids, values, VOCAB)
    argmax_d, dense = targets.chunk(0, N, cols)
    argmax_s, sparse = targets.chunk(0, N, cols, sparse=True)
    assert isinstance(sparse, SparseLogp) and sparse.ids.shape == (N, topk)
    assert torch.equal(argmax_d, argmax_s) and torch.equal(has_mass(dense), has_mass(sparse))
    assert not has_mass(sparse)[0]
    tid = draft_index(cols, VOCAB)[argmax_d]
    x = torch.randn(N, DRAFT_VOCAB, generator=g)
    xd, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = row_columns(F.log_softmax(xd, -1), dense, tid, ("kl", "ce"))
    b = row_columns(F.log_softmax(xs, -1), sparse, tid, ("kl", "ce"))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    (a * torch.tensor([1.0, 0.3])).sum().backward()
    (b * torch.tensor([1.0, 0.3])).sum().backward()
    torch.testing.assert_close(xd.grad, xs.grad, atol=1e-7, rtol=1e-5)
    with pytest.raises(ValueError, match="dense"):
        row_columns(F.log_softmax(x, -1), sparse, tid, ("tv",))
