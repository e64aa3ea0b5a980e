"""EAGLE-3's TTT metrics (see ``ttt.py`` for the alignment they assume); the losses themselves, computed in token
chunks, and the verifier's target sources (:class:`DenseTargets`, :class:`TopKTargets`) live in ``models/losses.py``,
shared by every family.
"""

from __future__ import annotations

import torch

from tiny_speculators.models.losses import DenseTargets, TargetSource, TopKTargets

__all__ = ["METRIC_KEYS", "DenseTargets", "TargetSource", "TopKTargets", "chain_metrics", "summarize_metrics"]

METRIC_KEYS = ("loss_sum", "count", "correct", "cond_correct", "cond_count")


def chain_metrics(valid: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional accuracy sums: ``cond_correct[k], cond_count[k]`` over anchors where every step
    ``j < k`` was valid and correct (``valid``/``correct``: ``[K, N]`` bool)."""
    chain = torch.ones_like(valid[0])
    cond_correct, cond_count = [], []
    for k in range(valid.shape[0]):
        base = chain & valid[k]
        chain = base & correct[k]
        cond_count.append(base.sum())
        cond_correct.append(chain.sum())
    return torch.stack(cond_correct), torch.stack(cond_count)


def summarize_metrics(metrics: dict[str, torch.Tensor], decay: float = 1.0) -> dict[str, float]:
    """Summed metric tensors (from one or many ``ttt_step`` calls) -> floats for logging.

    Keys: ``loss`` (``sum_k decay**k * loss_k``), and per step k: ``loss_k``, ``acc_k``, ``cond_acc_k``;
    ``acceptance_length`` (``1 + sum_k prod_{j<=k} cond_acc_j``); ``tokens`` (valid step-0 anchors).
    """
    m = {k: metrics[k].detach().double().cpu() for k in METRIC_KEYS}
    steps = m["count"].numel()
    out: dict[str, float] = {}
    loss, run, accept = 0.0, 1.0, 1.0
    for k in range(steps):
        count = float(m["count"][k])
        loss_k = float(m["loss_sum"][k]) / count if count else 0.0
        acc_k = float(m["correct"][k]) / count if count else 0.0
        cond_n = float(m["cond_count"][k])
        cond_k = float(m["cond_correct"][k]) / cond_n if cond_n else 0.0
        out[f"loss_{k}"], out[f"acc_{k}"], out[f"cond_acc_{k}"] = loss_k, acc_k, cond_k
        loss += decay**k * loss_k
        run *= cond_k
        accept += run
    out["loss"] = loss
    out["acceptance_length"] = accept
    out["tokens"] = float(m["count"][0]) if steps else 0.0
    return out
