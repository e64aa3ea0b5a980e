"""The P-EAGLE proposer: ONE draft forward per verification step, as vLLM's parallel drafting runs it.

``commit`` only records the verified slots (token at each position + 1, the verifier's aux state there; the
last one is the bonus token with the state of the last verified position). ``propose_chain(k)`` then runs one
forward over those slots plus ``k - 1`` mask slots (``mask_token_id``, ``mask_state()``) at the following
positions, causal over the draft's per-layer caches; the output at the bonus slot gives draft token 1, mask
slot i gives token i + 1. The mask slots' cache entries are dropped afterwards (vLLM overwrites them with the
next step's real slots), so every later slot only ever sees real verifier states as context.
"""

from __future__ import annotations

import torch

from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.layers import to_target_logits
from tiny_speculators.models.peagle.model import PEagleDraft
from tiny_speculators.sampling import SamplingParams, pick_tokens

__all__ = ["PEagleProposer"]


class PEagleProposer:
    supports_tree = False

    def __init__(self, draft: PEagleDraft):
        self.draft = draft
        self.caches = [KVCache() for _ in draft.layers]
        self.draft_forwards = 0
        dev = draft.d2t.device
        self.target_ids = draft.to_target_ids(torch.arange(draft.draft_vocab_size, device=dev))  # (Vd,)
        self.vocab_size = draft.embed_tokens.num_embeddings
        self._pending: tuple[list[int], torch.Tensor, int] | None = None  # verified slots not yet fed

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reset(self) -> None:
        for c in self.caches:
            c.reset()
        self._pending = None

    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        """Record verified slots ``start..start+T-1`` (fed with the next proposal's forward)."""
        for c in self.caches:
            c.crop(min(start, c.length))
        if self._pending is not None:  # two commits without a proposal in between: feed the first one now
            raise RuntimeError("commit() twice without propose_chain(): the evaluator must alternate them")
        self._pending = (list(tokens), aux, start)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf outside the draft vocab)."""
        return to_target_logits(self.draft, logits)

    @torch.no_grad()
    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens (target ids) from one forward; with sampling also their distributions q [k, V]."""
        if self._pending is None:
            raise RuntimeError("propose_chain() needs verified slots from commit() first")
        tokens, aux, start = self._pending
        self._pending = None
        dev = self.device
        n = len(tokens)
        ids = torch.tensor([*tokens, *[self.draft.mask_token_id] * (k - 1)], device=dev)[None]  # (1, n + k - 1)
        hidden = torch.cat([self.draft.fuse(aux.to(dev)), self.draft.mask_state().expand(k - 1, -1)])[None]
        pos = torch.arange(start, start + n + k - 1, device=dev)[None]
        out = self.draft(ids, hidden, pos, caches=self.caches, logits=False)
        self.draft_forwards += 1
        logits = self.draft.compute_logits(out.hidden_states[0, n - 1:]).float()  # (k, Vd)
        for c in self.caches:  # drop the mask slots; the verified slots stay as context
            c.crop(start + n)
        return pick_tokens(logits, self.target_ids, self.to_target_logits, params, generator)
