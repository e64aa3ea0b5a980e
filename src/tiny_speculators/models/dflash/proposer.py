"""The DFlash proposer: ONE draft forward per verification step, a block of ``k + 1`` slots, as vLLM's
``DFlashProposer`` runs it (``vllm/v1/spec_decode/dflash.py``).

``commit`` records verified slots (the verifier's aux state at each position; the last token is the bonus
token, at the position after the last verified one). ``propose_chain(k)`` injects the new context (each layer's
keys/values of ``hidden_norm(fc(aux))`` at its position, kept per layer and cropped on rollback), then runs the
block ``[bonus, mask x k]`` at positions ``P+1 .. P+1+k`` over the whole context and bidirectionally over itself;
mask slot ``i`` proposes draft token ``i``. The block's own keys are not kept: vLLM overwrites them with the next
step's context.

    from tiny_speculators.models.dflash.proposer import DFlashProposer
    proposer = DFlashProposer(draft); proposer.commit(tokens, aux, 0); proposer.propose_chain(3, params, None)
"""

from __future__ import annotations

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.sampling import SamplingParams, pick_tokens

__all__ = ["DFlashProposer"]


class DFlashProposer:
    supports_tree = False

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.draft_forwards = 0
        dev = draft.d2t.device
        self.target_ids = draft.to_target_ids(torch.arange(draft.draft_vocab_size, device=dev))  # (Vd,)
        self.vocab_size = draft.embed_tokens.num_embeddings
        self.keys: list[torch.Tensor] = []  # per layer (1, Hkv, S, D): the injected context so far
        self.values: list[torch.Tensor] = []
        self._pending: tuple[list[int], torch.Tensor, int] | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reset(self) -> None:
        self.keys, self.values, self._pending = [], [], None

    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        """Verified slots ``start..start+T-1`` (their context is injected by the next proposal's forward)."""
        if self._pending is not None:
            raise RuntimeError("commit() twice without propose_chain(): the evaluator must alternate them")
        if start > self.length:
            raise RuntimeError(f"commit at position {start} leaves a gap after {self.length} context positions")
        self.keys = [k[:, :, :start] for k in self.keys]
        self.values = [v[:, :, :start] for v in self.values]
        self._pending = (list(tokens), aux, start)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.target_ids] = logits
        return full

    @torch.no_grad()
    def inject_pending(self) -> tuple[int, int]:
        """Inject the committed slots' context (keys/values of every layer); returns the bonus token and its
        position (the one after the last verified position). Families built on this block drafter call it."""
        if self._pending is None:
            raise RuntimeError("propose_chain() needs verified slots from commit() first")
        tokens, aux, start = self._pending
        self._pending = None
        dev = self.draft.fc.weight.device
        n = len(tokens)
        new = self.draft.context(aux.to(dev)[None], torch.arange(start, start + n, device=dev)[None])
        self.keys = [torch.cat([old, kv[0]], dim=2) if self.keys else kv[0] for old, kv in
                     zip(self.keys or [None] * len(new), new, strict=True)]
        self.values = [torch.cat([old, kv[1]], dim=2) if self.values else kv[1] for old, kv in
                       zip(self.values or [None] * len(new), new, strict=True)]
        return int(tokens[-1]), start + n

    def context_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values, strict=True))

    @torch.no_grad()
    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens (target ids) from one forward; with sampling also their distributions q [k, V]."""
        if self._pending is None:
            raise RuntimeError("propose_chain() needs verified slots from commit() first")
        if not 1 <= k < self.draft.block_size:
            raise UserError(f"a DFlash draft with block size {self.draft.block_size} proposes 1..."
                            f"{self.draft.block_size - 1} tokens per step, not k={k}")
        bonus, bonus_pos = self.inject_pending()
        dev = self.draft.fc.weight.device
        ids = torch.tensor([[bonus, *[self.draft.mask_token_id] * k]], device=dev)  # (1, k + 1)
        pos = torch.arange(bonus_pos, bonus_pos + k + 1, device=dev)[None]
        out = self.draft(ids, pos, self.context_kv(), None, block_size=k + 1)
        self.draft_forwards += 1
        logits = self.draft.compute_logits(out[0, 1:]).float()  # (k, Vd)
        return pick_tokens(logits, self.target_ids, self.to_target_logits, params, generator)
