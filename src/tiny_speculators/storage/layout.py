"""What one shard stores per token, for each storage layout, and how it is encoded and decoded.

Every shard holds the samples' tokens packed back to back (no padding):
``input_ids`` int32 (N,), ``loss_mask`` uint8 (N,), ``sample_offsets`` int64 (n+1,) and then

===========  ==================================================  ==============================================
layout       aux states                                          what reproduces the verifier's distribution
===========  ==================================================  ==============================================
full         ``aux_hidden_states`` (N, n_aux*H) in ``dtype``     ``last_hidden_state`` (N, H) in ``dtype``
fp8          ``aux_hidden_states`` float8_e4m3fn + ``aux_scales``  ``last_hidden_state`` (N, H) in ``dtype``
             float32 (N, n_aux): one absmax scale per token
             and aux layer
topk         as full                                             ``target_topk_ids`` int32 (N, k),
                                                                 ``target_topk_logits`` float32 (N, k),
                                                                 ``target_logsumexp`` float32 (N,) of ALL logits
fp8-topk     as fp8                                              as topk
===========  ==================================================  ==============================================

With top-k, ``exp(target_topk_logits - target_logsumexp)`` are the verifier's exact probabilities of
those k tokens (the rest of the mass, ``1 - sum``, is known too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiny_speculators.errors import UserError

__all__ = ["FP8_MAX", "LAYOUTS", "Layout", "bytes_per_token", "dequantize_fp8", "quantize_fp8"]

LAYOUTS = ("full", "fp8", "topk", "fp8-topk")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Layout:
    name: str
    topk: int = 0  # 0: store the last hidden state

    @property
    def aux_fp8(self) -> bool:
        return self.name.startswith("fp8")

    @property
    def uses_topk(self) -> bool:
        return self.name.endswith("topk")

    @classmethod
    def parse(cls, name: str, topk: int = 64) -> Layout:
        if name not in LAYOUTS:
            raise UserError(f"unknown storage layout {name!r} (use one of {', '.join(LAYOUTS)})")
        if name.endswith("topk"):
            if topk < 1:
                raise UserError(f"layout {name} needs topk >= 1, not {topk}")
            return cls(name, int(topk))
        return cls(name, 0)


def bytes_per_token(layout: Layout, n_aux: int, hidden_size: int, dtype: str) -> int:
    """Bytes a shard spends per token in ``layout`` (excluding the few bytes of per-sample offsets)."""
    esize = torch.empty((), dtype=STORE_DTYPES[dtype]).element_size()
    size = 4 + 1  # input_ids int32 + loss_mask uint8
    size += n_aux * hidden_size + 4 * n_aux if layout.aux_fp8 else n_aux * hidden_size * esize
    size += layout.topk * 8 + 4 if layout.uses_topk else hidden_size * esize
    return size


def quantize_fp8(x: torch.Tensor, n_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n_aux*H) -> (float8_e4m3fn (N, n_aux*H), float32 scales (N, n_aux)); one absmax scale per token+layer."""
    n, width = x.shape
    blocks = x.float().reshape(n, n_aux, width // n_aux)  # (N, n_aux, H)
    scales = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # (N, n_aux)
    q = (blocks / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, width), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, width = q.shape
    n_aux = scales.shape[-1]
    x = q.float().reshape(n, n_aux, width // n_aux) * scales.float().unsqueeze(-1)
    return x.reshape(n, width).to(dtype)
