"""DSpark's training objective: DFlash's random-anchor blocks (``models/dflash/objective.py``: anchors, block
inputs, context mask, reused as is) with every predicting slot scored by ``loss.py`` (CE + TV + confidence BCE).

Coordinates: prediction ``j = 0..P-1`` of the anchor at ``a`` predicts ``x_{a+j+1}`` (target: the verifier at row
``a + j``), sits at block slot ``j`` with ``sample_from_anchor`` (P = block_size) or ``j + 1`` without (P =
block_size - 1), and its Markov bias / confidence read the previous token ``x_{a+j}`` (teacher forced: the data's
token, which the drafted chain has whenever this slot's token matters). It counts where ``x_{a+1} .. x_{a+j+1}`` are
all loss positions of ``a``'s row and document (the contiguous prefix, as the peers' eval mask).

Loss: ``sum_{valid} w_j (token_j + c * bce_j) / #valid slots of the optimizer step``. ``token_j`` is the run's loss
choice (``models/losses.py``; DSpark's own default: ``0.1 ce + 0.9 tv``, the peers' split, from the options; LK's
weight uses prediction j's mean acceptance in this forward), ``bce_j = BCE(confidence_j, 1 - tv_j)`` with the target
detached, ``c`` the confidence weight. ``w_j``: DFlash's ``exp(-j / gamma)``, or D-PACE along each block's chain of
predictions when the run asks for it. Metrics per prediction index: the loss terms, greedy accuracy and conditional
accuracy (``accept_len`` as DFlash), the expected acceptance ``1 - tv`` and the mean predicted confidence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from tiny_speculators.models.dflash.objective import (
    anchored,
    block_hidden,
    documents,
    slot_targets_valid,
    slot_weights,
    verifier_targets,
)
from tiny_speculators.models.dspark.model import DSparkDraft
from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.losses import (
    LossSpec,
    all_before,
    combine_terms,
    dpace_weights,
    row_columns,
)

KEEP = "_dspark_anchors"  # batch key: (anchors [B, N], valid [B, N]) set by loss_counts
METRIC_KEYS = ("wloss_sum", "count", "ce_sum", "tv_sum", "bce_sum", "accept_sum", "conf_sum", "correct",
               "cond_correct", "cond_count")

__all__ = ["DSparkObjective", "prediction_valid", "summarize"]


def prediction_valid(loss_mask: torch.Tensor, doc: torch.Tensor, predictions: int) -> torch.Tensor:
    """``[B, T, P]`` bool: prediction j of an anchor at ``a`` counts (``x_{a+1..a+j+1}`` all loss positions of the
    same row and document)."""
    valid = slot_targets_valid(loss_mask, doc, predictions + 1)[:, :, 1:]
    return torch.cumprod(valid.int(), dim=2).bool()


def _rows(draft: DSparkDraft, hidden, prev, target_ids, target_logp, columns: tuple[str, ...]):
    """Per-row loss columns ``[c, C]`` (``columns``, from ``models/losses.py``), whether the verifier has a distribution
    ``[c]``, confidence logits ``[c]`` (zeros without a head) and the greedy prediction, for ``hidden [c, H]``
    (pre-norm) with previous tokens ``prev [c]``."""
    logits, conf = draft.heads(hidden, prev)
    logq = F.log_softmax(logits.float(), dim=-1)
    cols = row_columns(logq, target_logp, target_ids, columns)
    has = (target_logp > float("-inf")).any(dim=-1)
    conf = conf.float() if conf is not None else cols.new_zeros(cols.shape[0])
    return cols, has, conf, logits.argmax(dim=-1)


class DSparkObjective(nn.Module):
    """``forward(batch, loss_normalizer) -> StepOutput`` for a :class:`DSparkDraft`; loss groups: the P predictions."""

    def __init__(self, draft: DSparkDraft, target_head: nn.Module, *, anchors: int, gamma: float,
                 loss: LossSpec | None = None, confidence_weight: float = 1.0, chunk_size: int = 1024,
                 anchor_chunk: int = 256, checkpoint: bool = True) -> None:
        super().__init__()
        self.draft = draft
        self._head = (target_head,)  # hidden from parameters()/state_dict()/DDP broadcast
        self.block_size, self.predictions = draft.block_size, draft.max_tokens
        self.first_slot = 0 if draft.sample_from_anchor else 1
        self.anchors, self.gamma = anchors, gamma
        spec = loss if loss is not None and loss.terms is not None else LossSpec(
            terms=(("ce", 0.1), ("tv", 0.9)), position_weights=loss.position_weights if loss else "decay",
            dpace_alpha=loss.dpace_alpha if loss else 0.5)
        self.loss = spec
        self.columns = tuple(dict.fromkeys((*spec.columns, "ce", "tv")))  # + what the metrics and the BCE read
        self.confidence_weight = confidence_weight if draft.confidence_head is not None else 0.0
        self.chunk_size, self.anchor_chunk, self.checkpoint = chunk_size, anchor_chunk, checkpoint

    def _anchored(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchors ``[B, N]`` and which of their ``P`` predictions count ``[B, N, P]``."""
        valid = prediction_valid(batch["loss_mask"], documents(batch), self.predictions)  # (B, T, P)
        return anchored(batch, KEEP, self.block_size, self.anchors, self.training, valid)

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[P]`` valid predictions per index (samples the anchors for the coming forward)."""
        return self._anchored(batch)[1].sum(dim=(0, 1))

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        ids = batch["input_ids"]
        b, t = ids.shape
        anchors, valid = self._anchored(batch)  # (B, N), (B, N, P)
        n_pred, draft = self.predictions, self.draft
        hidden, context = block_hidden(draft, batch, anchors, self.anchor_chunk,
                                       keep=slice(self.first_slot, self.first_slot + n_pred))  # (B, N, P, H)
        sel = torch.nonzero(valid, as_tuple=True)
        rows = sel[0] * t + anchors[sel[0], sel[1]] + sel[2]  # verifier row predicting x_{a+j+1}
        prev = ids.reshape(-1)[rows]  # x_{a+j}
        pad = torch.zeros_like(valid[..., :1])  # DFlash's weights count slot 1 as the first prediction
        weights = slot_weights(torch.zeros(valid.shape[0] * valid.shape[1], n_pred + 1, device=ids.device),
                               torch.cat([pad, valid], -1).view(-1, n_pred + 1), "exp", self.gamma,
                               0.0)[:, 1:].reshape(valid.shape)  # (B, N, P): exp(-j / gamma)
        source = verifier_targets(batch, self._head[0], draft.t2d.numel(), rows)
        cols = torch.arange(draft.draft_vocab_size, device=ids.device) + draft.d2t  # target id per draft id
        index = torch.full((draft.t2d.numel(),), -1, dtype=torch.long, device=ids.device)
        index[cols] = torch.arange(draft.draft_vocab_size, device=ids.device)
        h = hidden[sel]  # (M, H)
        parts, targets = [], []
        for start in range(0, h.shape[0], self.chunk_size):
            stop = min(start + self.chunk_size, h.shape[0])
            with torch.no_grad():
                argmax, logp = source.chunk(start, stop, cols)
            targets.append(index[argmax])
            args = (draft, h[start:stop], prev[start:stop], targets[-1], logp, self.columns)
            if self.checkpoint and torch.is_grad_enabled():
                parts.append(grad_checkpoint(_rows, *args, use_reentrant=False))
            else:
                parts.append(_rows(*args))
        grid = valid.shape
        at = {c: i for i, c in enumerate(self.columns)}
        if parts:
            row_cols, has, conf_logit, pred_flat = (torch.cat([p[i] for p in parts]) for i in range(4))
        else:
            row_cols = torch.zeros(0, len(self.columns), device=ids.device)
            has, conf_logit = torch.zeros(0, dtype=torch.bool, device=ids.device), torch.zeros(0, device=ids.device)
            pred_flat = torch.zeros(0, dtype=torch.long, device=ids.device)
        accept_flat = (1.0 - row_cols[:, at["tv"]].detach()).clamp(0.0, 1.0)
        bce_flat = F.binary_cross_entropy_with_logits(conf_logit, accept_flat, reduction="none")
        token_flat = torch.zeros_like(accept_flat)
        for j in range(n_pred):  # LK's weight is per prediction index
            in_j = sel[2] == j
            if bool(in_j.any()):
                token_flat = token_flat.index_put((in_j.nonzero(as_tuple=True)[0],),
                                                  combine_terms(self.loss, row_cols[in_j], has[in_j]))

        def scatter(flat: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(grid, dtype=dtype, device=ids.device).index_put(sel, flat.detach().to(dtype))

        ce, tv, accept, bce = (scatter(row_cols[:, at["ce"]]), scatter(row_cols[:, at["tv"]]), scatter(accept_flat),
                               scatter(bce_flat))
        conf_p = scatter(torch.sigmoid(conf_logit)) if draft.confidence_head is not None else torch.zeros(grid,
                                                                                                        device=ids.device)
        pred = scatter(pred_flat, torch.long)
        target = torch.full(grid, -1, dtype=torch.long, device=ids.device).index_put(
            sel, torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long, device=ids.device))
        correct = valid & (pred == target) & (target >= 0)
        before = all_before(correct, valid, 2)  # all predictions < j right
        if self.loss.position_weights == "dpace":  # along each block's chain of predictions, from its CE (no grad)
            weights = dpace_weights(ce.view(-1, n_pred), valid.view(-1, n_pred), self.loss.dpace_alpha).view(grid)
        elif self.loss.position_weights == "aligned":  # only where decoding reaches the prediction
            weights = weights * before
        w = weights[sel]
        counts = valid.sum(dim=(0, 1))  # (P,)
        denom = loss_normalizer.to(ids.device).float().sum() if loss_normalizer is not None else counts.sum().float()
        if parts:
            loss = (w * (token_flat + self.confidence_weight * bce_flat)).sum() / denom.clamp(min=1)
        else:  # no valid slot: a zero loss that keeps every parameter in the graph (DDP)
            logits0, conf0 = draft.heads(hidden.new_zeros(b, draft.hidden_size) + hidden.sum() * 0,
                                         torch.zeros(b, dtype=torch.long, device=ids.device))
            loss = 0.0 * (logits0.sum() + (conf0.sum() if conf0 is not None else 0.0)
                          + sum(kv[0].sum() + kv[1].sum() for kv in context))
        per_slot = scatter(token_flat) + self.confidence_weight * bce
        metrics = {"wloss_sum": (weights * per_slot * valid).sum(dim=(0, 1)), "count": counts,
                   "ce_sum": ce.sum(dim=(0, 1)), "tv_sum": tv.sum(dim=(0, 1)), "bce_sum": bce.sum(dim=(0, 1)),
                   "accept_sum": accept.sum(dim=(0, 1)), "conf_sum": conf_p.sum(dim=(0, 1)),
                   "correct": correct.sum(dim=(0, 1)), "cond_correct": (valid & before & correct).sum(dim=(0, 1)),
                   "cond_count": (valid & before).sum(dim=(0, 1))}
        return StepOutput(loss=loss, metrics=metrics)

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(self.predictions, dtype=torch.float64, device=device) for key in METRIC_KEYS}

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return summarize(stats)


def summarize(stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Summed metrics -> ``loss`` (weighted per valid slot), per-prediction ``loss_steps`` (CE) / ``tv`` / ``acc`` /
    ``cond_acc`` / ``accept_rate`` (mean 1 - tv) / ``confidence`` (mean predicted), ``accept_len`` (greedy chain, as
    DFlash), ``expected_accept_len`` (1 + sum_j prod_{i<=j} accept_rate_i), ``confidence_bce``, ``positions``."""
    m = {k: stats[k].detach().double().cpu() for k in METRIC_KEYS}
    count = m["count"]
    n = count.numel()

    def per(key: str, denom: torch.Tensor = count) -> list[float]:
        return [float(m[key][i]) / float(denom[i]) if denom[i] else 0.0 for i in range(n)]

    cond, rates = per("cond_correct", m["cond_count"]), per("accept_sum")
    accept, expected, run, run_e = 1.0, 1.0, 1.0, 1.0
    for c, r in zip(cond, rates, strict=True):
        run, run_e = run * c, run_e * r
        accept, expected = accept + run, expected + run_e
    total = float(count.sum())
    return {"loss": float(m["wloss_sum"].sum()) / total if total else 0.0, "loss_steps": per("ce_sum"),
            "tv": per("tv_sum"), "acc": per("correct"), "cond_acc": cond, "accept_rate": rates,
            "confidence": per("conf_sum"), "confidence_bce": float(m["bce_sum"].sum()) / total if total else 0.0,
            "accept_len": accept, "expected_accept_len": expected, "positions": float(count[0]) if n else 0.0}
