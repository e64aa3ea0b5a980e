"""The draft's training losses, shared by every family: per-row divergences between the verifier's distribution
``p`` and the draft's ``q`` (both on the draft vocab), combined with weights, and the per-position weights.

A :class:`LossSpec` names the terms and their weights (``{kl: 1.0}``, ``{ce: 0.1, tv: 0.9}``):

* ``kl``: forward KL(p || q) (the default, EAGLE-3's).
* ``rkl``: reverse KL(q || p); ``log p`` is floored at ``LOGP_FLOOR`` (top-k layouts store no mass outside the
  verifier's top k, so the floor keeps it finite and still pushes draft mass onto the verifier's support).
* ``jsd``: Jensen-Shannon divergence, ``KL(p || m) / 2 + KL(q || m) / 2`` with ``m = (p + q) / 2``.
* ``tv``: total variation ``1 - sum_v min(p_v, q_v)`` (one minus the acceptance rate ``alpha`` of speculative
  sampling).
* ``ce``: cross-entropy to the verifier's argmax over its FULL vocab (0 where that token is outside the draft vocab).
* ``lk``: the LK hybrid (arXiv 2602.23881, sec. 4.4): ``lam * KL + (1 - lam) * TV`` with ``lam = exp(-3 alpha)``,
  ``alpha`` the mean acceptance rate ``sum_v min(p_v, q_v)`` over the position group's rows in this forward (one
  detached weight per TTT step / depth / block slot, as the paper and NVIDIA ModelOpt do; speculators uses one
  per row). Being a batch statistic, it makes grad accumulation only approximately equal a bigger batch.

Rows whose verifier distribution is empty (a top-k row with no draft token) add nothing to any term but ``ce``.

Per-position weights: ``decay`` (each family's fixed schedule: ``decay**k``), ``dpace`` (D-PACE, arXiv
2605.18810): ``w_k = sum_{j>=k} prod_{i<=j} ((1 - a) q_i + a)`` along each chain (an anchor's TTT steps, a
block's slots), ``q_i = exp(-ce_i)`` the draft's probability of the verifier's token, ``a = dpace_alpha``, no
gradient through the weights: the derivative of the smoothed expected acceptance length by each ``log q_k``; or
``aligned`` (GRIFFIN's token-alignable training, arXiv 2502.11018, in its chain-decoding form): the fixed schedule,
times 0 where the draft's argmax missed the verifier's at an earlier position of the same chain. Decoding never
reaches such a position (the chain was rejected before it), and a TTT step there reads features computed from a
wrong guess; the mask leaves the draft's capacity to the positions decoding can accept.

Memory: :func:`chunked_step_losses` walks target rows in chunks like EAGLE-3's KL always did: each chunk's verifier
distribution once, each (chunk, step) draft-logit block recomputed in backward, so no ``[K, N, V]`` tensor exists.
With top-k targets and only ``kl`` / ``ce`` terms, the verifier's side stays sparse (:class:`SparseLogp`: its k
tokens per row): no ``[c, V]`` target tensor and no elementwise pass over one.

    spec = LossSpec.from_mapping({"ce": 0.1, "tv": 0.9})
    out = chunked_step_losses(draft, hidden, valid, targets, spec, decay=0.8)   # out.weighted [K], out.correct
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as grad_checkpoint

LOSSES = ("kl", "rkl", "jsd", "tv", "ce", "lk")
POSITION_WEIGHTS = ("decay", "dpace", "aligned")
LK_ETA = 3.0
LOGP_FLOOR = -30.0

__all__ = ["LOSSES", "POSITION_WEIGHTS", "DenseTargets", "LossSpec", "SparseLogp", "StepLosses", "TargetSource",
           "TopKTargets", "all_before", "chunked_step_losses", "combine_terms", "dpace_weights", "row_columns",
           "rowwise_losses"]
SPARSE_COLUMNS = frozenset({"kl", "ce"})  # the columns a sparse (top-k) verifier distribution can give


@dataclass(frozen=True)
class LossSpec:
    """Which loss terms with which weights, and how positions are weighted (module docstring)."""

    terms: tuple[tuple[str, float], ...] | None = None  # None: the family's own default (resolved())
    position_weights: Literal["decay", "dpace", "aligned"] = "decay"
    dpace_alpha: float = 0.5

    def __post_init__(self) -> None:
        names = [n for n, _ in self.terms or ()]
        unknown = sorted(set(names) - set(LOSSES))
        if unknown:
            raise ValueError(f"unknown loss {', '.join(unknown)} (known: {', '.join(LOSSES)})")
        if len(set(names)) != len(names):
            raise ValueError(f"a loss is named twice in {names}")
        weights = [w for _, w in self.terms or ()]
        if self.terms is not None and (any(w < 0 or not math.isfinite(w) for w in weights) or not any(weights)):
            raise ValueError(f"loss weights must be finite, >= 0 and not all 0, got {dict(self.terms)}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"position_weights must be one of {', '.join(POSITION_WEIGHTS)}, "
                             f"got {self.position_weights!r}")
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")

    @classmethod
    def from_mapping(cls, loss: Mapping[str, float] | None, position_weights: str = "decay",
                     dpace_alpha: float = 0.5) -> LossSpec:
        terms = tuple((str(k), float(v)) for k, v in loss.items()) if loss else None
        return cls(terms=terms, position_weights=position_weights, dpace_alpha=dpace_alpha)

    def resolved(self, default: str) -> LossSpec:
        """This spec with the family's default term (``kl``; DFlash: ``ce``) when it names none."""
        if self.terms is not None:
            return self
        return LossSpec(terms=((default, 1.0),), position_weights=self.position_weights, dpace_alpha=self.dpace_alpha)

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-row quantities to compute: each term's own, ``lk`` -> kl and tv, D-PACE -> ce."""
        if self.terms is None:
            raise ValueError("resolve the loss spec against the family's default first (LossSpec.resolved)")
        need = []
        for name, _ in self.terms:
            need += ["kl", "tv"] if name == "lk" else [name]
        if self.position_weights == "dpace":
            need.append("ce")
        return tuple(dict.fromkeys(need))

    def record(self) -> dict:
        return {"loss": dict(self.terms) if self.terms else None, "position_weights": self.position_weights,
                "dpace_alpha": self.dpace_alpha}


