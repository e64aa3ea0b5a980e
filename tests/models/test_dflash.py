"""DFlash: the forward pinned to vLLM's equations (KV injection, block mask, positions) by a float64 reference
and fixed numbers, training attention == inference attention, anchors and loss weights, the one-forward block
proposer, and importing a speculators-written checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from dflash_fixtures import MASK, WIDTH, dflash_batch, reference_forward, speculators_dflash_checkpoint, tiny_dflash
from draft_fixtures import DRAFT_VOCAB, VOCAB, fixed_init

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash.family import default_aux_layer_ids
from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.models.dflash.objective import (
    DFlashObjective,
    anchor_chunks,
    block_hidden,
    block_inputs,
    candidate_anchors,
    sample_anchors,
    slot_weights,
)
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.ttt import document_starts


def _ours(draft, aux, ctx_pos, block_ids, block_pos):
    ctx = draft.context(aux[None], ctx_pos[None])
    out = draft(block_ids[None], block_pos[None], ctx, None, block_size=block_ids.numel())
    return draft.compute_logits(out)[0]


@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_vllm_equations(causal):
    draft = tiny_dflash(num_layers=3, block_size=5, causal=causal)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(7, WIDTH, generator=g)
    block = torch.tensor([11, MASK, MASK, MASK, MASK])
    ctx_pos, block_pos = torch.arange(7), torch.arange(7, 12)
    with torch.no_grad():
        ours = _ours(draft, aux, ctx_pos, block, block_pos)
        ref = reference_forward(draft, aux, ctx_pos, block, block_pos)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
    # negative controls: the block's mask and the positions matter
    with torch.no_grad():
        other = fixed_init(DFlashDraft(**{**draft.kwargs, "causal": not causal}))
        shifted = _ours(draft, aux, ctx_pos, block, block_pos + 1)
    assert (_ours(other, aux, ctx_pos, block, block_pos) - ours).abs().max() > 1e-3
    assert (shifted - ours).abs().max() > 1e-3


def test_forward_fixed_numbers():
    """Fixed-init draft, fixed inputs: pinned output (catches silent changes to the computation)."""
    draft = tiny_dflash(num_layers=2, block_size=4)
    aux = torch.sin(torch.arange(5 * WIDTH, dtype=torch.float32) * 0.37).view(5, WIDTH)
    with torch.no_grad():
        logits = _ours(draft, aux, torch.arange(5), torch.tensor([9, MASK, MASK, MASK]), torch.arange(5, 9))
    assert logits.shape == (4, DRAFT_VOCAB)
    torch.testing.assert_close(logits[:, :3], torch.tensor(EXPECTED), atol=1e-4, rtol=0)


# pinned on CPU fp32 after test_forward_matches_vllm_equations agreed with the float64 reference
EXPECTED = [[0.859, -0.4205, -0.0648], [-0.5863, 0.0312, 0.5273], [-0.5902, 0.0362, 0.5218],
            [-0.5785, 0.0214, 0.5382]]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("anchor_chunk", [None, 1000, 3, "documents"])
def test_training_attention_equals_inference(packed, anchor_chunk, monkeypatch):
    """Each training block (anchor a) equals the inference forward of vLLM's DFlash proposer with the context
    = the verified positions of a's document before a, and the block [x_a, mask...] at a's positions: over the
    whole row's keys (None) and through ``block_hidden``, whose forwards see only the keys their blocks may (with
    "documents", a forward per document from the first anchor on: rows this short take one by default)."""
    from functools import partial

    from tiny_speculators.models.dflash import objective
    from tiny_speculators.models.ttt import positions_from_documents

    forwards = []
    if anchor_chunk == "documents":
        split = partial(objective.anchor_chunks, min_anchors=1, min_keys=0)
        monkeypatch.setattr(objective, "anchor_chunks", lambda *a: forwards.append(split(*a)) or forwards[-1])
        anchor_chunk = 1000

    draft = tiny_dflash(num_layers=2, block_size=4)
    ids, aux, mask, doc = dflash_batch(packed=packed)
    b, t = ids.shape
    docs = doc if doc is not None else torch.zeros_like(ids)
    pos = positions_from_documents(doc) if doc is not None else torch.arange(t).expand(b, t)
    anchors, ok = sample_anchors(candidate_anchors(mask, docs, 4), docs, None)
    with torch.no_grad():
        if anchor_chunk is None:
            q_ids, q_pos, ctx_mask = block_inputs(ids, pos, docs, anchors, 4, MASK)
            hidden = draft(q_ids, q_pos, draft.context(aux, pos), ctx_mask, block_size=4)
            hidden = hidden.view(b, anchors.shape[1], 4, -1)
        else:
            batch = {"input_ids": ids, "aux_hidden_states": aux, **({"document_ids": doc} if packed else {})}
            hidden, _ = block_hidden(draft, batch, anchors, anchor_chunk)
        checked = 0
        for r in range(b):
            for j, a in enumerate(anchors[r].tolist()):
                if not ok[r, j]:
                    continue
                start = int((docs[r] == docs[r, a]).nonzero()[0])
                block = torch.tensor([int(ids[r, a]), MASK, MASK, MASK])
                p0 = int(pos[r, a])
                ctx = draft.context(aux[r, start:a][None], pos[r, start:a][None])
                want = draft(block[None], torch.arange(p0, p0 + 4)[None], ctx, None, block_size=4)[0]
                torch.testing.assert_close(hidden[r, j], want, atol=1e-5, rtol=1e-5, msg=f"row {r} anchor {a}")
                checked += 1
    assert checked > 15
    if packed and forwards:
        assert len(forwards[0]) > 1  # the per-document forwards were taken


def test_anchor_chunks_score_only_the_keys_their_blocks_see():
    """Documents of 6, 5 and 5 tokens in one packed row: a forward per document once each holds ``min_anchors``
    and ``min_keys``, else at most ``max_anchors`` columns over the keys from the first one's document start to the
    last anchor."""
    doc = torch.tensor([[0] * 6 + [1] * 5 + [2] * 5])
    anchors = torch.tensor([[1, 3, 7, 9, 12, 14]])
    starts = document_starts(doc)
    assert starts.tolist() == [[0] * 6 + [6] * 5 + [11] * 5]
    assert anchor_chunks(anchors, starts, 4, min_anchors=1, min_keys=0) == [
        (slice(0, 2), (0, 3)), (slice(2, 4), (6, 9)), (slice(4, 6), (11, 14))]
    assert anchor_chunks(anchors, starts, 4, min_anchors=1, min_keys=6) == [
        (slice(0, 4), (0, 9)), (slice(4, 6), (11, 14))]  # the first document's 3 keys: the second joins
    assert anchor_chunks(anchors, starts, 4, min_keys=0) == [(slice(0, 4), (0, 9)), (slice(4, 6), (11, 14))]
    assert anchor_chunks(anchors, starts, 6, min_anchors=1) == [(slice(0, 6), (0, 14))]  # a short row: one forward
    # two rows: a column's keys cover both rows' anchors (row 1 pads with anchor 0, whose document starts at 0)
    two = torch.tensor([[2, 12, 14], [3, 13, 0]])
    assert anchor_chunks(two, document_starts(doc.expand(2, -1)), 4, min_anchors=1, min_keys=0) == [
        (slice(0, 1), (0, 3)), (slice(1, 3), (0, 14))]


def test_anchors_are_sampled_per_document_in_training_and_all_in_eval():
    draft = tiny_dflash(num_layers=1, block_size=4)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    obj = DFlashObjective(draft, head, anchors=3, weighting="exp", gamma=4.0)
    ids, aux, mask, doc = dflash_batch(t=30, packed=True)
    batch = {"input_ids": ids, "aux_hidden_states": aux, "loss_mask": mask, "document_ids": doc,
             "last_hidden_state": torch.randn(2, 30, 16)}
    torch.manual_seed(0)
    counts = obj.loss_counts(batch)
    anchors, ok = batch["_dflash_anchors"]
    assert counts.shape == (3,) and int(ok.sum()) == 2 * 2 * 3  # 3 per document, 2 documents, 2 rows
    assert bool(mask.gather(1, anchors)[ok].all())
    out = obj(batch, counts.float())
    assert torch.equal(out.metrics["count"], counts)
    out.loss.backward()
    assert draft.fc.weight.grad.abs().sum() > 0 and draft.lm_head.weight.grad is None  # lm_head: verifier's, frozen
    obj.eval()
    full = obj({k: v for k, v in batch.items() if not k.startswith("_")})
    assert bool((full.metrics["count"] >= counts).all()) and full.metrics["count"][0] > counts[0]


def _block_logits(draft, ids, aux, a):
    block = torch.tensor([int(ids[0, a]), MASK, MASK, MASK])
    ctx = draft.context(aux[:, :a], torch.arange(a)[None])
    return draft.compute_logits(draft(block[None], torch.arange(a, a + 4)[None], ctx, None, block_size=4))[0]


@pytest.mark.parametrize("weights", ["decay", "aligned"])
def test_loss_is_decayed_ce_per_valid_slot(weights):
    """loss = sum_k exp(-(k-1)/gamma) CE_k / #valid slots, CE to the verifier's argmax (exact recomputation);
    ``aligned``: slot k counts only when the draft's argmax was the verifier's at every slot before it."""
    draft = tiny_dflash(num_layers=1, block_size=4)
    loss = LossSpec(position_weights=weights)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    obj = DFlashObjective(draft, head, anchors=100, weighting="exp", gamma=2.0, loss=loss).eval()
    ids, aux, mask, _ = dflash_batch(b=1, t=10)
    last = torch.eye(16)[None, :10]  # row r's verifier logits are head.weight[:, r]
    with torch.no_grad():  # the verifier takes the draft's guesses at slots 1-2 of anchors 3 and 5: chains go on
        for a in (3, 5):
            guess = _block_logits(draft, ids, aux, a).argmax(-1)
            for k in (1, 2):
                head.weight[guess[k] + draft.d2t[guess[k]], a + k - 1] = head.weight[:, a + k - 1].max() + 2.0
    batch = {"input_ids": ids, "aux_hidden_states": aux, "loss_mask": mask, "last_hidden_state": last}
    with torch.no_grad():
        out = obj(batch)
        target = head(last[0]).argmax(-1)  # verifier's token for row r = x_{r+1}
        index = torch.full((VOCAB,), -1)
        index[torch.arange(DRAFT_VOCAB) + draft.d2t] = torch.arange(DRAFT_VOCAB)
        total, count, kept, later = 0.0, 0, 0, 0
        for a in range(3, 10):
            logits = _block_logits(draft, ids, aux, a)
            reached = True
            for k in range(1, 4):
                if a + k < 10:
                    tid = int(index[target[a + k - 1]])
                    ce = -torch.log_softmax(logits[k], -1)[tid] if tid >= 0 else torch.tensor(0.0)
                    if reached or weights == "decay":
                        total += math.exp(-(k - 1) / 2.0) * float(ce)
                        kept += k > 1
                    count += 1
                    later += k > 1
                    reached = reached and tid >= 0 and int(logits[k].argmax()) == tid
    assert int(out.metrics["count"].sum()) == count
    assert out.loss.item() == pytest.approx(total / count, rel=1e-5)
    if weights == "aligned":  # later slots both kept (the planted chains) and dropped
        assert 0 < kept < later


def test_dpace_weights_by_hand():
    ce = torch.tensor([[0.0, math.log(2), math.log(4), 0.0]])  # q = 1/2, 1/4 at slots 1, 2; slot 3 invalid
    valid = torch.tensor([[False, True, True, False]])
    w = slot_weights(ce, valid, "dpace", gamma=4.0, alpha=0.5)
    s1, s2 = 0.5 * 0.5 + 0.5, 0.5 * 0.25 + 0.5
    torch.testing.assert_close(w, torch.tensor([[0.0, s1 + s1 * s2, s1 * s2, 0.0]]))
    e = slot_weights(ce, valid, "exp", gamma=4.0, alpha=0.5)
    torch.testing.assert_close(e, torch.tensor([[0.0, 1.0, math.exp(-0.25), 0.0]]))


def test_proposer_is_one_forward_per_step_and_matches_the_reference():
    from tiny_speculators.models.dflash.proposer import DFlashProposer
    from tiny_speculators.sampling import SamplingParams

    draft = tiny_dflash(num_layers=2, block_size=5).eval()
    ids, aux, _, _ = dflash_batch(b=1, t=14)
    ids, aux = ids[0], aux[0]
    prop = DFlashProposer(draft)
    prop.commit(ids[1:7].tolist(), aux[:6], 0)  # verified positions 0..5; bonus x_6 at position 6
    tokens, _ = prop.propose_chain(3, SamplingParams(), None)
    assert prop.draft_forwards == 1 and prop.length == 6
    ref = reference_forward(draft, aux[:6], torch.arange(6), torch.tensor([int(ids[6]), MASK, MASK, MASK]),
                            torch.arange(6, 10))
    assert tokens == draft.to_target_ids(ref[1:].argmax(-1)).tolist()
    # rollback: position 6 and 7 verified (one draft accepted), bonus x_8; k = 4 = block_size - 1
    prop.commit(ids[7:9].tolist(), aux[6:8], 6)
    tokens, _ = prop.propose_chain(4, SamplingParams(), None)
    ref = reference_forward(draft, aux[:8], torch.arange(8), torch.tensor([int(ids[8]), *[MASK] * 4]),
                            torch.arange(8, 13))
    assert tokens == draft.to_target_ids(ref[1:].argmax(-1)).tolist() and prop.draft_forwards == 2
    prop.commit(ids[9:10].tolist(), aux[8:9], 8)
    with pytest.raises(UserError, match="block size 5 proposes 1...4 tokens per step, not k=5"):
        prop.propose_chain(5, SamplingParams(), None)


def test_default_aux_layers_are_five_spread_over_depth():
    assert default_aux_layer_ids(36) == [2, 10, 18, 26, 34]  # DFlash's Qwen3-8B drafts
    assert default_aux_layer_ids(30) == [2, 9, 15, 21, 28]  # SmolLM2-135M
    with pytest.raises(UserError, match="too shallow"):
        default_aux_layer_ids(4)


def test_import_a_speculators_written_dflash_checkpoint(tmp_path, tiny_llama_dir):
    """It imports with the verifier's embeddings and lm_head filled in, and vLLM 0.32's reading of
    ``sliding_window_non_causal: false`` (causal block attention); export writes it back the same way."""
    from tiny_speculators.models.dflash.speculators import write
    from tiny_speculators.models.family import ExportInfo
    from tiny_speculators.models.importing import import_draft
    from tiny_speculators.verifier.head import load_verifier_head

    w = speculators_dflash_checkpoint(tmp_path, tiny_llama_dir)
    draft, config = import_draft(tmp_path)
    head = load_verifier_head(str(tiny_llama_dir))
    assert config["model_type"] == "dflash" and config["speculative_tokens"] == 7
    assert config["aux_layer_ids"] == [2, 4, 5]
    assert draft.block_size == 8 and draft.mask_token_id == 7 and draft.kwargs["causal"] is True
    assert torch.equal(draft.lm_head.weight, head.target_head.lm_head.weight.float())
    assert torch.equal(draft.embed_tokens.weight, head.embed_weight.float())
    assert not draft.lm_head.weight.requires_grad and not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.layers[1].self_attn.k_norm.weight, w["layers.1.self_attn.k_norm.weight"])
    cfg, tensors = write(draft, ExportInfo(verifier_name=str(tiny_llama_dir), verifier_architectures=[],
                                           speculative_tokens=7, dtype=torch.float32))
    assert cfg["sliding_window_non_causal"] is False and set(tensors) == set(w)


@pytest.mark.parametrize(("top", "message"), [
    ({"sample_from_anchor": True}, "sample_from_anchor true is not supported"),
    ({"projector_type": "domino"}, "projector_type 'domino' is not supported"),
    ({"mask_token_id": None}, "missing required field\\(s\\) mask_token_id"),
])
def test_import_names_what_it_cannot_read(tmp_path, tiny_llama_dir, top, message):
    from tiny_speculators.models.importing import import_draft

    speculators_dflash_checkpoint(tmp_path, tiny_llama_dir, **top)
    with pytest.raises(UserError, match=message):
        import_draft(tmp_path)
