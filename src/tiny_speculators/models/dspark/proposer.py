"""The DSpark proposer: ONE backbone forward per verification step (DFlash's, with its context injection and
rollback reused from :class:`~tiny_speculators.models.dflash.proposer.DFlashProposer`), then a left-to-right pass over
the block's outputs adding the Markov bias of the token just drafted, as vLLM's ``DSparkSpeculator`` samples.

Block: ``[bonus, mask, ...]`` at positions ``P+1, P+2, ...`` (``k`` slots with ``sample_from_anchor``, slot i drafting
token i; else ``k + 1`` slots, slot i + 1 drafting token i). Token i's logits are ``lm_head(norm(h_i)) +
bias(prev_i)`` with ``prev_0`` = the bonus token and ``prev_i`` = draft token i - 1; its confidence is
``c_i = sigmoid(confidence_head([norm(h_i) | markov_w1[prev_i]]))``.

Confidence-driven verification length: with ``confidence_threshold`` set, only the first ``n`` tokens go to the
verifier, ``n`` the longest prefix whose running product ``c_0 c_1 ... c_{n-1}`` stays at or above the threshold
(at least 1). The cut reads only draft-side quantities, so verification stays lossless. ``None`` ("off") sends all k.

    from tiny_speculators.models.dspark.proposer import DSparkProposer
    proposer = DSparkProposer(draft, confidence_threshold=0.3)
    proposer.commit(tokens, aux, 0); proposer.propose_chain(8, params, None)
"""

from __future__ import annotations

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash.proposer import DFlashProposer
from tiny_speculators.models.dspark.model import DSparkDraft
from tiny_speculators.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["DSparkProposer", "cut_length"]


def cut_length(confidences: list[float], threshold: float | None) -> int:
    """Tokens sent to verification: the longest prefix whose running confidence product is >= threshold (>= 1)."""
    if threshold is None:
        return len(confidences)
    n, run = 0, 1.0
    for c in confidences:
        run *= c
        if run < threshold:
            break
        n += 1
    return max(1, n)


class DSparkProposer:
    supports_tree = False

    def __init__(self, draft: DSparkDraft, confidence_threshold: float | None = None) -> None:
        self.draft = draft
        self.block = DFlashProposer(draft)  # context keys/values, commit and rollback
        self.draft_forwards = 0
        self.last_confidences: list[float] = []
        self._threshold: float | None = None
        self.confidence_threshold = confidence_threshold

    @property
    def has_confidence(self) -> bool:
        return self.draft.confidence_head is not None

    @property
    def confidence_threshold(self) -> float | None:
        return self._threshold

    @confidence_threshold.setter
    def confidence_threshold(self, value: float | None) -> None:
        if value is not None and not self.has_confidence:
            raise UserError("this DSpark draft has no confidence head: evaluate it without a confidence threshold")
        if value is not None and not 0.0 <= value <= 1.0:
            raise UserError(f"the confidence threshold must be in [0, 1] (or off), got {value}")
        self._threshold = value

    def reset(self) -> None:
        self.block.reset()
        self.last_confidences = []

    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        self.block.commit(tokens, aux, start)

    @torch.no_grad()
    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens (target ids; fewer when the confidence cut stops the chain) from one forward;
        with sampling also their distributions q [n, V]. ``last_confidences`` holds the sent tokens' confidences."""
        draft = self.draft
        if not 1 <= k <= draft.max_tokens:
            raise UserError(f"a DSpark draft with block size {draft.block_size} proposes 1...{draft.max_tokens} "
                            f"tokens per step, not k={k}")
        bonus, bonus_pos = self.block.inject_pending()
        dev = draft.fc.weight.device
        slots = draft.block_slots(k)
        ids = torch.tensor([[bonus, *[draft.mask_token_id] * (slots - 1)]], device=dev)  # (1, slots)
        pos = torch.arange(bonus_pos, bonus_pos + slots, device=dev)[None]
        out = draft(ids, pos, self.block.context_kv(), None, block_size=slots)[0, slots - k:]  # (k, H)
        self.draft_forwards += 1
        tokens, qs, confs = [], [], []
        prev = bonus
        for i in range(k):
            logits, conf = draft.heads(out[i:i + 1], torch.tensor([prev], device=dev))
            if params.greedy:
                prev = int(self.block.target_ids[int(torch.argmax(logits[0]))])
            else:
                q = probs_from_logits(self.block.to_target_logits(logits[0]), params).cpu()
                prev = sample(q, generator)
                qs.append(q)
            tokens.append(prev)
            if conf is not None:
                confs.append(float(torch.sigmoid(conf[0])))
        n = cut_length(confs, self._threshold) if confs else k
        self.last_confidences = confs[:n]
        return tokens[:n], (torch.stack(qs[:n]) if qs else None)
