"""EAGLE-3's training objective for the loop: one ``nn.Module`` whose forward is a whole TTT rollout.

DDP and FSDP2 hook a module's ``forward``; ``ttt_step`` calls ``draft.fuse``, ``draft(...)`` K times and
``draft.compute_logits`` per chunk (also during backward recomputation), so the wrapper must be around all
of it: :class:`TTTModule` is what gets wrapped. The target head is kept outside the module tree (frozen,
never synchronized or sharded).

Loss groups are the K TTT steps: ``loss_counts`` gives the local number of anchors with a target per step,
the loop sums them over the optimizer step and passes them back as ``loss_normalizer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.metrics import METRIC_KEYS, summarize
from tiny_speculators.models.ttt import step_counts, ttt_step


class TTTModule(nn.Module):
    """``forward(batch, loss_normalizer) -> StepOutput`` for ``draft`` (the only registered submodule)."""

    def __init__(self, draft: nn.Module, target_head: nn.Module, steps: int, decay: float, attention: str,
                 chunk_size: int = 1024, checkpoint: bool = True, loss: LossSpec | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.loss = (loss or LossSpec()).resolved("kl")  # the loss terms and position weights (models/losses.py)
        self._head = (target_head,)  # a tuple hides it from parameters()/state_dict()/DDP broadcast
        self.steps, self.decay, self.attention, self.chunk_size = steps, decay, attention, chunk_size
        self.checkpoint = checkpoint  # recompute draft logits blocks in backward (ttt_step's memory saver)

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        if "target_topk_ids" in batch:  # extract's top-k layouts: the verifier's distribution is stored
            targets = {"target_topk_ids": batch["target_topk_ids"], "target_topk_logits": batch["target_topk_logits"]}
        else:
            targets = {"last_hidden_state": batch["last_hidden_state"], "target_head": self._head[0]}
        out = ttt_step(
            self.draft, input_ids=batch["input_ids"], aux_hidden_states=batch["aux_hidden_states"],
            loss_mask=batch["loss_mask"], **targets,
            position_ids=batch["position_ids"], document_ids=batch.get("document_ids"), steps=self.steps,
            decay=self.decay, attention=self.attention, chunk_size=self.chunk_size, checkpoint=self.checkpoint,
            loss_normalizer=loss_normalizer, loss=self.loss,
        )
        return StepOutput(loss=out.loss, metrics=out.metrics)

    def loss_counts(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[K]`` number of anchors with a target at each TTT step (the loss normalizer's local part)."""
        return step_counts(batch, self.steps)

    def new_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(self.steps, dtype=torch.float64, device=device) for key in METRIC_KEYS}

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return summarize(stats, self.decay)

