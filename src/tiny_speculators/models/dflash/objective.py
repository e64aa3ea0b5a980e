"""DFlash's training objective: random anchors per sample, one block per anchor, cross-entropy to the verifier's
token at every mask slot, in the attention pattern vLLM serves (``model.py``).

Coordinates: the block of anchor ``a`` holds token ``x_a`` at slot 0 (position ``pos[a]``) and ``mask_token_id``
at slots ``k = 1..L-1`` (positions ``pos[a] + k``); slot ``k`` predicts ``x_{a+k}``, whose target is the
verifier's argmax at row ``a + k - 1``. It counts where ``loss_mask[a + k]`` and ``a + k`` is in ``a``'s row and
document. Its context is the verifier's states at positions ``< a`` of the same document.

Anchors (training): per document, up to ``anchors`` positions with ``loss_mask[a]`` and a target at slot 1,
drawn without replacement with torch's global RNG (checkpointed, so resume is exact) in
:meth:`DFlashObjective.loss_counts`, which stores them in the batch for ``forward``. Validation (``eval()``)
uses every such position.

Loss: ``sum(w * CE) / count`` over all valid slots of the optimizer step, with ``w_k = exp(-(k-1)/gamma)``
(the paper's decay) or D-PACE weights (``w_k = sum_{j>=k} prod_{i<=j} ((1-alpha) q_i + alpha)`` over the
block's valid slots, ``q_i = exp(-CE_i)``, no gradient through the weights). Metrics per slot ``k``: CE sums,
accuracy, and the conditional accuracy (all earlier slots of the block right) that gives the expected
acceptance length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.losses import (
    DenseTargets,
    LossSpec,
    TopKTargets,
    all_before,
    combine_terms,
    dpace_weights,
    rowwise_losses,
)
from tiny_speculators.models.ttt import document_starts, key_chunks, positions_of

KEEP = "_dflash_anchors"  # batch key: (anchors [B, N], valid [B, N]) set by loss_counts
METRIC_KEYS = ("loss_sum", "wloss_sum", "count", "correct", "cond_correct", "cond_count")

__all__ = ["DFlashObjective", "anchor_chunks", "anchored", "at_anchors", "batch_anchors", "block_hidden",
           "block_inputs", "candidate_anchors", "documents", "sample_anchors", "slot_weights", "verifier_targets"]


def documents(batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` document ids of a batch (zeros when it holds one document per row)."""
    ids = batch["input_ids"]
    doc = batch.get("document_ids")
    return doc if doc is not None else torch.zeros_like(ids)


def slot_targets_valid(loss_mask: torch.Tensor, doc: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, T, L]`` bool: slot ``k`` of an anchor at ``a`` has a target (``loss_mask[a+k]``, same row/document);
    slot 0 never does."""
    b, t = loss_mask.shape
    out = torch.zeros(b, t, block_size, dtype=torch.bool, device=loss_mask.device)
    mask = loss_mask.bool()
    for k in range(1, block_size):
        if k < t:
            out[:, : t - k, k] = mask[:, k:] & (doc[:, k:] == doc[:, : t - k])
    return out


def candidate_anchors(loss_mask: torch.Tensor, doc: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, T]`` bool: positions that may anchor a block (``loss_mask[a]`` and slot 1 has a target)."""
    return loss_mask.bool() & slot_targets_valid(loss_mask, doc, block_size)[:, :, 1]


