"""EAGLE-3's training objective for the loop: one ``nn.Module`` whose forward is a whole TTT rollout
(``models/ttt.py``: the rollout, and the bookkeeping every TTT objective shares), fed the fused aux states and the
verifier's distribution (its top-k when extract stored it, else its last hidden state through the target head).
"""

from __future__ import annotations

from typing import Any

import torch

from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.ttt import TTTObjective

__all__ = ["TTTModule"]


class TTTModule(TTTObjective):
    """``forward(batch, loss_normalizer) -> StepOutput`` for ``draft`` (the only registered submodule)."""

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        if "target_topk_ids" in batch:  # extract's top-k layouts: the verifier's distribution is stored
            targets = {"target_topk_ids": batch["target_topk_ids"], "target_topk_logits": batch["target_topk_logits"]}
        else:
            targets = {"last_hidden_state": batch["last_hidden_state"], "target_head": self._head[0]}
        out = self.rollout(batch, loss_normalizer, batch["aux_hidden_states"], **targets)
        return StepOutput(loss=out.loss, metrics=out.metrics)
