"""AdamW with linear warmup then cosine decay; the schedule is a pure function of the step.

Keeping the learning rate a function of the optimizer step (instead of a stateful scheduler object)
makes resume exact by construction: the checkpoint only needs the step number.

    opt = build_optimizer(draft, lr=3e-4, weight_decay=0.0)
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


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on 1-D parameters (norm weights)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
