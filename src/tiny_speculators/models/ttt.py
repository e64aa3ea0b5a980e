"""Training-time test (TTT): a K-step rollout of a chain draft with its loss and metrics. EAGLE-3 trains with it,
and MTP (its one layer applied recursively is the same chain); any draft with ``fuse``, ``forward(ids, hidden,
positions, attention_mask, cache, logits=False)`` and ``compute_logits`` fits.

Data layout (what ``HiddenStateReader`` yields, batched): all tensors are aligned with the tokens,
``input_ids[b, t] = x_t``; ``aux_hidden_states[b, t]`` and ``last_hidden_state[b, t]`` are the
verifier's states after reading ``x_0..x_t`` (so ``target_head(last[b, t])`` are the verifier's
logits for ``x_{t+1}``); ``loss_mask[b, t] = 1`` when token ``x_t`` is one the draft should learn
to predict (assistant tokens). ``ttt_step`` does all shifting itself.

Rollout. Rows are indexed by the *anchor* ``t`` (the context position the draft extends, as vLLM
does after the verifier has read ``x_0..x_t``):

* step 0, anchor ``t``: token ``x_{t+1}``, hidden ``fuse(aux[t])``, RoPE position ``pos[t]``;
* step k, anchor ``t``: token ``x_{t+k+1}`` (ground truth, shifted one more per step), hidden = the
  draft's own pre-norm output of step ``k-1`` at anchor ``t``, position ``pos[t] + k``;
* step k at anchor ``t`` predicts ``x_{t+k+2}``; its target is the verifier's distribution at
  ``t+k+1``; it counts iff ``t+k+2 < T``, ``loss_mask[t+k+2] == 1`` and ``x_{t+k+2}`` is in the same
  document as ``x_t`` (packed sequences).
* attention at step k (see ``models/attention.py``): causal over step-0 keys of the same document, plus the
  keys of steps 1..k at the same anchor — what the draft sees in vLLM's chain drafting.

Loss (``models/losses.py``, chosen by ``loss``: a :class:`LossSpec`, default forward KL): per step, the combined
loss terms between ``p = softmax(verifier logits restricted to the draft vocab, i.e. columns i + d2t[i])`` and
``q = softmax(draft logits)``, times each anchor's position weight (``decay**k``, or D-PACE), summed over valid
anchors: ``loss_sums[k]``. ``loss = sum_k loss_sums[k] / max(counts[k], 1)``. For exact gradient accumulation over
micro-batches / ranks, pass ``loss_normalizer`` = the global per-step counts (the all-reduced ``counts`` of the whole
optimizer step): then ``loss = sum_k loss_sums[k] / loss_normalizer[k]`` and the micro-batch losses sum to the
full-batch loss (the LK term's weight is a per-forward statistic, so with it this holds approximately).
Memory (``models/losses.py``): verifier logits are computed from ``last_hidden_state`` through ``target_head`` in
chunks of ``chunk_size`` rows (each chunk once, shared by all K steps, only its draft-vocab columns and
full-vocab argmax kept), and each (chunk, step) draft-logit block is recomputed in backward
(``torch.utils.checkpoint``), so no ``[K, N, V]`` tensor ever exists.

Metrics (detached sums, so they aggregate exactly across batches and ranks: sum them, then call
:func:`summarize_metrics`), all ``[K]`` tensors:

* ``loss_sum``, ``count``: loss sum (unweighted by position) and number of valid anchors per step;
* ``correct``: valid anchors where ``to_target_ids(argmax draft logits) == argmax`` of the verifier's
  logits over the FULL target vocab (a verifier argmax outside the draft vocab is always wrong);
* ``cond_correct``, ``cond_count``: the same among anchors where all steps ``j < k`` were valid and
  correct (conditional accuracy, ``cond_count[0] == count[0]``).

Expected acceptance length (teacher-forced estimate for chain drafting with greedy verification;
the verifier's bonus token counts): ``1 + sum_k prod_{j<=k} cond_acc_j`` with
``cond_acc_j = cond_correct_j / cond_count_j``; equal to one plus the mean run of leading correct
steps when every anchor has all K steps valid.

API::

    out = ttt_step(draft, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, loss_mask=mask,
                   target_head=lambda h: verifier.lm_head(verifier.model.norm(h)), steps=3, decay=0.8)
    out.loss.backward();  summarize_metrics(out.metrics)  # {"loss", "loss_0", "acc_0", "cond_acc_0", ...}

    ttt_step(draft, *, input_ids [B,T], aux_hidden_states [B,T,n_aux*Ht], loss_mask [B,T],
             last_hidden_state [B,T,Ht] | None = None, target_logits [B,T,V] | None = None,
             target_head: Callable[[Tensor [N,Ht]], Tensor [N,V]] | None = None,
             position_ids [B,T] | None = None (per-document positions from document_ids, else arange),
             document_ids [B,T] | None = None, steps: int = 3, decay: float = 1.0,
             attention: "sdpa" | "flex" | "auto" = "sdpa", chunk_size: int = 1024, checkpoint: bool = True,
             loss_normalizer [K] | None = None) -> TTTOutput(loss, loss_sums [K], metrics)

``attention="auto"`` picks flex on CUDA and sdpa elsewhere (torch has no flex backward on CPU).
Tiny CPU run (random draft and verifier head; prints the logged metrics)::

    python -c "import torch; from tiny_speculators.models.eagle3.model import Eagle3Draft; \
from tiny_speculators.models.ttt import ttt_step, summarize_metrics; \
d = Eagle3Draft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=100); w = torch.randn(100, 32); ids = torch.randint(0, 100, (2, 16)); \
out = ttt_step(d, input_ids=ids, aux_hidden_states=torch.randn(2, 16, 96), last_hidden_state=torch.randn(2, 16, 32), \
loss_mask=torch.ones(2, 16), target_head=lambda h: h @ w.T, steps=3, decay=0.8); \
out.loss.backward(); print(summarize_metrics(out.metrics, 0.8))"

Give either ``last_hidden_state`` + ``target_head``, precomputed ``target_logits``, or the verifier's top-k
(``target_topk_ids`` + ``target_topk_logits`` ``[B,T,k]``, from ``extract --layout topk``; see ``losses.py``).
Right padding is fine (give padded positions loss_mask 0); left padding is not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tiny_speculators.models.attention import (
    KVCache,
    PackedTTTMask,
    document_blocks,
    flex_available,
    ttt_block_mask,
    ttt_mask_dense,
)
from tiny_speculators.models.losses import DenseTargets, LossSpec, TopKTargets, chunked_step_losses
from tiny_speculators.models.metrics import METRIC_KEYS, chain_metrics, summarize, summarize_metrics

__all__ = ["METRIC_KEYS", "TTTObjective", "TTTOutput", "document_starts", "key_chunks", "positions_from_documents",
           "positions_of", "rollout", "step_counts", "summarize_metrics", "ttt_step", "valid_anchors"]


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable
    loss_sums: torch.Tensor  # [K] differentiable per-step sums of position weight x loss over valid anchors
    metrics: dict[str, torch.Tensor]  # detached [K] sums, keys METRIC_KEYS


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids (contiguous runs, as packing writes them) -> each position's document start."""
    b, t = document_ids.shape
    idx = torch.arange(t, device=document_ids.device).expand(b, t)
    start = torch.ones_like(document_ids, dtype=torch.bool)
    start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values


