"""The TTT loss and metrics, computed in token chunks (see ``ttt.py`` for the alignment they assume).

``chunked_kl_loss`` walks the *target* rows in chunks: each chunk's verifier logits are computed once
(through ``target_head`` when given hidden states), reduced at once to the draft-vocab log-probs and
the full-vocab argmax, and shared by all K steps (target row ``r`` serves step ``k`` at anchor
``r - k - 1``). The draft logits of each (chunk, step) block are recomputed in backward
(``torch.utils.checkpoint``), so peak memory is one ``[chunk, V]`` target block plus one
``[chunk, Vd]`` draft block, whatever K and the sequence length.

The verifier's distribution comes from one of two target sources:

* :class:`DenseTargets`: all ``V`` logits (given, or computed by the target head from the verifier's last
  hidden state); the draft-vocab distribution is exact.
* :class:`TopKTargets`: the verifier's top-k logits per row (``extract --layout topk``). The argmax over the
  full vocab is still exact; the draft-vocab distribution is the top-k tokens that are in the draft vocab,
  renormalized (the verifier's mass on draft tokens outside its top-k is dropped). A row whose top-k holds
  no draft token has no distribution to match: it adds nothing to the KL but still counts (its accuracy is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from tiny_speculators.models.eagle3.model import Eagle3Draft

METRIC_KEYS = ("loss_sum", "count", "correct", "cond_correct", "cond_count")


class TargetSource(Protocol):
    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` -> (verifier argmax over the full vocab ``[c]``, log-probs on the draft vocab
        ``[c, Vd]`` (fp32), where ``draft_cols[i]`` is draft id i's target id)."""
        ...


class DenseTargets:
    """All the verifier's logits: ``source [N, V]`` logits, or ``source [N, Ht]`` last hidden states + ``head``."""

    def __init__(self, source: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.source, self.head = source, head

    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.source[start:stop]
        logits = (rows if self.head is None else self.head(rows)).float()  # (c, V)
        return logits.argmax(dim=-1), F.log_softmax(logits[:, draft_cols], dim=-1)


class TopKTargets:
    """The verifier's top-k logits: ``ids [N, k]`` target ids and ``logits [N, k]`` (module docstring)."""

    def __init__(self, ids: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> None:
        self.ids, self.logits, self.vocab_size = ids, logits, vocab_size
        self._draft_index: torch.Tensor | None = None

    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._draft_index is None:  # target id -> draft id, -1 outside the draft vocab
            self._draft_index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=draft_cols.device)
            self._draft_index[draft_cols] = torch.arange(draft_cols.numel(), device=draft_cols.device)
        ids, logits = self.ids[start:stop].long(), self.logits[start:stop].float()
        argmax = ids.gather(1, logits.argmax(dim=1, keepdim=True)).squeeze(1)
        draft_ids = self._draft_index[ids]  # (c, k)
        keep = draft_ids >= 0
        dense = logits.new_full((ids.shape[0], draft_cols.numel()), float("-inf"))
        row = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        dense[row[keep], draft_ids[keep]] = logits[keep]
        logp = F.log_softmax(dense, dim=-1)
        empty = ~keep.any(dim=1)  # no draft token in the top-k: all -inf (log_softmax gave nan)
        return argmax, logp.masked_fill(empty[:, None], float("-inf"))


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
    targets: TargetSource,
    *,
    chunk_size: int = 1024,
    checkpoint: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step KL sums and per-anchor correctness.

    Args:
        hidden: K pre-norm draft outputs, each ``[N, H]`` (flattened ``B*T`` anchors).
        valid: ``[K, N]`` bool, step k at anchor n has a target (its target row is ``n + k + 1``).
        targets: the verifier's distribution per row (:class:`DenseTargets` or :class:`TopKTargets`).

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
        with torch.no_grad():  # argmax over the FULL target vocab; (c, Vd) log-probs renormalized on the draft vocab
            target_argmax, target_logp = targets.chunk(start, stop, draft_cols)
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
