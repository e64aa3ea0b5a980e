"""Paired bootstrap over prompts: τ of several drafts decoded on the same prompts, and how sure a difference is.

Every draft was decoded on the same prompts, so prompt difficulty is shared: the bootstrap resamples prompts (with
replacement, the same draw for every draft) and recomputes each draft's τ = 1 + accepted / drafts over the drawn
prompts, as vLLM pools its counters. The spread of τ_B - τ_A over the draws is the uncertainty of the difference;
pairing removes the prompt-to-prompt variance both drafts share, which an unpaired comparison would count.

    from tiny_speculators.compare.stats import Counts, paired_bootstrap
    a = Counts(drafts=[10, 12], accepted=[4, 9], per_position=[[3, 1, 0], [6, 2, 1]])
    result = paired_bootstrap([a, b], resamples=10000, seed=0, confidence=0.95, margin=0.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Counts", "paired_bootstrap"]


@dataclass(frozen=True)
class Counts:
    """One draft's counters per prompt: verification steps (``drafts``), accepted tokens, and per position how many
    steps accepted at least that many tokens (vLLM's per-position counters)."""

    drafts: list[int]
    accepted: list[int]
    per_position: list[list[int]]


def _tau(drafts: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    return 1.0 + accepted / np.maximum(drafts, 1)


def paired_bootstrap(counts: list[Counts], *, resamples: int, seed: int, confidence: float,
                     margin: float) -> dict[str, Any]:
    """τ and per-position acceptance of each draft with a percentile interval at ``confidence``, and for every draft
    after the first its difference to the first (A): the interval, the one-sided lower bound at ``confidence``, the
    share of draws in which it beats A by more than ``margin`` (``p_better``), and the two verdicts:

    - ``better``: the one-sided lower bound of τ_B - τ_A is above ``margin``;
    - ``not_worse``: that bound is at or above ``-margin`` (B is at most ``margin`` worse, at ``confidence``; a draft
      is not worse than itself at margin 0).
    """
    n = len(counts[0].drafts)
    positions = max(len(p) for c in counts for p in c.per_position) if n else 0
    drafts = np.array([c.drafts for c in counts], dtype=np.float64)  # (M, P)
    accepted = np.array([c.accepted for c in counts], dtype=np.float64)  # (M, P)
    per_pos = np.zeros((len(counts), n, positions))  # (M, P, K)
    for m, c in enumerate(counts):
        for i, row in enumerate(c.per_position):
            per_pos[m, i, :len(row)] = row
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(resamples, n))  # (R, P): the same prompts for every draft
    weights = np.zeros((resamples, n))  # (R, P): how often each prompt was drawn
    np.add.at(weights, (np.arange(resamples)[:, None], draws), 1.0)
    d = drafts @ weights.T  # (M, R)
    taus = _tau(d, accepted @ weights.T)  # (M, R)
    pos = np.einsum("mpk,rp->mrk", per_pos, weights) / np.maximum(d, 1)[..., None]  # (M, R, K)
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    point = _tau(drafts.sum(-1), accepted.sum(-1))  # (M,)
    point_pos = per_pos.sum(1) / np.maximum(drafts.sum(-1), 1)[:, None]  # (M, K)
    out: dict[str, Any] = {"prompts": n, "resamples": resamples, "confidence": confidence, "margin": margin,
                           "drafts": [], "differences": []}
    for m in range(len(counts)):
        out["drafts"].append({
            "tau": float(point[m]),
            "tau_interval": [float(np.quantile(taus[m], lo_q)), float(np.quantile(taus[m], hi_q))],
            "per_position_acceptance": [float(x) for x in point_pos[m]],
            "per_position_interval": [[float(np.quantile(pos[m, :, j], lo_q)), float(np.quantile(pos[m, :, j], hi_q))]
                                      for j in range(positions)],
        })
    for m in range(1, len(counts)):
        diff = taus[m] - taus[0]  # (R,)
        lower = float(np.quantile(diff, 1 - confidence))  # one-sided
        out["differences"].append({
            "tau_difference": float(point[m] - point[0]),
            "interval": [float(np.quantile(diff, lo_q)), float(np.quantile(diff, hi_q))],
            "lower_bound": lower,
            "p_better": float((diff > margin).mean()),
            "per_position_difference": [float(x) for x in point_pos[m] - point_pos[0]],
            "per_position_interval": [[float(np.quantile(pos[m, :, j] - pos[0, :, j], lo_q)),
                                       float(np.quantile(pos[m, :, j] - pos[0, :, j], hi_q))]
                                      for j in range(positions)],
            "better": lower > margin,
            "not_worse": lower >= -margin,
        })
    return out
