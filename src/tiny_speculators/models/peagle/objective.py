"""P-EAGLE's training objective: every position at depth 0, a sampled share of anchors at each deeper depth
(COD sampling), all in the attention pattern vLLM's parallel drafting sees, and KL to the verifier per depth.

Coordinates (as in EAGLE-3's ``ttt.py``): the element (anchor ``a``, depth ``d``) sits at position
``pos[a] + d`` and predicts ``x_{a+d+2}``; its target is the verifier's distribution at ``a+d+1``.

* depth 0, every anchor ``a``: token ``x_{a+1}``, hidden ``fuse(aux[a])`` (the real slots);
* depth ``d >= 1``, sampled anchors: token ``mask_token_id``, hidden ``mask_state()`` (the mask slots).

Attention: an element sees the depth-0 elements of its document at anchors ``<= a`` and its own chain's
depths ``1..d`` (what causal attention over vLLM's cache gives at inference). Depth 0 runs batched (causal,
or document by document when packed); each deeper depth runs on the flattened batch with an explicit mask, a
forward per run of documents over only those documents' keys (``key_chunks``: 1.37x a step over every key at
T 2048 in 12 documents, ``benchmarks/document_keys.py``).

COD sampling (training only): ``S_0`` = all anchors; ``S_d`` is a random subset of ``S_{d-1}`` (restricted to
anchors with a target at depth d) of size ``round(n_0 * max(r**d, r_min))``, ``n_0`` the valid anchors at
depth 0, so chains are prefixes of depths. Sampling uses torch's global RNG (checkpointed, so resume is
exact) and happens in :meth:`PEagleObjective.loss_counts`, which stores the choice in the batch for
``forward``. Validation (``eval()``) keeps every anchor at every depth.

Loss: per depth, the run's loss terms (``models/losses.py``, forward KL by default) summed over its elements
(chunked, as EAGLE-3's); the total is ``sum_d decay**d * loss_d / count_d`` (or D-PACE's weights) with counts
over the whole optimizer step, i.e. each depth's mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.models.attention import KVCache, PackedTTTMask, document_blocks
from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.losses import DenseTargets, LossSpec, TopKTargets, chunked_step_losses
from tiny_speculators.models.metrics import METRIC_KEYS, chain_metrics, summarize
from tiny_speculators.models.peagle.model import PEagleDraft
from tiny_speculators.models.ttt import document_starts, key_chunks, positions_of, valid_anchors

KEEP = "_peagle_keep"  # batch key: the sampled anchors per depth (flat indices), set by loss_counts

__all__ = ["PEagleObjective", "cod_sample", "depth_mask", "rollout"]


def cod_sample(valid: torch.Tensor, ratio: float, ratio_min: float,
               generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Nested anchor sets per depth from ``valid [K, N]`` (flat anchors); ``S_0`` = all anchors (sorted)."""
    steps, n = valid.shape
    n0 = int(valid[0].sum())
    sets = [torch.arange(n, device=valid.device)]
    for d in range(1, steps):
        pool = sets[-1][valid[d, sets[-1]]]
        size = min(len(pool), round(n0 * max(ratio**d, ratio_min)))
        pick = torch.randperm(len(pool), generator=generator, device="cpu")[:size].to(pool.device)
        sets.append(pool[pick].sort().values)
    return sets


def all_anchors(valid: torch.Tensor) -> list[torch.Tensor]:
    """Every anchor at every depth where the chain has targets (validation): nested like :func:`cod_sample`."""
    n = valid.shape[1]
    sets = [torch.arange(n, device=valid.device)]
    for d in range(1, valid.shape[0]):
        sets.append(sets[-1][valid[d, sets[-1]]])
    return sets


