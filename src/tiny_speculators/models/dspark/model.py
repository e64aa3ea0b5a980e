"""The DSpark draft (arXiv 2607.05147): DFlash's block drafter (``models/dflash/model.py``, reused as is) plus two
small heads on its output, laid out as speculators writes ``speculators_model_type: "dspark"``:

* a low-rank **Markov logit bias** keyed on the previous token of the chain (target id), so a block position is no
  longer guessed independently of the token drafted before it::

      h_j      = norm(x_j)                                      # the block's output at slot j, (.., H)
      e_j      = markov_w1[prev_j]                              # (.., r); prev_j = the token before the one j predicts
      vanilla: logits_j = lm_head(h_j) + markov_w2(e_j)         # (.., Vd)
      gated:   logits_j = lm_head(h_j) + markov_w2(sigmoid(gate_proj([h_j | e_j])) * e_j)

* a **confidence head**: ``c_j = sigmoid(proj([h_j | e_j]))`` (``[h_j]`` without ``confidence_head_with_markov``),
  trained to predict the probability that the verifier accepts slot j's token given that the tokens before it were
  accepted; at inference the chain is cut where the running product of confidences drops below a threshold.

``sample_from_anchor`` (DSpark's default, the DeepSpec convention): every slot is a prediction, slot j of the block
``[anchor, mask, ...]`` predicts the token after slot j's position (``block_size`` speculative tokens per forward);
without it the layout is DFlash's (slot 0 is the bonus token, mask slots j >= 1 predict the token at their own
position: ``block_size - 1`` tokens). Either way the prediction of the token at position ``t`` is biased by the token
at ``t - 1`` (the anchor for the first one, then the chain's own tokens).

The backbone is :class:`~tiny_speculators.models.dflash.model.DFlashDraft` (a subclass, not a copy: its tensors keep
their names, so DFlash drafts warm-start it key for key and speculators' flat DSpark layout reads straight in).

    python -c "import torch; from tiny_speculators.models.dspark.model import DSparkDraft; \
d = DSparkDraft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=100, num_aux=5, markov_rank=8); \
ctx = d.context(torch.randn(1, 6, 160), torch.arange(6)[None]); \
h = d(torch.tensor([[7, 0, 0, 0]]), torch.arange(6, 10)[None], ctx, block_size=4); \
print([t.shape for t in d.heads(h, torch.tensor([[7, 1, 2, 3]]))])"
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash.model import DFlashDraft

__all__ = ["MARKOV_HEAD_TYPES", "ConfidenceHead", "DSparkDraft", "MarkovHead"]

MARKOV_HEAD_TYPES = ("vanilla", "gated")  # the peers' "rnn" variant is not implemented (UserError)


class MarkovHead(nn.Module):
    """Low-rank transition bias ``markov_w2(markov_w1[prev])`` (vanilla) or its hidden-gated form."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 kind: Literal["vanilla", "gated"]) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # indexed by target (verifier) ids
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids.long())  # (.., r)

    def bias(self, prev_emb: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """``prev_emb [.., r]``, ``normed [.., H]`` -> logit bias ``[.., Vd]``."""
        if self.kind == "gated":
            prev_emb = torch.sigmoid(self.gate_proj(torch.cat([normed.to(prev_emb.dtype), prev_emb], -1))) * prev_emb
        return self.markov_w2(prev_emb)


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit: ``proj(features)`` -> ``[..]``."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """DFlash backbone + Markov head + confidence head.

    Args (beyond :class:`DFlashDraft`'s):
        markov_rank: rank r of the Markov bias (0: no Markov head, plain DFlash logits).
        markov_head_type: vanilla or gated.
        enable_confidence_head: attach the confidence head.
        confidence_head_with_markov: feed the confidence head ``[h | markov_w1[prev]]`` (needs a Markov head).
        sample_from_anchor: every slot predicts the next token (block_size tokens per forward) instead of
            DFlash's layout (block_size - 1).
    """

    def __init__(self, *, markov_rank: int = 256, markov_head_type: str = "vanilla",
                 enable_confidence_head: bool = True, confidence_head_with_markov: bool = True,
                 sample_from_anchor: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        if markov_rank < 0:
            raise UserError(f"markov_rank must be >= 0 (0: no Markov head), got {markov_rank}")
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise UserError(f"markov_head_type {markov_head_type!r} is not supported (supported: "
                            f"{', '.join(MARKOV_HEAD_TYPES)})")
        if confidence_head_with_markov and enable_confidence_head and markov_rank == 0:
            raise UserError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        with_markov = bool(confidence_head_with_markov and enable_confidence_head)
        self.kwargs.update(markov_rank=int(markov_rank), markov_head_type=markov_head_type,
                           enable_confidence_head=bool(enable_confidence_head),
                           confidence_head_with_markov=with_markov, sample_from_anchor=bool(sample_from_anchor))
        self.sample_from_anchor = bool(sample_from_anchor)
        hidden = self.hidden_size
        self.markov_head = (MarkovHead(self.kwargs["vocab_size"], self.draft_vocab_size, markov_rank, hidden,
                                       markov_head_type) if markov_rank else None)
        self.confidence_head = (ConfidenceHead(hidden + (markov_rank if with_markov else 0))
                                if enable_confidence_head else None)
        self.reset_heads()

    @torch.no_grad()
    def reset_heads(self, std: float = 0.02) -> None:
        """Markov head: ``markov_w1`` normal(0, std), ``markov_w2`` zero (the bias starts at 0, so a warm-started
        draft begins as its DFlash draft); confidence head normal(0, std), zero bias."""
        if self.markov_head is not None:
            self.markov_head.markov_w1.weight.normal_(0.0, std)
            self.markov_head.markov_w2.weight.zero_()
            if self.markov_head.kind == "gated":
                self.markov_head.gate_proj.weight.normal_(0.0, std)
                self.markov_head.gate_proj.bias.zero_()
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.normal_(0.0, std)
            self.confidence_head.proj.bias.zero_()

    def block_slots(self, k: int) -> int:
        """Slots of a block that proposes ``k`` tokens (k with sample_from_anchor, else k + 1)."""
        return k if self.sample_from_anchor else k + 1

    @property
    def max_tokens(self) -> int:
        """Tokens one forward of the trained block size proposes."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def heads(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm outputs ``[.., H]`` of predicting slots and the target id before each slot's token ``[..]``
        -> (draft-vocab logits ``[.., Vd]`` fp32 with the Markov bias, confidence logits ``[..]`` fp32 or None)."""
        normed = self.norm(hidden)
        logits = self.lm_head(normed).float()
        emb = None
        if self.markov_head is not None:
            emb = self.markov_head.embed(prev_ids).to(normed.dtype)
            logits = logits + self.markov_head.bias(emb, normed).float()
        conf = None
        if self.confidence_head is not None:
            feats = torch.cat([normed, emb], -1) if self.kwargs["confidence_head_with_markov"] else normed
            conf = self.confidence_head(feats).float()
        return logits, conf