def key_chunks(lo: list[int], hi: list[int], max_queries: int, min_queries: int = 16,
               min_keys: int = 512) -> list[tuple[slice, tuple[int, int]]]:
    """Group queries ``j`` (in order) that may see keys ``lo[j] <= k < hi[j]`` into forwards: each forward's columns
    ``slice`` and the keys ``(lo, hi)`` it scores, the union of its queries' ranges. At most ``max_queries`` columns
    each; a new forward also begins where a query's keys start after every key the current one sees, once it holds
    ``min_queries`` columns and ``min_keys`` keys (in a packed row: a forward per run of documents, each scoring its
    own documents' keys). Below ``min_keys`` a forward's fixed cost outweighs the keys it would skip: at T 256 in 4
    documents a forward per document was 0.58-0.90x (P-EAGLE) and 0.70-1.00x (DFlash) one over the row, and at T
    2048 in 12 documents forwards of at least 512 keys are as fast as one per document, within the runs' noise
    (``benchmarks/document_keys.py``, dev/LOG.md session 32)."""
    chunks, first, c_lo, c_hi = [], 0, lo[0], hi[0]
    for j in range(1, len(lo)):
        if j - first == max_queries or (j - first >= min_queries and lo[j] >= c_hi and c_hi - c_lo >= min_keys):
            chunks.append((slice(first, j), (c_lo, c_hi)))
            first, c_lo, c_hi = j, lo[j], hi[j]
        else:
            c_lo, c_hi = min(c_lo, lo[j]), max(c_hi, hi[j])
    chunks.append((slice(first, len(lo)), (c_lo, c_hi)))
    return chunks


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids -> positions restarting at 0 at each document start."""
    t = document_ids.shape[1]
    return torch.arange(t, device=document_ids.device) - document_starts(document_ids)


def positions_of(input_ids: torch.Tensor, document_ids: torch.Tensor | None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` RoPE positions of a batch: ``position_ids`` when given, else per-document positions when the rows are
    packed (``document_ids``), else ``0..T-1`` in every row."""
    if position_ids is not None:
        return position_ids
    if document_ids is not None:
        return positions_from_documents(document_ids)
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).expand(b, t)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]``; the last ``n`` columns are ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def valid_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor | None, steps: int) -> torch.Tensor:
    """``[K, B, T]`` bool: step k at anchor t has a target (see module docstring)."""
    out = []
    for k in range(steps):
        ok = shift_left(loss_mask.bool(), k + 2, fill=False)
        if document_ids is not None:
            ok = ok & (shift_left(document_ids, k + 2, fill=-1) == document_ids)
        out.append(ok)
    return torch.stack(out)


