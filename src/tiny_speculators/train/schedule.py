"""AdamW (or Muon + AdamW) with linear warmup then cosine decay; the schedule is a pure function of the step.

Keeping the learning rate a function of the optimizer step (instead of a stateful scheduler object)
makes resume exact by construction: the checkpoint only needs the step number.

    opt = build_optimizer(draft, lr=3e-4, weight_decay=0.0)
    opt = build_optimizer(draft, lr=3e-4, weight_decay=0.0, kind="muon")   # Muon on hidden matrices + AdamW
    set_lr(opt, lr_at(step, lr=3e-4, warmup_steps=100, total_steps=10_000))
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr``, cosine to ``lr*min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


# 2-D weights Muon leaves to AdamW: vocabulary-indexed tables (as speculators and Keller Jordan's Muon do)
VOCAB_MATRICES = ("embed_tokens", "lm_head")


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                    kind: str = "adamw", muon_momentum: float = 0.95,
                    muon_weight_decay: float = 0.1) -> torch.optim.Optimizer | OptimizerGroup:
    """AdamW over the trainable parameters (no weight decay on 1-D parameters: norm weights, biases); with
    ``kind="muon"``, ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``, speculators' default) takes the 2-D
    hidden weight matrices and AdamW the rest (embeddings, lm_head, norms, biases), stepped as one."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if kind == "muon" and p.dim() == 2 and min(p.shape) > 1 and not any(v in name for v in VOCAB_MATRICES):
            muon.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    if kind == "adamw":
        return adamw
    if kind != "muon":
        raise ValueError(f"optimizer must be adamw or muon, got {kind!r}")
    return OptimizerGroup([torch.optim.Muon(muon, lr=lr, momentum=muon_momentum, weight_decay=muon_weight_decay,
                                            adjust_lr_fn="match_rms_adamw"), adamw])


class OptimizerGroup:
    """Several optimizers over disjoint parameters, stepped, zeroed, scheduled and checkpointed as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        states = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"expected the state of {len(self.optimizers)} optimizers")
        for o, s in zip(self.optimizers, states, strict=True):
            o.load_state_dict(s)
