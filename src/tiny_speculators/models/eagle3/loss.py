"""The TTT loss and metrics, computed in token chunks (see ``ttt.py`` for the alignment they assume).

``chunked_kl_loss`` walks the *target* rows in chunks: each chunk's verifier logits are computed once
(through ``target_head`` when given hidden states), reduced at once to the draft-vocab log-probs and
the full-vocab argmax, and shared by all K steps (target row ``r`` serves step ``k`` at anchor
``r - k - 1``). The draft logits of each (chunk, step) block are recomputed in backward
(``torch.utils.checkpoint``), so peak memory is one ``[chunk, V]`` target block plus one
``[chunk, Vd]`` draft block, whatever K and the sequence length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from tiny_speculators.models.eagle3.model import Eagle3Draft

METRIC_KEYS = ("loss_sum", "count", "correct", "cond_correct", "cond_count")


def _block_kl(draft: Eagle3Draft, hidden: torch.Tensor, target_logp: torch.Tensor):
    """KL(p || q) summed over rows, and the draft argmax; hidden [n, H], target_logp [n, Vd] (fp32)."""
    logq = F.log_softmax(draft.compute_logits(hidden).float(), dim=-1)  # (n, Vd)
    p = target_logp.exp()
    kl = torch.where(p > 0, p * (target_logp - logq), torch.zeros_like(logq)).sum()
    return kl, logq.argmax(dim=-1)


def chunked_kl_loss(
    draft: Eagle3Draft,
    hidden: list[torch.Tensor],
    valid: torch.Tensor,
    source: torch.Tensor,
    *,
    target_head: Callable[[torch.Tensor], torch.Tensor] | None,
    chunk_size: int = 1024,
    checkpoint: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step KL sums and per-anchor correctness.

    Args:
        hidden: K pre-norm draft outputs, each ``[N, H]`` (flattened ``B*T`` anchors).
        valid: ``[K, N]`` bool, step k at anchor n has a target (its target row is ``n + k + 1``).
        source: ``[N, Ht]`` verifier last hidden states (with ``target_head``) or ``[N, V]`` logits (without).
        target_head: ``[n, Ht] -> [n, V]`` verifier logits, or None when ``source`` holds logits.

    Returns ``loss_sums [K]`` (differentiable) and ``correct [K, N]`` (draft argmax mapped to a target id
    equals the verifier's argmax over the full vocab; False where not valid).
    """
    steps, n = valid.shape
    device = valid.device
    draft_cols = torch.arange(draft.draft_vocab_size, device=device) + draft.d2t  # target id per draft id
    loss_sums = [torch.zeros((), device=device) for _ in range(steps)]
    correct = torch.zeros(steps, n, dtype=torch.bool, device=device)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        rows = torch.arange(start, stop, device=device)
        users = []  # per step: which rows of this chunk are some valid anchor's target
        for k in range(steps):
            anchors = rows - k - 1
            keep = anchors >= 0
            keep[keep.clone()] = valid[k, anchors[keep]]
            users.append(keep)
        if not any(bool(u.any()) for u in users):
            continue
        with torch.no_grad():
            chunk = source[start:stop]
            logits = (chunk if target_head is None else target_head(chunk)).float()  # (c, V)
            target_argmax = logits.argmax(dim=-1)  # over the FULL target vocab
            target_logp = F.log_softmax(logits[:, draft_cols], dim=-1)  # (c, Vd) renormalized on the draft vocab
            del logits
        for k in range(steps):
            keep = users[k]
            if not keep.any():
                continue
            anchors = rows[keep] - k - 1
            h = hidden[k][anchors]  # (n_k, H)
            tlp = target_logp[keep]
            if checkpoint and torch.is_grad_enabled():
                kl, pred = grad_checkpoint(_block_kl, draft, h, tlp, use_reentrant=False)
            else:
                kl, pred = _block_kl(draft, h, tlp)
            loss_sums[k] = loss_sums[k] + kl
            correct[k, anchors] = draft.to_target_ids(pred) == target_argmax[keep]
    for k in range(steps):
        if not loss_sums[k].requires_grad and hidden[k].requires_grad:
            # No valid anchor at this step: still touch norm/lm_head (zero gradient) so every trainable
            # parameter takes part in backward (DDP/FSDP expect the same parameters on every rank).
            loss_sums[k] = loss_sums[k] + 0.0 * draft.compute_logits(hidden[k][:1]).float().sum()
    return torch.stack(loss_sums), correct


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