def depth_mask(anchors: torch.Tensor, chains: list[torch.Tensor], group: torch.Tensor,
               keys: tuple[int, int] | None = None) -> torch.Tensor:
    """bool ``[1, 1, n, K + sum(len(chains))]``: queries at ``anchors`` see depth-0 keys of their group (row and
    document) at anchors ``<=`` theirs, among the keys ``lo <= k < hi`` (default: all ``N``), and their own element
    in each of ``chains`` (depths 1..d, sorted sets, each holding every one of ``anchors``)."""
    lo, hi = keys if keys is not None else (0, group.numel())
    key = torch.arange(lo, hi, device=anchors.device)
    depth0 = (group[key][None, :] == group[anchors][:, None]) & (key[None, :] <= anchors[:, None])  # (n, K)
    own = []
    rows = torch.arange(anchors.numel(), device=anchors.device)
    for chain in chains:
        block = torch.zeros(anchors.numel(), chain.numel(), dtype=torch.bool, device=anchors.device)
        block[rows, torch.searchsorted(chain, anchors)] = True
        own.append(block)
    return torch.cat([depth0, *own], dim=1)[None, None]


def rollout(draft: PEagleDraft, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor,
            position_ids: torch.Tensor, document_ids: torch.Tensor | None,
            sets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pre-norm outputs per depth, each ``[B*T, H]`` with rows at that depth's anchors (zeros elsewhere)."""
    b, t = input_ids.shape
    n = b * t
    caches = [KVCache() for _ in draft.layers]
    # depth 0: real slots, batched; token x_{a+1} at anchor a (shift_left fills the row end with 0, never a target)
    ids0 = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, 1)], dim=1)
    mask0 = PackedTTTMask(0, *document_blocks(document_ids)) if document_ids is not None else None
    out0 = draft(ids0, draft.fuse(aux_hidden_states), position_ids, attention_mask=mask0, caches=caches,
                 logits=False).hidden_states  # (B, T, H)
    outs = [out0.reshape(n, -1)]
    if len(sets) == 1:
        return outs
    # deeper depths on the flattened batch: per layer, the keys/values of depth 0 (every row), then of each depth
    kv = [[tuple(x.transpose(0, 1).reshape(1, x.shape[1], n, x.shape[-1]) for x in (c.k, c.v))]  # (1, Hkv, N, D)
          for c in caches]
    group = torch.arange(b, device=input_ids.device)[:, None].expand(b, t) * (t + 1)
    if document_ids is not None:
        group = group + document_ids
    group = group.reshape(n)
    starts = document_starts(group[None])[0]
    positions = position_ids.reshape(n)
    mask_state = draft.mask_state()  # (H,)
    for d in range(1, len(sets)):
        anchors = sets[d]
        hidden = outs[0].new_zeros(n, outs[0].shape[-1])
        if anchors.numel():
            out, new_kv = _depth_forward(draft, mask_state, anchors, sets[1:d], kv, group, starts,
                                         positions[anchors] + d)
            hidden = hidden.index_put((anchors,), out)
            for layer, (k, v) in zip(kv, new_kv, strict=True):
                layer.append((k, v))
        else:  # keep mask_hidden in the graph (DDP/FSDP expect every parameter to take part); the sets are nested,
            hidden = hidden + 0.0 * mask_state.sum()  # so no deeper depth has anchors (or reads kv) either
        outs.append(hidden)
    return outs


