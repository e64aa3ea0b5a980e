"""MTP's training objective: the one MTP layer applied recursively for K steps (FastMTP), as vLLM chains it.

Step 1 at anchor ``t`` reads the verifier's last pre-norm state ``h_t`` and token ``x_{t+1}``; step k reads the
layer's own output of step k-1 and ``x_{t+k}``, at position ``pos[t] + k - 1``, attending to the step-1 keys of
its document up to ``t`` and its own chain: exactly EAGLE-3's training-time-test rollout (``models/ttt.py``), so
that rollout, its chunked KL loss to the verifier and its metrics are reused with the MTP layer as the draft.

Loss (``models/losses.py``; forward KL unless the run chooses others): ``sum_k w_k * loss_k / count_k`` with
``w_k = beta**(k-1) / sum_j beta**(j-1)`` (normalized, beta = 0.6; or D-PACE's weights over the normalizer), the
counts over the whole optimizer step (``loss_counts``), so micro-batches and ranks add up exactly.

MTP needs the verifier's last pre-norm hidden state in every batch: online training has it, and so do the
``full`` and ``fp8`` extract layouts; the top-k layouts drop it (a one-line error says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import StepOutput
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.ttt import TTTObjective

__all__ = ["MTPObjective", "step_weights_sum"]


def step_weights_sum(steps: int, beta: float) -> float:
    return float(sum(beta**k for k in range(steps)))


class MTPObjective(TTTObjective):
    """``forward(batch, loss_normalizer) -> StepOutput`` for the MTP layer (the only registered submodule)."""

    def __init__(self, draft: nn.Module, target_head: nn.Module, steps: int, beta: float, attention: str,
                 chunk_size: int = 1024, checkpoint: bool = True, loss: LossSpec | None = None) -> None:
        super().__init__(draft, target_head, steps, beta, attention, chunk_size, checkpoint, loss)
        self.beta = beta
        self.norm = step_weights_sum(steps, beta)

    def forward(self, batch: dict[str, Any], loss_normalizer: torch.Tensor | None = None) -> StepOutput:
        last = batch.get("last_hidden_state")
        if last is None:
            raise UserError("MTP trains on the verifier's last hidden state, which the top-k extract layouts drop: "
                            "extract with --layout full or fp8, or train --online")
        out = self.rollout(batch, loss_normalizer, last, last_hidden_state=last, target_head=self._head[0])
        return StepOutput(loss=out.loss / self.norm, metrics=out.metrics)

    def summarize(self, stats: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """``loss`` (normalized weights, as trained), ``loss_steps``, ``acc``, ``cond_acc``, ``accept_len``."""
        out = super().summarize(stats)
        out["loss"] = out["loss"] / self.norm
        return out