def resolve_attention(attention: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA (when torch has it), ``sdpa`` elsewhere; checks flex can train here."""
    if attention == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "sdpa"
    if attention not in ("sdpa", "flex"):
        raise ValueError(f"attention must be 'sdpa', 'flex' or 'auto', got {attention!r}")
    if attention == "flex":
        if not flex_available():
            raise ValueError("attention='flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        if device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError("torch's flex-attention has no backward on CPU; train with attention='sdpa'")
    return attention


def rollout(draft: nn.Module, input_ids, aux_hidden_states, position_ids, document_ids=None, *, steps: int,
            attention: Literal["sdpa", "flex", "auto"] = "sdpa") -> list[torch.Tensor]:
    """Run the K TTT steps; returns the K pre-norm outputs ``[B, T, H]`` (indexed by anchor)."""
    b, t = input_ids.shape
    attention = resolve_attention(attention, input_ids.device)
    cache = KVCache()
    hidden = draft.fuse(aux_hidden_states)  # (B, T, H)
    outs = []
    blocks = document_blocks(document_ids) if document_ids is not None and attention == "sdpa" else None
    window = getattr(draft, "kwargs", {}).get("sliding_window")  # a sliding-window draft's masks carry it
    for k in range(steps):
        if attention == "flex":
            mask = ttt_block_mask(k, t, document_ids, batch_size=b, device=input_ids.device, window=window)
        elif blocks is not None:  # packed documents: attention document by document (no [T, (k+1)T] mask)
            mask = PackedTTTMask(k, *blocks, window=window)
        else:
            mask = ttt_mask_dense(k, t, document_ids, batch_size=b, device=input_ids.device, window=window)
        ids_k = shift_left(input_ids, k + 1)  # x_{t+k+1}
        out = draft(ids_k, hidden, position_ids + k, attention_mask=mask, cache=cache, logits=False)
        hidden = out.hidden_states
        outs.append(hidden)
    return outs


def ttt_step(
    draft: nn.Module,
    *,
    input_ids: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    loss_mask: torch.Tensor,
    last_hidden_state: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
    target_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    target_topk_ids: torch.Tensor | None = None,
    target_topk_logits: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    steps: int = 3,
    decay: float = 1.0,
    attention: Literal["sdpa", "flex", "auto"] = "sdpa",
    chunk_size: int = 1024,
    checkpoint: bool = True,
    loss_normalizer: torch.Tensor | None = None,
    loss: LossSpec | None = None,
) -> TTTOutput:
    """Roll the draft out ``steps`` times and compute the position-weighted loss (``loss``, default forward KL with
    ``decay``; ``models/losses.py``) and metric sums (module docstring)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    given = [target_logits is not None, last_hidden_state is not None and target_head is not None,
             target_topk_ids is not None and target_topk_logits is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of: target_logits; last_hidden_state and target_head; "
                         "target_topk_ids and target_topk_logits")
    b, t = input_ids.shape
    device = input_ids.device
    position_ids = positions_of(input_ids, document_ids, position_ids)
    outs = rollout(draft, input_ids, aux_hidden_states, position_ids, document_ids, steps=steps,
                   attention=attention)
    valid = valid_anchors(loss_mask, document_ids, steps).reshape(steps, b * t)  # (K, N) by anchor
    if target_topk_ids is not None:
        targets = TopKTargets(target_topk_ids.reshape(b * t, -1), target_topk_logits.reshape(b * t, -1),
                              vocab_size=draft.t2d.numel())
    elif target_logits is not None:
        targets = DenseTargets(target_logits.reshape(b * t, -1))
    else:
        targets = DenseTargets(last_hidden_state.reshape(b * t, -1), target_head)
    out = chunked_step_losses(draft, [o.reshape(b * t, -1) for o in outs], valid, targets,
                              (loss or LossSpec()).resolved("kl"),
                              decay=decay, chunk_size=chunk_size, checkpoint=checkpoint)
    correct = out.correct
    counts = valid.sum(dim=1)  # (K,)
    denom = loss_normalizer.to(device).float() if loss_normalizer is not None else counts.clamp(min=1).float()
    total = (out.weighted / denom.clamp(min=1e-12)).sum()

    cond_correct, cond_count = chain_metrics(valid, correct)
    metrics = {
        "loss_sum": out.sums,
        "count": counts,
        "correct": correct.sum(dim=1),
        "cond_correct": cond_correct,
        "cond_count": cond_count,
    }
    return TTTOutput(loss=total, loss_sums=out.weighted, metrics=metrics)


def step_counts(batch: dict[str, Any], steps: int) -> torch.Tensor:
    """``[K]`` number of anchors with a target at each TTT step (the loss normalizer's local part)."""
    return valid_anchors(batch["loss_mask"], batch.get("document_ids"), steps).sum(dim=(1, 2))


class TTTObjective(nn.Module):
    """What every objective trained by the TTT rollout shares: the draft (the only registered submodule), the frozen
    verifier head outside the module tree, the rollout call, and per-step counts, stats and summary. A family's
    ``forward`` says what the rollout reads (:meth:`rollout`).

    DDP and FSDP2 hook a module's ``forward``; ``ttt_step`` calls ``draft.fuse``, ``draft(...)`` K times and
    ``draft.compute_logits`` per chunk (also during backward recomputation), so the wrapper must be around all of it.
    Loss groups are the K steps: ``loss_counts`` gives the local number of anchors with a target per step, the loop
    sums them over the optimizer step and passes them back as ``loss_normalizer``.
    """

    def __init__(self, draft: nn.Module, target_head: nn.Module, steps: int, decay: float, attention: str,
                 chunk_size: int = 1024, checkpoint: bool = True, loss: LossSpec | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.loss = (loss or LossSpec()).resolved("kl")  # the loss terms and position weights (models/losses.py)
        self._head = (target_head,)  # a tuple hides it from parameters()/state_dict()/DDP broadcast
        self.steps, self.decay, self.attention, self.chunk_size = steps, decay, attention, chunk_size
        self.checkpoint = checkpoint  # recompute draft logits blocks in backward (ttt_step's memory saver)

    def rollout(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None, aux_hidden_states: torch.Tensor,
                **targets: Any) -> TTTOutput:
        """:func:`ttt_step` on ``batch`` with the draft reading ``aux_hidden_states`` and the verifier's ``targets``
        (``last_hidden_state`` + ``target_head``, or ``target_topk_ids`` + ``target_topk_logits``)."""
        return ttt_step(
            self.draft, input_ids=batch["input_ids"], aux_hidden_states=aux_hidden_states,
            loss_mask=batch["loss_mask"], **targets,
            position_ids=batch["position_ids"], document_ids=batch.get("document_ids"), steps=self.steps,
            decay=self.decay, attention=self.attention, chunk_size=self.chunk_size, checkpoint=self.checkpoint,
            loss_normalizer=loss_normalizer, loss=self.loss,
        )

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[K]`` number of anchors with a target at each TTT step (the loss normalizer's local part)."""
        return step_counts(batch, self.steps)

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(self.steps, dtype=torch.float64, device=device) for key in METRIC_KEYS}

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return summarize(stats, self.decay)
