"""The metrics of a chain of draft positions (TTT steps, P-EAGLE depths): per-position loss and accuracy, the
conditional accuracy along the chain and the expected acceptance length it gives (``ttt.py`` for the alignment they
assume). The losses themselves, computed in token chunks, live in ``models/losses.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["METRIC_KEYS", "acceptance_length", "chain_metrics", "summarize", "summarize_metrics"]

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


def acceptance_length(cond_acc: list[float]) -> float:
    """Expected tokens per verification of a greedy chain: ``1 + sum_k prod_{j<=k} cond_acc_j`` (the verifier's bonus
    token counts)."""
    accept, run = 1.0, 1.0
    for c in cond_acc:
        run *= c
        accept += run
    return accept


def summarize_metrics(metrics: dict[str, torch.Tensor], decay: float = 1.0) -> dict[str, float]:
    """Summed metric tensors (from one or many ``ttt_step`` calls) -> floats for logging.

    Keys: ``loss`` (``sum_k decay**k * loss_k``), and per step k: ``loss_k``, ``acc_k``, ``cond_acc_k``;
    ``acceptance_length`` (``1 + sum_k prod_{j<=k} cond_acc_j``); ``tokens`` (valid step-0 anchors).
    """
    m = {k: metrics[k].detach().double().cpu() for k in METRIC_KEYS}
    steps = m["count"].numel()
    out: dict[str, float] = {}
    loss, cond = 0.0, []
    for k in range(steps):
        count = float(m["count"][k])
        loss_k = float(m["loss_sum"][k]) / count if count else 0.0
        acc_k = float(m["correct"][k]) / count if count else 0.0
        cond_n = float(m["cond_count"][k])
        cond_k = float(m["cond_correct"][k]) / cond_n if cond_n else 0.0
        out[f"loss_{k}"], out[f"acc_{k}"], out[f"cond_acc_{k}"] = loss_k, acc_k, cond_k
        loss += decay**k * loss_k
        cond.append(cond_k)
    out["loss"] = loss
    out["acceptance_length"] = acceptance_length(cond)
    out["tokens"] = float(m["count"][0]) if steps else 0.0
    return out


def summarize(stats: Mapping[str, torch.Tensor], decay: float) -> dict[str, Any]:
    """Reduced sums -> ``loss``, per-step lists ``loss_steps``, ``acc``, ``cond_acc``, and ``accept_len``."""
    flat = summarize_metrics(dict(stats), decay)
    k = stats["count"].numel()
    return {"loss": flat["loss"], "loss_steps": [flat[f"loss_{i}"] for i in range(k)],
            "acc": [flat[f"acc_{i}"] for i in range(k)], "cond_acc": [flat[f"cond_acc_{i}"] for i in range(k)],
            "accept_len": flat["acceptance_length"], "positions": flat["tokens"]}
