"""What a proposer that drafts several tokens from one forward does with that forward's logits.

    tokens, q = pick_tokens(logits, proposer.target_ids, proposer.to_target_logits, params, generator)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiny_speculators.evaluate.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["pick_tokens"]


def pick_tokens(logits: torch.Tensor, target_ids: torch.Tensor,
                to_target_logits: Callable[[torch.Tensor], torch.Tensor], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
    """One token (a target id) per row of draft-vocab ``logits [k, Vd]``: the argmax when greedy, else a sample of
    the row's distribution over the target vocabulary; with sampling also those distributions ``q [k, V]``."""
    draft, qs = [], []
    for i in range(logits.shape[0]):
        if params.greedy:
            draft.append(int(target_ids[int(torch.argmax(logits[i]))]))
        else:
            q = probs_from_logits(to_target_logits(logits[i]), params).cpu()
            draft.append(sample(q, generator))
            qs.append(q)
    return draft, (torch.stack(qs) if qs else None)
