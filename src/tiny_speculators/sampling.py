"""Token selection for speculative decoding: greedy, temperature/top-k/top-p, what a draft picks from its logits,
and the acceptance rules. A ground-floor module: ``models/`` (the proposers) and ``evaluate/`` (the decoding loop)
both import it, and it imports neither.

Chain drafts use the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): a draft
token ``d`` sampled from the draft distribution ``q`` is accepted with probability ``min(1, p(d) / q(d))``;
on rejection the replacement is sampled from ``norm(max(0, p - q))``; when every draft token is accepted
a bonus token is sampled from ``p``. The emitted tokens are then distributed exactly as the verifier's
own samples. ``p`` and ``q`` are both over the verifier's vocabulary (the draft's reduced vocabulary is
scattered into it, unmapped ids get probability 0) after the same temperature / top-k / top-p processing.

    from tiny_speculators.sampling import SamplingParams, probs_from_logits
    probs = probs_from_logits(torch.randn(3, 100), SamplingParams(temperature=0.7, top_p=0.9))
    tokens, q = pick_tokens(logits, proposer.target_ids, proposer.to_target_logits, params, generator)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiny_speculators.errors import UserError

__all__ = ["SamplingParams", "accept_chain", "pick_tokens", "probs_from_logits", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, not {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float32, same shape as ``logits`` [..., V]) after temperature, top-k and top-p."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    x = logits.float() / params.temperature  # (..., V)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a 1-D probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick_tokens(logits: torch.Tensor, target_ids: torch.Tensor,
                to_target_logits: Callable[[torch.Tensor], torch.Tensor], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
    """What a proposer that drafts several tokens from one forward does with that forward's logits: one token (a
    target id) per row of draft-vocab ``logits [k, Vd]``: the argmax when greedy, else a sample of the row's
    distribution over the target vocabulary; with sampling also those distributions ``q [k, V]``."""
    draft, qs = [], []
    for i in range(logits.shape[0]):
        if params.greedy:
            draft.append(int(target_ids[int(torch.argmax(logits[i]))]))
        else:
            q = probs_from_logits(to_target_logits(logits[i]), params).cpu()
            draft.append(sample(q, generator))
            qs.append(q)
    return draft, (torch.stack(qs) if qs else None)


def accept_chain(p: torch.Tensor, q: torch.Tensor, draft: list[int],
                 generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative-sampling acceptance for a chain of draft tokens.

    Args:
        p: verifier probabilities [k+1, V] at the k draft positions and the bonus position.
        q: draft probabilities [k, V] (over the verifier vocabulary) the draft tokens were sampled from.
        draft: the k draft token ids (verifier vocabulary).
    Returns:
        (number of accepted draft tokens, the next token: the replacement at the first rejection or the bonus).
    """
    for i, d in enumerate(draft):
        pd, qd = float(p[i, d]), float(q[i, d])
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u * qd < pd:  # u < p/q without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = float(residual.sum())
        return i, sample(residual / total if total > 0 else p[i], generator)
    return len(draft), sample(p[len(draft)], generator)