@dataclass(frozen=True)
class SparseLogp:
    """The verifier's draft-vocab log-probs of its top-k tokens only: ``ids [c, k]`` draft ids (-1: outside the draft
    vocab) and ``logp [c, k]`` fp32, renormalized over the kept tokens (``-inf`` where not kept); every other draft
    token has probability 0. Row-indexable like the dense ``[c, Vd]`` tensor it stands for."""

    ids: torch.Tensor
    logp: torch.Tensor

    def __getitem__(self, rows: torch.Tensor) -> SparseLogp:
        return SparseLogp(self.ids[rows], self.logp[rows])


def has_mass(target_logp: torch.Tensor | SparseLogp) -> torch.Tensor:
    """``[c]`` rows where the verifier has mass on the draft vocab."""
    if isinstance(target_logp, SparseLogp):
        return (target_logp.ids >= 0).any(dim=-1)
    return torch.isfinite(target_logp).any(dim=-1)


class TargetSource(Protocol):
    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor,
              sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor | SparseLogp]:
        """Rows ``start:stop`` -> (verifier argmax over the full vocab ``[c]``, log-probs on the draft vocab
        ``[c, Vd]`` (fp32), where ``draft_cols[i]`` is draft id i's target id). ``sparse``: a :class:`SparseLogp`
        instead where the source has one (top-k); a dense source ignores it."""
        ...

    def rows(self, index: torch.Tensor, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for the rows ``index [c]``."""
        ...


class DenseTargets:
    """All the verifier's logits: ``source [N, V]`` logits, or ``source [N, Ht]`` last hidden states + ``head``."""

    def __init__(self, source: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.source, self.head = source, head

    def _dist(self, rows: torch.Tensor, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (rows if self.head is None else self.head(rows)).float()  # (c, V)
        return logits.argmax(dim=-1), F.log_softmax(logits[:, draft_cols], dim=-1)

    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor,
              sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dist(self.source[start:stop], draft_cols)

    def rows(self, index: torch.Tensor, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dist(self.source[index], draft_cols)


class TopKTargets:
    """The verifier's top-k logits: ``ids [N, k]`` target ids and ``logits [N, k]``. The argmax over the full vocab
    is exact; the draft-vocab distribution is the top-k tokens in the draft vocab, renormalized (all ``-inf`` when
    none is)."""

    def __init__(self, ids: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> None:
        self.ids, self.logits, self.vocab_size = ids, logits, vocab_size
        self._draft_index: torch.Tensor | None = None

    def _lookup(self, ids: torch.Tensor, logits: torch.Tensor,
                draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(argmax over the full vocab ``[c]``, the top-k's draft ids ``[c, k]`` (-1 outside), fp32 logits)."""
        if self._draft_index is None:
            self._draft_index = draft_index(draft_cols, self.vocab_size)
        ids, logits = ids.long(), logits.float()
        argmax = ids.gather(1, logits.argmax(dim=1, keepdim=True)).squeeze(1)
        return argmax, self._draft_index[ids], logits

    def _dist(self, ids: torch.Tensor, logits: torch.Tensor,
              draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        argmax, draft_ids, logits = self._lookup(ids, logits, draft_cols)  # draft_ids: (c, k)
        keep = draft_ids >= 0
        dense = logits.new_full((ids.shape[0], draft_cols.numel()), float("-inf"))
        row = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        dense[row[keep], draft_ids[keep]] = logits[keep]
        logp = F.log_softmax(dense, dim=-1)
        empty = ~keep.any(dim=1)  # no draft token in the top-k: all -inf (log_softmax gave nan)
        return argmax, logp.masked_fill(empty[:, None], float("-inf"))

    def _sparse(self, ids: torch.Tensor, logits: torch.Tensor,
                draft_cols: torch.Tensor) -> tuple[torch.Tensor, SparseLogp]:
        argmax, draft_ids, logits = self._lookup(ids, logits, draft_cols)  # draft_ids: (c, k)
        kept = logits.masked_fill(draft_ids < 0, float("-inf"))
        norm = torch.logsumexp(kept, dim=1, keepdim=True)  # (c, 1), -inf for a row with no draft token
        logp = torch.where(draft_ids >= 0, kept - norm, float("-inf"))  # (c, k)
        return argmax, SparseLogp(draft_ids, logp)

    def chunk(self, start: int, stop: int, draft_cols: torch.Tensor,
              sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor | SparseLogp]:
        if sparse:
            return self._sparse(self.ids[start:stop], self.logits[start:stop], draft_cols)
        return self._dist(self.ids[start:stop], self.logits[start:stop], draft_cols)

    def rows(self, index: torch.Tensor, draft_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dist(self.ids[index], self.logits[index], draft_cols)


def draft_index(draft_cols: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` target id -> draft id, -1 outside the draft vocab."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_cols.device)
    index[draft_cols] = torch.arange(draft_cols.numel(), device=draft_cols.device)
    return index


def row_columns(logq: torch.Tensor, target_logp: torch.Tensor | SparseLogp, target_draft_id: torch.Tensor,
                columns: tuple[str, ...]) -> torch.Tensor:
    """``[n, C]`` per-row values of ``columns`` from draft log-probs ``logq [n, Vd]``, the verifier's draft-vocab
    log-probs ``target_logp [n, Vd]`` (``-inf`` where it has no mass) and its argmax as a draft id ``[n]`` (-1: outside
    the draft vocab). A :class:`SparseLogp` gives the same ``kl`` and ``ce`` from its k tokens per row."""
    if isinstance(target_logp, SparseLogp):
        return _sparse_columns(logq, target_logp, target_draft_id, columns)
    p = target_logp.exp()
    has = (p > 0).any(dim=-1)
    zero = torch.zeros_like(logq)
    out = []
    for name in columns:
        if name == "kl":
            v = torch.where(p > 0, p * (target_logp - logq), zero).sum(-1)
        elif name == "rkl":
            v = (logq.exp() * (logq - target_logp.clamp(min=LOGP_FLOOR))).sum(-1)
        elif name == "jsd":
            logm = torch.logaddexp(target_logp, logq) - math.log(2.0)
            forward = torch.where(p > 0, p * (target_logp - logm), zero).sum(-1)
            v = 0.5 * (forward + (logq.exp() * (logq - logm)).sum(-1))
        elif name == "tv":
            v = 1.0 - torch.minimum(p, logq.exp()).sum(-1)
        elif name == "ce":
            picked = logq.gather(1, target_draft_id.clamp(min=0)[:, None]).squeeze(1)
            out.append(torch.where(target_draft_id >= 0, -picked, picked.new_zeros(())))
            continue
        else:
            raise ValueError(f"unknown loss column {name!r}")
        out.append(torch.where(has, v, v.new_zeros(())))
    return torch.stack(out, dim=1)


def _sparse_columns(logq: torch.Tensor, target: SparseLogp, target_draft_id: torch.Tensor,
                    columns: tuple[str, ...]) -> torch.Tensor:
    kept = target.ids >= 0  # (n, k)
    out = []
    for name in columns:
        if name == "kl":  # sum over the verifier's kept tokens of p (log p - log q); the others have p = 0
            picked = logq.gather(1, target.ids.clamp(min=0))  # (n, k)
            p = torch.where(kept, target.logp.exp(), 0.0)
            v = (p * (torch.where(kept, target.logp, 0.0) - picked)).sum(-1)
            out.append(torch.where(kept.any(dim=-1), v, v.new_zeros(())))
        elif name == "ce":
            picked = logq.gather(1, target_draft_id.clamp(min=0)[:, None]).squeeze(1)
            out.append(torch.where(target_draft_id >= 0, -picked, picked.new_zeros(())))
        else:
            raise ValueError(f"loss column {name!r} needs the dense verifier distribution")
    return torch.stack(out, dim=1)


def combine_terms(spec: LossSpec, cols: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """``[n]`` weighted sum of the spec's terms for one position group (its rows ``cols [n, C]``, ``has [n]`` rows with
    a verifier distribution); the LK weight uses this group's mean acceptance rate, detached."""
    index = {c: i for i, c in enumerate(spec.columns)}
    total = cols.new_zeros(cols.shape[0])
    for name, weight in spec.terms:
        if name == "lk":
            kl, tv = cols[:, index["kl"]], cols[:, index["tv"]]
            alpha = (1.0 - tv.detach())[has].mean() if bool(has.any()) else tv.new_zeros(())
            lam = torch.exp(-LK_ETA * alpha)
            value = lam * kl + (1.0 - lam) * tv
        else:
            value = cols[:, index[name]]
        total = total + weight * value
    return total


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights ``[M, L]`` of chains with per-position cross-entropies ``ce [M, L]`` (valid ``[M, L]``)."""
    with torch.no_grad():
        m = valid.float()
        smooth = torch.where(valid, (1 - alpha) * torch.exp(-ce.detach().float()) + alpha, torch.ones_like(m))
        prefix = torch.cumprod(smooth, dim=1)
        return torch.flip(torch.cumsum(torch.flip(prefix * m, [1]), 1), [1]) * m


def all_before(correct: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """True where every earlier position along ``dim`` of the chain was predicted right (positions that are not
    ``valid`` count as right): the positions decoding reaches, and where ``aligned`` weights keep the loss."""
    chain = torch.cumprod((correct | ~valid).int(), dim=dim).bool()
    first = torch.ones_like(chain.narrow(dim, 0, 1))
    return torch.cat([first, chain.narrow(dim, 0, chain.shape[dim] - 1)], dim=dim)


def _block(draft, hidden: torch.Tensor, target_logp: torch.Tensor, target_draft_id: torch.Tensor,
           columns: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    logq = F.log_softmax(draft.compute_logits(hidden).float(), dim=-1)  # (n, Vd)
    return row_columns(logq, target_logp, target_draft_id, columns), logq.argmax(dim=-1)


def _run_block(draft, h, tlp, tid, columns, checkpoint: bool):
    if checkpoint and torch.is_grad_enabled():
        return grad_checkpoint(_block, draft, h, tlp, tid, columns, use_reentrant=False)
    return _block(draft, h, tlp, tid, columns)


def _draft_cols(draft, device) -> torch.Tensor:
    return torch.arange(draft.draft_vocab_size, device=device) + draft.d2t  # target id per draft id


@dataclass
class StepLosses:
    weighted: torch.Tensor  # [K] differentiable: sum over rows of position weight x combined loss
    sums: torch.Tensor  # [K] detached: sum over rows of the combined loss (unweighted)
    correct: torch.Tensor  # [K, N] bool: draft argmax == verifier argmax (False where not valid)


def chunked_step_losses(draft, hidden: list[torch.Tensor], valid: torch.Tensor, targets: TargetSource,
                        spec: LossSpec, *, decay: float = 1.0, chunk_size: int = 1024,
                        checkpoint: bool = True) -> StepLosses:
    """Per-step losses of a K-step chain (EAGLE-3's TTT, P-EAGLE's depths, MTP's steps).

    Args:
        draft: has ``compute_logits``, ``draft_vocab_size``, ``d2t`` and ``to_target_ids``.
        hidden: K pre-norm draft outputs, each ``[N, H]`` (flattened ``B*T`` anchors).
        valid: ``[K, N]`` bool, step k at anchor n has a target (its target row is ``n + k + 1``).
        targets: the verifier's distribution per row (:class:`DenseTargets` or :class:`TopKTargets`).
        decay: step k's weight ``decay**k`` when ``spec.position_weights`` is ``decay`` (``aligned``: the same, masked).
    """
    steps, n = valid.shape
    device = valid.device
    cols_of_draft = _draft_cols(draft, device)
    index = draft_index(cols_of_draft, draft.t2d.numel())
    columns = spec.columns
    sparse = set(columns) <= SPARSE_COLUMNS  # top-k targets then stay [c, k] (a dense source ignores it)
    parts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(steps)]
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
            target_argmax, target_logp = targets.chunk(start, stop, cols_of_draft, sparse=sparse)
            target_draft = index[target_argmax]
        for k in range(steps):
            keep = users[k]
            if not keep.any():
                continue
            anchors = rows[keep] - k - 1
            tlp = target_logp[keep]
            cols, pred = _run_block(draft, hidden[k][anchors], tlp, target_draft[keep], columns, checkpoint)
            parts[k].append((anchors, cols, has_mass(tlp)))
            correct[k, anchors] = draft.to_target_ids(pred) == target_argmax[keep]
    combined: list[torch.Tensor | None] = [None] * steps
    anchors_of: list[torch.Tensor | None] = [None] * steps
    ce = torch.zeros(n, steps, device=device)  # (N, K) for D-PACE
    for k in range(steps):
        if parts[k]:
            anchors_of[k] = torch.cat([a for a, _, _ in parts[k]])
            cols = torch.cat([c for _, c, _ in parts[k]])
            combined[k] = combine_terms(spec, cols, torch.cat([h for _, _, h in parts[k]]))
            if spec.position_weights == "dpace":
                ce[anchors_of[k], k] = cols[:, columns.index("ce")].detach()
    if spec.position_weights == "dpace":
        weights = dpace_weights(ce, valid.T, spec.dpace_alpha)  # (N, K)
    elif spec.position_weights == "aligned":
        weights = (decay ** torch.arange(steps, device=device))[None, :] * all_before(correct, valid, 0).T  # (N, K)
    weighted, sums = [], []
    for k in range(steps):
        if combined[k] is None:
            zero = torch.zeros((), device=device)
            if hidden[k].requires_grad:
                # No valid anchor at this step: still touch norm/lm_head (zero gradient) so every trainable
                # parameter takes part in backward (DDP/FSDP expect the same parameters on every rank).
                zero = zero + 0.0 * draft.compute_logits(hidden[k][:1]).float().sum()
            weighted.append(zero)
            sums.append(torch.zeros((), device=device))
            continue
        w = decay**k if spec.position_weights == "decay" else weights[anchors_of[k], k]
        weighted.append((w * combined[k]).sum())
        sums.append(combined[k].detach().sum())
    return StepLosses(weighted=torch.stack(weighted), sums=torch.stack(sums), correct=correct)


def rowwise_losses(draft, hidden: torch.Tensor, targets: TargetSource, rows: torch.Tensor, spec: LossSpec, *,
                   chunk_size: int = 1024, checkpoint: bool = True):
    """Per-row loss columns for arbitrary target ``rows [M]`` (DFlash's block slots), in chunks of ``chunk_size``.

    Returns ``cols [M, C]`` (``spec.columns``; differentiable), ``has [M]`` (rows with a verifier distribution),
    ``pred [M]`` (draft argmax, draft ids) and ``target [M]`` (the verifier's argmax as a draft id, -1 outside)."""
    device = hidden.device
    cols_of_draft = _draft_cols(draft, device)
    index = draft_index(cols_of_draft, draft.t2d.numel())
    outs, has, preds, tgts = [], [], [], []
    for start in range(0, rows.numel(), chunk_size):
        r = rows[start:start + chunk_size]
        with torch.no_grad():  # block slots share verifier rows: each distinct row once
            uniq, inverse = torch.unique(r, return_inverse=True)
            argmax, tlp = targets.rows(uniq, cols_of_draft)
            argmax, tlp = argmax[inverse], tlp[inverse]
            tid = index[argmax]
        cols, pred = _run_block(draft, hidden[start:start + chunk_size], tlp, tid, spec.columns, checkpoint)
        outs.append(cols)
        has.append(torch.isfinite(tlp).any(dim=-1))
        preds.append(pred)
        tgts.append(tid)
    if not outs:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return hidden.new_zeros(0, len(spec.columns), dtype=torch.float32), empty.bool(), empty, empty
    return torch.cat(outs), torch.cat(has), torch.cat(preds), torch.cat(tgts)
