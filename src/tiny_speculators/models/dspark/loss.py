"""DSpark's per-slot loss terms, in one small function so a shared loss library can replace it later.

For one predicting slot with draft distribution ``q = softmax(logits)`` (Markov bias included) and the verifier's
``p`` (log-probs on the draft vocabulary):

* ``ce  = -log q[argmax p]`` (the verifier's greedy token; 0 when it is outside the draft vocabulary),
* ``tv  = 1/2 sum_v |q_v - p_v|`` (total variation: ``1 - tv = sum_v min(q_v, p_v)`` is the probability that
  rejection sampling accepts the slot's token),
* ``bce = BCE(confidence_logit, 1 - tv)`` with the target detached (the confidence head learns the acceptance
  probability; no gradient flows from it into the token distribution).

The peers' split (speculators / SpecForge / DeepSpec): ``0.1 ce + 0.9 tv + 1.0 bce``, each weighted per slot.

    from tiny_speculators.models.dspark.loss import LossWeights, slot_terms
    terms = slot_terms(logits, target_logp, target_ids, conf_logits)
    loss = LossWeights().combine(terms)     # per-slot total, (n,)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LossWeights", "slot_terms"]


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    bce: float = 1.0

    def combine(self, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        total = self.ce * terms["ce"] + self.tv * terms["tv"]
        return total + self.bce * terms["bce"] if "bce" in terms else total


def slot_terms(logits: torch.Tensor, target_logp: torch.Tensor, target_ids: torch.Tensor,
               conf_logits: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per-row terms ``[n]``: ``ce``, ``tv``, ``accept`` (= 1 - tv, detached), ``bce`` (with a confidence head).

    ``logits [n, Vd]`` fp32, ``target_logp [n, Vd]`` the verifier's log-probs on the draft vocab (fp32),
    ``target_ids [n]`` draft id of the verifier's argmax (-1: outside the draft vocab), ``conf_logits [n]`` or None.
    """
    logq = F.log_softmax(logits.float(), dim=-1)
    ce = -logq.gather(1, target_ids.clamp(min=0)[:, None]).squeeze(1) * (target_ids >= 0)
    tv = 0.5 * (logq.exp() - target_logp.exp()).abs().sum(dim=-1)
    accept = (1.0 - tv).detach().clamp(0.0, 1.0)
    terms = {"ce": ce, "tv": tv, "accept": accept}
    if conf_logits is not None:
        terms["bce"] = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
    return terms
