"""Test helpers for the evaluate tests: random EAGLE-3 drafts and an oracle (perfect) draft."""

from __future__ import annotations

import torch

from tiny_speculators.evaluate.decoding import Eagle3Proposer
from tiny_speculators.models.eagle3.builder import build_draft, draft_kwargs_from_verifier


def random_draft(model, draft_vocab: int | None = None, seed: int = 0, std: float = 0.02):
    """A randomly initialised draft for ``model``; a random subset of ``draft_vocab`` target ids."""
    vocab = model.config.vocab_size
    draft_vocab = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:draft_vocab]] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(draft_vocab)
    torch.manual_seed(seed)
    draft = build_draft(draft_kwargs_from_verifier(model.config, draft_vocab), d2t, t2d,
                        embed_weight=model.get_input_embeddings().weight)
    if std != 0.02:
        draft.reset_parameters(std)
        draft.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return draft.eval().requires_grad_(False)


class OracleProposer(Eagle3Proposer):
    """A real draft (real KV-cache bookkeeping) whose logits are replaced by a peak on the reference
    continuation: at draft position t it predicts ``reference[t + 2]``, as a perfect draft would."""

    def __init__(self, draft, reference: list[int]):
        super().__init__(draft)
        assert draft.draft_vocab_size == self.vocab_size and int(draft.d2t.abs().sum()) == 0
        self.reference = reference

    def _oracle(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        for row, p in enumerate(positions.tolist()):
            out[row, self.reference[p + 2]] = out[row].max() + 10.0
        return out

    def commit(self, tokens, aux, start):
        super().commit(tokens, aux, start)
        self.logits = self._oracle(self.logits[None], torch.tensor([start + len(tokens) - 1]))[0]

    def step(self, tokens, hidden, positions, mask=None):
        logits, hid = super().step(tokens, hidden, positions, mask)
        return self._oracle(logits, positions), hid