def sample_anchors(candidates: torch.Tensor, doc: torch.Tensor, per_document: int | None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``per_document`` candidates per document (all when None), sorted: ``(anchors [B, N], valid [B, N])``."""
    rows = []
    for r in range(candidates.shape[0]):
        picked = []
        cand = torch.nonzero(candidates[r]).flatten().cpu()
        if cand.numel():
            docs = doc[r, cand.to(doc.device)].cpu()
            for d in torch.unique(docs):
                pool = cand[docs == d]
                if per_document is not None and pool.numel() > per_document:
                    pool = pool[torch.randperm(pool.numel(), generator=generator)[:per_document]]
                picked.append(pool)
        rows.append(torch.cat(picked).sort().values if picked else torch.zeros(0, dtype=torch.long))
    n = max(1, max(r.numel() for r in rows))
    anchors = torch.zeros(len(rows), n, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : r.numel()], valid[i, : r.numel()] = r, True
    return anchors.to(candidates.device), valid.to(candidates.device)


def batch_anchors(batch: dict[str, Any], key: str, block_size: int, per_document: int,
                  training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This forward's ``(anchors [B, N], valid [B, N])``: in training ``per_document`` random ones, sampled once and
    kept in ``batch[key]`` (``loss_counts`` samples them, ``forward`` reuses them); in eval every candidate."""
    if key in batch:
        return batch[key]
    doc = documents(batch)
    cand = candidate_anchors(batch["loss_mask"], doc, block_size)
    out = sample_anchors(cand, doc, per_document if training else None)
    if training:
        batch[key] = out
    return out


def at_anchors(per_position: torch.Tensor, anchors: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``[B, T, X]`` per-position flags -> ``[B, N, X]`` at the sampled ``anchors [B, N]`` (False where not ``ok``)."""
    index = anchors[:, :, None].expand(-1, -1, per_position.shape[2])
    return per_position.gather(1, index) & ok[:, :, None]


def anchored(batch: dict[str, Any], key: str, block_size: int, per_document: int, training: bool,
             per_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This forward's anchors ``[B, N]`` (:func:`batch_anchors`) and the ``[B, T, X]`` per-position flags at them,
    ``[B, N, X]`` (:func:`at_anchors`)."""
    anchors, ok = batch_anchors(batch, key, block_size, per_document, training)
    return anchors, at_anchors(per_position, anchors, ok)


def block_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, doc: torch.Tensor, anchors: torch.Tensor,
                 block_size: int, mask_token_id: int,
                 keys: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of ``anchors [B, N]``: ids and positions ``[B, N*L]`` and the context mask ``[B, N*L, K]`` over the
    context keys ``keys = (lo, hi)`` (all ``T`` when None)."""
    b, n = anchors.shape
    lo, hi = keys if keys is not None else (0, input_ids.shape[1])
    ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    offsets = torch.arange(block_size, device=anchors.device)
    pos = position_ids.gather(1, anchors)[:, :, None] + offsets  # (B, N, L)
    key = torch.arange(lo, hi, device=anchors.device)
    ctx = (key[None, None, :] < anchors[:, :, None]) & (doc[:, None, lo:hi] == doc.gather(1, anchors)[:, :, None])
    ctx = ctx[:, :, None, :].expand(b, n, block_size, hi - lo)  # (B, N, L, K)
    return ids.reshape(b, n * block_size), pos.reshape(b, n * block_size), ctx.reshape(b, n * block_size, hi - lo)


def anchor_chunks(anchors: torch.Tensor, starts: torch.Tensor, max_anchors: int, min_anchors: int = 16,
                  min_keys: int = 512) -> list[tuple[slice, tuple[int, int]]]:
    """The forwards over ``anchors [B, N]`` (sorted per row): columns ``slice`` and the context keys ``(lo, hi)``
    they may see, every key ``k`` with ``start(a) <= k < a`` for each anchor ``a`` of the columns (``starts``:
    :func:`document_starts`). At most ``max_anchors`` columns each; a new forward also begins where a document
    starts after every key the current one sees, once it holds ``min_anchors`` columns and ``min_keys`` keys (a
    packed row's blocks then score their own documents' keys, not the whole row's: :func:`key_chunks`)."""
    return key_chunks(starts.gather(1, anchors).amin(dim=0).tolist(), anchors.amax(dim=0).tolist(), max_anchors,
                      min_anchors, min_keys)


def block_hidden(draft: DFlashDraft, batch: Mapping[str, Any], anchors: torch.Tensor, anchor_chunk: int,
                 keep: slice = slice(None)) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Pre-norm outputs ``[B, N, L', H]`` of the slots ``keep`` (all ``L`` by default) of every block of ``anchors
    [B, N]`` (sorted per row), at most ``anchor_chunk`` anchors per forward (bounded attention memory), each forward
    over the context keys its blocks may see (:func:`anchor_chunks`); and the injected context."""
    ids = batch["input_ids"]
    b = ids.shape[0]
    doc = documents(batch)
    pos = positions_of(ids, batch.get("document_ids"), batch.get("position_ids"))
    size = draft.block_size
    context = draft.context(batch["aux_hidden_states"], pos)
    hidden = []
    for columns, (lo, hi) in anchor_chunks(anchors, document_starts(doc), anchor_chunk):
        a = anchors[:, columns]
        q_ids, q_pos, ctx_mask = block_inputs(ids, pos, doc, a, size, draft.mask_token_id, keys=(lo, hi))
        keys = [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in context]
        h = draft(q_ids, q_pos, keys, ctx_mask, block_size=size)  # (B, n*L, H)
        hidden.append(h.view(b, a.shape[1], size, -1)[:, :, keep])
    return torch.cat(hidden, dim=1), context  # (B, N, L', H)


def verifier_targets(batch: Mapping[str, Any], head: nn.Module, vocab_size: int, rows: torch.Tensor | None = None):
    """The verifier's distributions at the flattened positions ``rows`` (all when None): its top-k logits when the
    batch has them, else its last hidden state through ``head``."""
    b, t = batch["input_ids"].shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(b * t, -1)
        return x if rows is None else x[rows]

    if "target_topk_ids" in batch:
        return TopKTargets(flat(batch["target_topk_ids"]), flat(batch["target_topk_logits"]), vocab_size=vocab_size)
    return DenseTargets(flat(batch["last_hidden_state"]), head)


def slot_weights(ce: torch.Tensor, valid: torch.Tensor, weighting: str, gamma: float, alpha: float) -> torch.Tensor:
    """Loss weights ``[M, L]`` of blocks with slot losses ``ce [M, L]`` (valid slots ``valid [M, L]``)."""
    k = torch.arange(ce.shape[1], device=ce.device, dtype=torch.float32)
    if weighting == "exp":
        w = torch.exp(-(k - 1).clamp(min=0) / gamma).expand_as(ce)
        return w * valid
    return dpace_weights(ce, valid, alpha)


class DFlashObjective(nn.Module):
    """``forward(batch, loss_normalizer) -> StepOutput`` for a :class:`DFlashDraft` (the only registered submodule).

    Loss groups are the ``L - 1`` mask slots; ``loss_counts`` gives their valid counts.
    """

    def __init__(self, draft: DFlashDraft, target_head: nn.Module, *, anchors: int, weighting: str, gamma: float,
                 dpace_alpha: float = 0.5, chunk_size: int = 1024, anchor_chunk: int = 256,
                 checkpoint: bool = True, loss: LossSpec | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.loss = (loss or LossSpec()).resolved("ce")  # DFlash's own loss: CE to the verifier's token
        if self.loss.position_weights == "dpace":  # the run's choice overrides the family's weighting
            weighting, dpace_alpha = "dpace", self.loss.dpace_alpha
        if weighting == "dpace" and "ce" not in self.loss.columns:
            self.loss = LossSpec(terms=self.loss.terms, position_weights="dpace", dpace_alpha=dpace_alpha)
        self._head = (target_head,)  # hidden from parameters()/state_dict()/DDP broadcast
        self.block_size, self.anchors, self.weighting = draft.block_size, anchors, weighting
        self.gamma, self.dpace_alpha = gamma, dpace_alpha
        self.chunk_size, self.anchor_chunk, self.checkpoint = chunk_size, anchor_chunk, checkpoint

    def _anchored(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchors ``[B, N]`` and which of their block's ``L`` slots have a target ``[B, N, L]``."""
        valid = slot_targets_valid(batch["loss_mask"], documents(batch), self.block_size)  # (B, T, L)
        return anchored(batch, KEEP, self.block_size, self.anchors, self.training, valid)

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[L-1]`` valid mask slots per slot index (samples the anchors for the coming forward)."""
        return self._anchored(batch)[1].sum(dim=(0, 1))[1:]

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        ids = batch["input_ids"]
        t = ids.shape[1]
        anchors, valid = self._anchored(batch)  # (B, N), (B, N, L)
        size = self.block_size
        hidden, context = block_hidden(self.draft, batch, anchors, self.anchor_chunk)  # (B, N, L, H)
        sel = torch.nonzero(valid, as_tuple=True)
        rows = sel[0] * t + anchors[sel[0], sel[1]] + sel[2] - 1  # verifier row predicting x_{a+k}
        h = hidden[sel]  # (M, H)
        source = verifier_targets(batch, self._head[0], self.draft.t2d.numel())
        cols, has, pred_flat, target = rowwise_losses(self.draft, h, source, rows, self.loss,
                                                      chunk_size=self.chunk_size, checkpoint=self.checkpoint)
        slot = sel[2]
        rows_loss = cols.new_zeros(cols.shape[0])
        for k in range(1, size):  # the LK weight is per slot (its mean acceptance rate)
            at = slot == k
            if bool(at.any()):
                rows_loss = rows_loss.index_put((at.nonzero().squeeze(1),), combine_terms(self.loss, cols[at], has[at]))
        ce_flat = cols[:, self.loss.columns.index("ce")] if "ce" in self.loss.columns else rows_loss
        ce = hidden.new_zeros(valid.shape, dtype=torch.float32).index_put(sel, ce_flat)  # (B, N, L) for D-PACE
        per = hidden.new_zeros(valid.shape, dtype=torch.float32).index_put(sel, rows_loss)  # (B, N, L)
        correct = torch.zeros_like(valid).index_put(sel, (pred_flat == target) & (target >= 0))
        before = all_before(correct, valid, 2)  # all slots < k right (or not counted)
        weights = slot_weights(ce.view(-1, size), valid.view(-1, size), self.weighting, self.gamma,
                               self.dpace_alpha).view_as(ce)
        if self.loss.position_weights == "aligned":  # only where decoding reaches the slot
            weights = weights * before
        wloss = (weights * per).sum(dim=(0, 1))[1:]  # (L-1,)
        counts = valid.sum(dim=(0, 1))[1:]
        denom = loss_normalizer.to(ids.device).float().sum() if loss_normalizer is not None else counts.sum().float()
        loss = wloss.sum() / denom.clamp(min=1)
        if not rows_loss.requires_grad and torch.is_grad_enabled():  # no valid slot: keep every parameter in the graph
            loss = loss + 0.0 * (self.draft.compute_logits(hidden[:, :1, 0]).float().sum()
                                 + sum(kv[0].sum() + kv[1].sum() for kv in context))
        cond_count = (valid & before).sum(dim=(0, 1))[1:]
        cond_correct = (valid & before & correct).sum(dim=(0, 1))[1:]
        metrics = {"loss_sum": per.detach().sum(dim=(0, 1))[1:], "wloss_sum": wloss.detach(), "count": counts,
                   "correct": correct.sum(dim=(0, 1))[1:], "cond_correct": cond_correct, "cond_count": cond_count}
        return StepOutput(loss=loss, metrics=metrics)

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(self.block_size - 1, dtype=torch.float64, device=device) for key in METRIC_KEYS}

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return summarize(stats)


def summarize(stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Summed metrics -> ``loss`` (weighted CE per valid slot), per-slot ``loss_steps``/``acc``/``cond_acc``,
    ``accept_len`` = 1 + sum_k prod_{j<=k} cond_acc_j, ``positions`` (valid slot-1 predictions)."""
    m = {k: stats[k].detach().double().cpu() for k in METRIC_KEYS}
    count = m["count"]
    total = float(count.sum())
    per = [float(m["loss_sum"][k]) / float(count[k]) if count[k] else 0.0 for k in range(count.numel())]
    acc = [float(m["correct"][k]) / float(count[k]) if count[k] else 0.0 for k in range(count.numel())]
    cond = [float(m["cond_correct"][k]) / float(m["cond_count"][k]) if m["cond_count"][k] else 0.0
            for k in range(count.numel())]
    accept, run = 1.0, 1.0
    for c in cond:
        run *= c
        accept += run
    return {"loss": float(m["wloss_sum"].sum()) / total if total else 0.0, "loss_steps": per, "acc": acc,
            "cond_acc": cond, "accept_len": accept, "positions": float(count[0]) if count.numel() else 0.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay: gamma 7 / 5 / 4 for blocks of 16 / 10 / 8, interpolated (and held) elsewhere."""
    if block_size <= 8:
        return 4.0
    if block_size <= 10:
        return 4.0 + (block_size - 8) / 2
    return min(7.0, 5.0 + (block_size - 10) / 3)