def _depth_forward(draft: PEagleDraft, mask_state: torch.Tensor, anchors: torch.Tensor, chains: list[torch.Tensor],
                   kv: list[list[tuple[torch.Tensor, torch.Tensor]]], group: torch.Tensor, starts: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The mask slots at ``anchors`` (one depth): outputs ``[n, H]`` and each layer's new keys/values. A forward per
    document run (:func:`key_chunks`), each over the depth-0 keys of its documents up to its last anchor and its
    chains' elements of the shallower depths (``chains``), not over every key of the flattened batch."""
    outs, new = [], [([], []) for _ in kv]
    for columns, (lo, hi) in key_chunks(starts[anchors].tolist(), (anchors + 1).tolist(), anchors.numel()):
        a = anchors[columns]
        spans = [slice(int(torch.searchsorted(c, a[0])), int(torch.searchsorted(c, a[-1])) + 1) for c in chains]
        caches = [_keys_of(layer, (lo, hi), spans) for layer in kv]
        m = depth_mask(a, [c[s] for c, s in zip(chains, spans, strict=True)] + [a], group, keys=(lo, hi))
        ids = torch.full((1, a.numel()), draft.mask_token_id, dtype=torch.long, device=a.device)
        outs.append(draft(ids, mask_state.expand(1, a.numel(), -1), positions[columns][None], attention_mask=m,
                          caches=caches, logits=False).hidden_states[0])  # (n_chunk, H)
        for (ks, vs), cache in zip(new, caches, strict=True):
            ks.append(cache.k[:, :, -a.numel():])
            vs.append(cache.v[:, :, -a.numel():])
    return torch.cat(outs), [(torch.cat(ks, dim=2), torch.cat(vs, dim=2)) for ks, vs in new]


def _keys_of(layer: list[tuple[torch.Tensor, torch.Tensor]], keys: tuple[int, int], spans: list[slice]) -> KVCache:
    """A cache of one layer's depth-0 keys/values ``lo:hi`` and each deeper depth's ``spans``, in that order."""
    (k0, v0), *deeper = layer
    lo, hi = keys
    cache = KVCache()
    cache.append(torch.cat([k0[:, :, lo:hi], *(k[:, :, s] for (k, _), s in zip(deeper, spans, strict=True))], dim=2),
                 torch.cat([v0[:, :, lo:hi], *(v[:, :, s] for (_, v), s in zip(deeper, spans, strict=True))], dim=2))
    return cache


class PEagleObjective(nn.Module):
    """``forward(batch, loss_normalizer) -> StepOutput`` for a :class:`PEagleDraft` (the only registered submodule)."""

    def __init__(self, draft: PEagleDraft, target_head: nn.Module, depths: int, ratio: float, ratio_min: float,
                 decay: float = 1.0, chunk_size: int = 1024, checkpoint: bool = True,
                 loss: LossSpec | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.loss = (loss or LossSpec()).resolved("kl")
        self._head = (target_head,)  # hidden from parameters()/state_dict()/DDP broadcast
        self.depths, self.ratio, self.ratio_min, self.decay = depths, ratio, ratio_min, decay
        self.chunk_size, self.checkpoint = chunk_size, checkpoint

    def _valid(self, batch: dict[str, Any]) -> torch.Tensor:
        b, t = batch["input_ids"].shape
        return valid_anchors(batch["loss_mask"], batch.get("document_ids"), self.depths).reshape(self.depths, b * t)

    def _sets(self, batch: dict[str, Any], valid: torch.Tensor) -> list[torch.Tensor]:
        if not self.training:
            return all_anchors(valid)
        if KEEP not in batch:
            batch[KEEP] = cod_sample(valid, self.ratio, self.ratio_min)
        return batch[KEEP]

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[K]`` elements with a target per depth (samples the COD anchors for the coming forward)."""
        valid = self._valid(batch)
        sets = self._sets(batch, valid)
        return torch.stack([valid[d, s].sum() for d, s in enumerate(sets)])

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        ids = batch["input_ids"]
        b, t = ids.shape
        doc = batch.get("document_ids")
        pos = positions_of(ids, doc, batch.get("position_ids"))
        valid_all = self._valid(batch)
        sets = self._sets(batch, valid_all)
        outs = rollout(self.draft, ids, batch["aux_hidden_states"], pos, doc, sets)
        valid = torch.zeros_like(valid_all)
        for d, s in enumerate(sets):
            valid[d, s] = valid_all[d, s]
        if "target_topk_ids" in batch:
            targets = TopKTargets(batch["target_topk_ids"].reshape(b * t, -1),
                                  batch["target_topk_logits"].reshape(b * t, -1), vocab_size=self.draft.t2d.numel())
        else:
            targets = DenseTargets(batch["last_hidden_state"].reshape(b * t, -1), self._head[0])
        out = chunked_step_losses(self.draft, outs, valid, targets, self.loss, decay=self.decay,
                                  chunk_size=self.chunk_size, checkpoint=self.checkpoint)
        correct = out.correct
        counts = valid.sum(dim=1)
        denom = loss_normalizer.to(ids.device).float() if loss_normalizer is not None else counts.clamp(min=1).float()
        loss = (out.weighted / denom.clamp(min=1e-12)).sum()
        cond_correct, cond_count = chain_metrics(valid, correct)
        metrics = {"loss_sum": out.sums, "count": counts, "correct": correct.sum(dim=1),
                   "cond_correct": cond_correct, "cond_count": cond_count}
        return StepOutput(loss=loss, metrics=metrics)

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(self.depths, dtype=torch.float64, device=device) for key in METRIC_KEYS}

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return summarize(stats, self.decay)
