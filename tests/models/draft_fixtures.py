"""Tiny EAGLE-3 drafts for the model / TTT tests (fp32, CPU, a few thousand parameters).

Imported by tests as ``from draft_fixtures import ...`` (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import math

import torch

from tiny_speculators.models.eagle3.model import Eagle3Draft

VOCAB, DRAFT_VOCAB, HIDDEN = 40, 24, 16


def tiny_kwargs(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, draft_vocab_size=DRAFT_VOCAB, num_aux=3, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256,
    )
    kwargs.update(overrides)
    return kwargs


def ref_rms(x, w, eps=1e-6):
    """RMSNorm for the float64 reference forwards."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, theta=10000.0):
    """Neox (rotate-half) RoPE of ``x [T, heads, D]`` at positions ``pos [T]``, float64, for the reference forwards."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv  # (T, D/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def tiny_maps():
    """A non-trivial vocab map: every other target id up to 2*DRAFT_VOCAB, minus a few, sorted."""
    target_ids = torch.tensor(sorted({*range(0, VOCAB, 2), 1, 3, 5, 7})[:DRAFT_VOCAB])
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(DRAFT_VOCAB)
    return d2t, t2d


@torch.no_grad()
def fixed_init(draft: Eagle3Draft) -> Eagle3Draft:
    """Deterministic, torch-version-independent weights: a sine pattern per parameter."""
    for i, (_, p) in enumerate(sorted(draft.named_parameters())):
        n = p.numel()
        values = torch.sin(torch.arange(n, dtype=torch.float64) * 0.61 + i) * (0.5 / math.sqrt(p.shape[-1]))
        if p.dim() == 1:  # norm weights around 1
            values = 1.0 + 0.5 * torch.sin(torch.arange(n, dtype=torch.float64) * 1.3 + i)
        p.copy_(values.view_as(p).to(p.dtype))
    d2t, t2d = tiny_maps()
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft
