"""DSpark: the heads pinned to their equations by a float64 reference (over dflash_fixtures' reference backbone) and
fixed numbers, the CE + TV + BCE objective recomputed block by block with the inference forward, the warm start from
DFlash, the confidence cut, the proposer against a plain-loop chain, and importing a speculators-written checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dflash_fixtures import MASK, WIDTH, dflash_batch, reference_hidden, speculators_dflash_checkpoint, tiny_dflash
from draft_fixtures import DRAFT_VOCAB, VOCAB, fixed_init, tiny_kwargs

from tiny_speculators.errors import UserError
from tiny_speculators.models.dspark.family import DSparkOptions, from_dflash
from tiny_speculators.models.dspark.model import DSparkDraft
from tiny_speculators.models.dspark.objective import DSparkObjective
from tiny_speculators.models.dspark.proposer import DSparkProposer, cut_length
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.sampling import SamplingParams

RANK = 6


def tiny_dspark(block_size: int = 4, kind: str = "vanilla", sample_from_anchor: bool = True, **kw) -> DSparkDraft:
    return fixed_init(DSparkDraft(**tiny_kwargs(num_aux=5), num_layers=2, block_size=block_size, mask_token_id=MASK,
                                  markov_rank=RANK, markov_head_type=kind, sample_from_anchor=sample_from_anchor,
                                  **kw))


def reference_heads(draft: DSparkDraft, normed: torch.Tensor, prev: list[int]):
    """float64: logits = normed lm_head^T + bias(prev), confidence = sigmoid(proj([normed | w1[prev]]))."""
    sd = {k: v.double() for k, v in draft.state_dict().items()}
    e = sd["markov_head.markov_w1.weight"][torch.tensor(prev)]  # (n, r)
    if draft.kwargs["markov_head_type"] == "gated":
        gate = torch.sigmoid(torch.cat([normed, e], -1) @ sd["markov_head.gate_proj.weight"].T
                             + sd["markov_head.gate_proj.bias"])
        e_in = gate * e
    else:
        e_in = e
    logits = normed @ sd["lm_head.weight"].T + e_in @ sd["markov_head.markov_w2.weight"].T
    feats = torch.cat([normed, e], -1) if draft.kwargs["confidence_head_with_markov"] else normed
    conf = torch.sigmoid(feats @ sd["confidence_head.proj.weight"].T + sd["confidence_head.proj.bias"])[:, 0]
    return logits, conf


def _ours(draft, aux, ctx_pos, block_ids, block_pos, prev):
    ctx = draft.context(aux[None], ctx_pos[None])
    h = draft(block_ids[None], block_pos[None], ctx, None, block_size=block_ids.numel())
    logits, conf = draft.heads(h[0], torch.tensor(prev))
    return logits, torch.sigmoid(conf)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_heads_match_their_equations(kind):
    draft = tiny_dspark(block_size=5, kind=kind)
    aux = torch.randn(7, WIDTH, generator=torch.Generator().manual_seed(0))
    block, prev = torch.tensor([11, MASK, MASK, MASK, MASK]), [11, 4, 30, 2, 9]
    with torch.no_grad():
        logits, conf = _ours(draft, aux, torch.arange(7), block, torch.arange(7, 12), prev)
        ref_logits, ref_conf = reference_heads(draft, reference_hidden(draft, aux, torch.arange(7), block,
                                                                       torch.arange(7, 12)), prev)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conf.double(), ref_conf, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # negative control: the previous token moves the logits and the confidence
        other_logits, other_conf = _ours(draft, aux, torch.arange(7), block, torch.arange(7, 12), [12, 4, 30, 2, 9])
    assert (other_logits[0] - logits[0]).abs().max() > 1e-3 and abs(float(other_conf[0] - conf[0])) > 1e-5
    assert torch.equal(other_logits[1:], logits[1:])


def test_forward_fixed_numbers():
    """Fixed-init draft, fixed inputs: pinned logits and confidences (catches silent changes to the computation)."""
    draft = tiny_dspark(block_size=4)
    aux = torch.sin(torch.arange(5 * WIDTH, dtype=torch.float32) * 0.37).view(5, WIDTH)
    with torch.no_grad():
        logits, conf = _ours(draft, aux, torch.arange(5), torch.tensor([9, MASK, MASK, MASK]), torch.arange(5, 9),
                             [9, 1, 2, 3])
    assert logits.shape == (4, DRAFT_VOCAB) and conf.shape == (4,)
    torch.testing.assert_close(logits[:, :3], torch.tensor(EXPECTED_LOGITS), atol=1e-4, rtol=0)
    torch.testing.assert_close(conf, torch.tensor(EXPECTED_CONF), atol=1e-5, rtol=0)


# pinned on CPU fp32 after test_heads_match_their_equations agreed with the float64 reference
EXPECTED_LOGITS = [[0.9671, -0.6128, 0.1694], [0.7627, -0.9825, 1.1026], [0.984, -1.1638, 1.1963],
                   [0.7567, -0.9083, 0.9798]]
EXPECTED_CONF = [0.90009, 0.72827, 0.74545, 0.72297]


def _verifier_logp(head, last, draft):
    """Verifier log-probs on the draft vocabulary (renormalized there) and its argmax as a draft id (-1 outside)."""
    full = head(last).double()
    cols = torch.arange(DRAFT_VOCAB) + draft.d2t
    index = torch.full((VOCAB,), -1)
    index[cols] = torch.arange(DRAFT_VOCAB)
    return torch.log_softmax(full[:, cols], -1), index[full.argmax(-1)]


def _prediction_logits(draft, ids, aux, a, first, j):
    block = torch.tensor([int(ids[0, a]), MASK, MASK, MASK])
    hid = reference_hidden(draft, aux[0, :a], torch.arange(a), block, torch.arange(a, a + 4))
    return reference_heads(draft, hid[first + j:first + j + 1], [int(ids[0, a + j])])


@pytest.mark.parametrize("weights", ["decay", "aligned"])
@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_loss_is_ce_tv_bce_per_valid_prediction(sample_from_anchor, weights):
    """loss = sum_j exp(-j/gamma) (0.1 CE + 0.9 TV + BCE(c, 1 - TV)) / #valid predictions, every block recomputed
    with the inference forward (context = positions before the anchor, block [x_a, mask...] at a's positions);
    ``aligned``: prediction j counts only when the draft's argmax was the verifier's at every prediction before it."""
    draft = tiny_dspark(block_size=4, sample_from_anchor=sample_from_anchor)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    obj = DSparkObjective(draft, head, anchors=100, gamma=2.0, loss=LossSpec(position_weights=weights)).eval()
    ids, aux, mask, _ = dflash_batch(b=1, t=11)
    mask[0, 8] = 0  # a gap: predictions past it do not count (contiguous prefix)
    last = torch.eye(16)[None, :11]  # row r's verifier logits are head.weight[:, r]
    n_pred, first = (4, 0) if sample_from_anchor else (3, 1)
    with torch.no_grad():  # the verifier takes the draft's guesses at predictions 0-1 of anchors 3 and 4
        for a in (3, 4):
            for j in (0, 1):
                guess = int(_prediction_logits(draft, ids, aux, a, first, j)[0].argmax())
                head.weight[guess + draft.d2t[guess], a + j] = head.weight[:, a + j].max() + 2.0
    batch = {"input_ids": ids, "aux_hidden_states": aux, "loss_mask": mask, "last_hidden_state": last}
    with torch.no_grad():
        out = obj(batch)
        logp, target = _verifier_logp(head, last[0], draft)
        total, count, kept, later = 0.0, 0, 0, 0
        for a in range(3, 11):
            if not (mask[0, a] and a + 1 < 11 and mask[0, a + 1]):
                continue
            reached = True
            for j in range(n_pred):
                t = a + j + 1
                if t >= 11 or not bool(mask[0, a + 1:t + 1].all()):
                    break
                logits, conf = _prediction_logits(draft, ids, aux, a, first, j)
                logq = torch.log_softmax(logits[0], -1)
                tid = int(target[t - 1])
                ce = -float(logq[tid]) if tid >= 0 else 0.0
                tv = 0.5 * float((logq.exp() - logp[t - 1].exp()).abs().sum())
                c = float(conf[0])
                bce = -((1 - tv) * math.log(c) + tv * math.log(1 - c))
                if reached or weights == "decay":
                    total += math.exp(-j / 2.0) * (0.1 * ce + 0.9 * tv + bce)
                    kept += j > 0
                count += 1
                later += j > 0
                reached = reached and tid >= 0 and int(logq.argmax()) == tid
    assert int(out.metrics["count"].sum()) == count >= 10
    assert out.loss.item() == pytest.approx(total / count, rel=1e-4)
    if weights == "aligned":  # later predictions both kept (the planted chains) and dropped
        assert 0 < kept < later


def test_training_step_reaches_every_head():
    draft = tiny_dspark(block_size=4, kind="gated")
    head = torch.nn.Linear(16, VOCAB, bias=False)
    obj = DSparkObjective(draft, head, anchors=3, gamma=4.0)
    ids, aux, mask, doc = dflash_batch(t=30, packed=True)
    batch = {"input_ids": ids, "aux_hidden_states": aux, "loss_mask": mask, "document_ids": doc,
             "last_hidden_state": torch.randn(2, 30, 16)}
    torch.manual_seed(0)
    counts = obj.loss_counts(batch)
    out = obj(batch, counts.float())
    assert counts.shape == (4,) and torch.equal(out.metrics["count"], counts)
    out.loss.backward()
    for name in ("fc.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "markov_head.gate_proj.weight", "confidence_head.proj.weight"):
        assert dict(draft.named_parameters())[name].grad.abs().sum() > 0, name
    assert draft.lm_head.weight.grad is None  # the verifier's head, frozen
    summary = obj.summarize({k: v.double() for k, v in out.metrics.items()})
    assert len(summary["acc"]) == 4 and 1.0 <= summary["expected_accept_len"] <= 5.0


def test_warm_start_from_dflash_keeps_its_weights_and_starts_as_dflash():
    dflash = tiny_dflash(num_layers=2, block_size=4)
    draft = from_dflash(dflash, DSparkOptions(block_size=4, markov_rank=RANK, sample_from_anchor=False))
    for key, value in dflash.state_dict().items():
        assert torch.equal(draft.state_dict()[key], value), key
    assert not draft.markov_head.markov_w2.weight.detach().any()  # zero bias: DFlash's logits at first
    aux = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ctx = dflash.context(aux[None], torch.arange(6)[None])
        h = dflash(torch.tensor([[9, MASK, MASK, MASK]]), torch.arange(6, 10)[None], ctx, block_size=4)
        logits, _ = draft.heads(h[0], torch.tensor([9, 1, 2, 3]))
    torch.testing.assert_close(logits, dflash.compute_logits(h[0]).float())
    with pytest.raises(UserError, match="warm-starts from a DFlash draft"):
        from_dflash(draft, DSparkOptions())


def test_cut_length_by_hand():
    assert cut_length([0.9, 0.8, 0.5, 0.9], None) == 4
    assert cut_length([0.9, 0.8, 0.5, 0.9], 0.7) == 2  # 0.9, 0.72, 0.36 < 0.7
    assert cut_length([0.9, 0.8, 0.5, 0.9], 0.33) == 3  # 0.36 >= 0.33 > 0.324
    assert cut_length([0.1, 0.9], 0.5) == 1  # at least one token is verified
    assert cut_length([1.0, 1.0], 1.0) == 2


def reference_chain(draft: DSparkDraft, aux, n_ctx: int, bonus: int, k: int):
    """Greedy chain of k tokens from the float64 reference: one block over all n_ctx context positions, then the
    heads left to right with the previous drafted token (target ids)."""
    slots = k if draft.sample_from_anchor else k + 1
    block = torch.tensor([bonus, *[MASK] * (slots - 1)])
    hid = reference_hidden(draft, aux[:n_ctx], torch.arange(n_ctx), block, torch.arange(n_ctx, n_ctx + slots))
    tokens, confs, prev = [], [], bonus
    for i in range(k):
        logits, conf = reference_heads(draft, hid[slots - k + i:slots - k + i + 1], [prev])
        prev = int(draft.to_target_ids(logits[0].argmax()[None])[0])
        tokens.append(prev)
        confs.append(float(conf[0]))
    return tokens, confs


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_proposer_matches_the_reference_chain_and_cuts_on_confidence(sample_from_anchor):
    draft = tiny_dspark(block_size=5, sample_from_anchor=sample_from_anchor).eval()
    ids, aux, _, _ = dflash_batch(b=1, t=14)
    ids, aux = ids[0], aux[0]
    prop = DSparkProposer(draft)
    prop.commit(ids[1:7].tolist(), aux[:6], 0)  # verified positions 0..5; bonus x_6 at position 6
    k = draft.max_tokens
    tokens, _ = prop.propose_chain(k, SamplingParams(), None)
    ref_tokens, ref_confs = reference_chain(draft, aux, 6, int(ids[6]), k)
    assert tokens == ref_tokens and prop.draft_forwards == 1
    assert prop.last_confidences == pytest.approx(ref_confs, abs=1e-5)
    # rollback to 2 verified slots, then a threshold that cuts the chain where the running product falls
    prop.commit(ids[7:9].tolist(), aux[6:8], 6)
    ref_tokens, ref_confs = reference_chain(draft, aux, 8, int(ids[8]), k)
    prop.confidence_threshold = (math.prod(ref_confs[:2]) + math.prod(ref_confs[:3])) / 2  # cuts after token 2
    tokens, _ = prop.propose_chain(k, SamplingParams(), None)
    assert tokens == ref_tokens[:2] and prop.last_confidences == pytest.approx(ref_confs[:2], abs=1e-5)
    prop.commit(ids[9:10].tolist(), aux[8:9], 8)
    with pytest.raises(UserError, match=f"proposes 1...{k} tokens per step, not k={k + 1}"):
        prop.propose_chain(k + 1, SamplingParams(), None)
    with pytest.raises(UserError, match="must be in \\[0, 1\\]"):
        prop.confidence_threshold = 1.5
    with pytest.raises(UserError, match="no confidence head"):
        DSparkProposer(tiny_dspark(enable_confidence_head=False, confidence_head_with_markov=False), 0.5)


def _speculators_dspark(folder, verifier_dir, rank=8, conf_in_extra=True, **top):
    """The layout speculators writes for a full-vocabulary DSpark draft: DFlash's (no embed_tokens / lm_head) plus
    ``markov_head.markov_w{1,2}`` and ``confidence_head.proj``."""
    from safetensors.torch import load_file, save_file

    speculators_dflash_checkpoint(folder, verifier_dir)
    w = load_file(str(folder / "model.safetensors"))
    vc = json.loads((verifier_dir / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    h, v = vc["hidden_size"], vc["vocab_size"]
    w["markov_head.markov_w1.weight"] = torch.randn(v, rank, generator=g) * 0.1
    w["markov_head.markov_w2.weight"] = torch.randn(v, rank, generator=g) * 0.1
    w["confidence_head.proj.weight"] = torch.randn(1, h + (rank if conf_in_extra else 0), generator=g) * 0.1
    w["confidence_head.proj.bias"] = torch.zeros(1)
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update({"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "sample_from_anchor": True,
                "markov_rank": rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": conf_in_extra, "draft_adapter_rank": 0, **top})
    cfg["speculators_config"] = {**cfg["speculators_config"], "algorithm": "dspark",
                                 "proposal_methods": [{"speculative_tokens": 8}]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return w


def test_import_a_speculators_written_dspark_checkpoint(tmp_path, tiny_llama_dir):
    from tiny_speculators.models.dspark.speculators import write
    from tiny_speculators.models.family import ExportInfo
    from tiny_speculators.models.importing import import_draft

    w = _speculators_dspark(tmp_path, tiny_llama_dir)
    draft, config = import_draft(tmp_path)
    assert config["model_type"] == "dspark" and config["speculative_tokens"] == 8
    assert type(draft) is DSparkDraft and draft.sample_from_anchor and draft.max_tokens == 8
    assert draft.kwargs["markov_rank"] == 8 and draft.kwargs["confidence_head_with_markov"] is True
    assert torch.equal(draft.markov_head.markov_w2.weight, w["markov_head.markov_w2.weight"])
    assert torch.equal(draft.confidence_head.proj.weight, w["confidence_head.proj.weight"])
    cfg, tensors = write(draft, ExportInfo(verifier_name=str(tiny_llama_dir), verifier_architectures=[],
                                           speculative_tokens=8, dtype=torch.float32))
    assert set(tensors) == set(w) and cfg["speculators_model_type"] == "dspark"
    assert cfg["architectures"] == ["DSparkSpeculator"] and cfg["speculators_config"]["algorithm"] == "dspark"
    assert {k: cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                "confidence_head_with_markov", "sample_from_anchor", "draft_adapter_rank")} == {
        "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "sample_from_anchor": True, "draft_adapter_rank": 0}


@pytest.mark.parametrize(("top", "message"), [
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not supported"),
    ({"draft_adapter_rank": 4}, "draft_adapter_rank 4 .* is not supported"),
    ({"markov_rank": 16}, "markov_rank is 16 but the weights hold 8"),
    ({"confidence_head_with_markov": False}, "confidence_head_with_markov is False but the weights hold True"),
])
def test_import_names_what_it_cannot_read(tmp_path, tiny_llama_dir, top, message):
    from tiny_speculators.models.importing import import_draft

    _speculators_dspark(tmp_path, tiny_llama_dir, **top)
    with pytest.raises(UserError, match=message):
        import_draft(tmp_path)
