"""The proposer of a chain draft (one draft forward per token, its own output fed back: EAGLE-3, MTP), as vLLM's
EAGLE proposer drives it.

How the draft is fed: draft position ``t`` consumes the pair (hidden state of position ``t``, token at ``t + 1``)
and predicts the token at ``t + 2``. After each verification the draft's cache is cropped back to the last verified
position and the verifier's features at the committed positions are fed (``fuse``) with the committed tokens
shifted by one (the last one being the verifier's bonus / replacement token); the following draft steps feed the
draft's own output as the hidden state.

    from tiny_speculators.models.chain import ChainProposer
    proposer = ChainProposer(draft)      # evaluate drives commit() / propose_chain(k, ...)
"""

from __future__ import annotations

import torch
from torch import nn

from tiny_speculators.models.attention import KVCache
from tiny_speculators.models.layers import to_target_logits
from tiny_speculators.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["ChainProposer"]


class ChainProposer:
    """Holds a chain draft, its KV cache and the latest draft logits / fed-back hidden state."""

    supports_tree = False

    def __init__(self, draft: nn.Module):
        self.draft = draft
        self.draft_forwards = 0
        self.cache = KVCache()
        dev = draft.d2t.device
        self.target_ids = draft.to_target_ids(torch.arange(draft.draft_vocab_size, device=dev))  # (Vd,)
        self.vocab_size = draft.embed_tokens.num_embeddings
        self.logits: torch.Tensor | None = None  # (Vd,) predicts the token after the pending one
        self.hidden: torch.Tensor | None = None  # (H,)
        self.prompt_positions: torch.Tensor | None = None  # (T,) RoPE positions of the prompt's slots, if not 0..T-1

    @property
    def device(self) -> torch.device:
        return self.draft.lm_head.weight.device

    def reset(self) -> None:
        self.cache.reset()
        self.logits = self.hidden = None
        self.prompt_positions = None

    def set_positions(self, positions: torch.Tensor) -> None:
        """The RoPE positions of the prompt's slots (after :meth:`reset`): a vision-language verifier's prompt
        holds images, whose tokens take fewer positions than slots (vLLM gives a text-only draft the temporal
        row of the verifier's M-RoPE positions); the slots after the prompt continue from its last position."""
        self.prompt_positions = positions.long().cpu()

    def positions(self, start: int, n: int) -> torch.Tensor:
        """The RoPE positions of draft slots ``start..start+n-1``."""
        slots = torch.arange(start, start + n)
        table = self.prompt_positions
        if table is None:
            return slots
        shift = int(table[-1]) - (len(table) - 1)
        return torch.where(slots < len(table), table[slots.clamp(max=len(table) - 1)], slots + shift)

    @torch.no_grad()
    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        """Feed verified features: ``aux`` [T, n_aux*Ht] of positions ``start..start+T-1`` with ``tokens``
        (the token at each position + 1). Drops any speculative draft entries from ``start`` on."""
        self.cache.crop(min(start, self.cache.length))
        dev = self.device
        ids = torch.tensor(tokens, device=dev)[None]  # (1, T)
        pos = self.positions(start, len(tokens)).to(dev)[None]
        out = self.draft(ids, self.draft.fuse(aux.to(dev)[None]), pos, cache=self.cache, logits=False)
        self.draft_forwards += 1
        self.hidden = out.hidden_states[0, -1]  # (H,)
        self.logits = self.draft.compute_logits(self.hidden).float()  # only the last position is needed

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward of ``tokens`` [n] with ``hidden`` [n, H] at ``positions`` [n] (appends to the cache).
        ``mask``: bool [n, S] over all keys (cached + new), None = causal. Returns (logits [n, Vd], hidden [n, H])."""
        dev = self.device
        m = None if mask is None else mask.to(dev)[None, None]
        out = self.draft(tokens.to(dev)[None], hidden[None], positions.to(dev)[None], attention_mask=m,
                         cache=self.cache)
        self.draft_forwards += 1
        return out.logits[0].float(), out.hidden_states[0]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf outside the draft vocab)."""
        return to_target_logits(self.draft, logits)

    @torch.no_grad()
    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens (target ids) after the pending token; with sampling also their distributions q [k, V]."""
        start = self.cache.length
        logits, hidden = self.logits, self.hidden
        tokens, qs = [], []
        for i in range(k):
            if params.greedy:
                tok = int(self.target_ids[int(torch.argmax(logits))])
            else:
                q = probs_from_logits(self.to_target_logits(logits), params).cpu()
                tok = sample(q, generator)
                qs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                lg, hd = self.step(torch.tensor([tok]), hidden[None], self.positions(start + i, 1))
                logits, hidden = lg[0], hd[0]
        return tokens, (torch.stack(qs) if qs else None)
