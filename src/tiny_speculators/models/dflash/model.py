"""The DFlash draft (block diffusion, arXiv 2602.06036): exactly what vLLM 0.32 runs for ``method: dflash``
(``vllm/model_executor/models/qwen3_dflash.py`` + ``vllm/v1/spec_decode/dflash.py``).

The verifier's states at the context positions are fused once and injected as extra keys/values into every
draft layer ("KV injection"); a block of ``L`` query slots (the anchor token, then mask tokens) attends to that
context and bidirectionally to itself, and proposes ``L - 1`` tokens in one forward::

    c        = hidden_norm(fc(concat(aux_1, ..., aux_n)))          # context states, (B, T, H)
    K_i, V_i = rope(k_norm_i(k_proj_i(c)), pos_ctx), v_proj_i(c)    # layer i's injected keys/values, (B, Hkv, T, D)
    x        = embed(ids)                                          # block: [anchor, mask, ..., mask], (B, Q, H)
    x        = x + o_proj_i(Attn(q = rope(q_norm_i(q_proj_i(ln_i(x)))), keys = [K_i | own block's keys]))
    x        = x + mlp_i(post_attention_layernorm_i(x))             # for i = 0 .. L_draft-1 (Qwen3 layers)
    logits   = lm_head(norm(x))                                    # (B, Q, draft_vocab); slot j predicts token j

Positions: context keys sit at their own positions; block slot ``j`` of the anchor at position ``p`` sits at
``p + j``. At inference the anchor is the verifier's bonus token at ``P + 1`` and the context is every verified
position ``<= P`` (vLLM writes the block's own keys into its cache and overwrites them with context keys next
step). A query sees the context positions before its anchor (``ctx_mask``) and its whole block, nothing else.
The embeddings (the mask slots use ``embed(mask_token_id)``) and ``lm_head`` are the verifier's (frozen).

Quick check (tiny CPU draft)::

    python -c "import torch; from tiny_speculators.models.dflash.model import DFlashDraft; \
d = DFlashDraft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=100, num_aux=5); \
ctx = d.context(torch.randn(1, 6, 160), torch.arange(6)[None]); \
print(d(torch.tensor([[7, 0, 0, 0]]), torch.arange(6, 10)[None], ctx, block_size=4).shape)"
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.layers import (
    MLP,
    RMSNorm,
    add_output_layers,
    apply_rope,
    check_mask_token,
    init_weights,
    layer_kwargs,
    rotary_of,
    to_target_ids,
)
from tiny_speculators.models.shape import DraftShape

__all__ = ["KWARGS", "DFlashDraft", "block_attention"]

# The draft's kwargs in the order its checkpoints have always written them
KWARGS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "draft_vocab_size", "num_layers", "block_size", "mask_token_id", "target_hidden_size", "num_aux",
          "rms_norm_eps", "rope_parameters", "max_position_embeddings", "attention_bias", "causal", "train_embeddings",
          "train_lm_head", "hidden_act", "aux_layer_ids")

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (B, Hkv, T, D), post-RoPE


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int,
                    scale: float, causal: bool = False) -> torch.Tensor:
    """Each query sees the context keys allowed by ``ctx_mask`` and every key of its own block (with ``causal``:
    the block's keys up to its own slot).

    ``q [B, Hq, Q, D]`` with ``Q = N * block_size`` (N blocks laid out one after another), ``k_ctx/v_ctx
    [B, Hkv, T, D]``, ``k_blk/v_blk [B, Hkv, Q, D]``, ``ctx_mask`` bool ``[B, Q, T]`` (None: all of the context).
    One softmax over [context | own block] per query, in fp32. Returns ``[B, Hq, Q, D]``.
    """
    b, hq, q_len, d = q.shape
    rep = hq // k_ctx.shape[1]
    if rep > 1:
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, 1), v_ctx.repeat_interleave(rep, 1)
        k_blk, v_blk = k_blk.repeat_interleave(rep, 1), v_blk.repeat_interleave(rep, 1)
    n = q_len // block_size
    dtype = q.dtype
    qf = q.float()
    s_ctx = qf @ k_ctx.float().transpose(-1, -2) * scale  # (B, Hq, Q, T)
    if ctx_mask is not None:
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None], float("-inf"))
    qb = qf.view(b, hq, n, block_size, d)
    kb = k_blk.float().view(b, hq, n, block_size, d)
    s_blk = qb @ kb.transpose(-1, -2) * scale  # (B, Hq, N, L, L)
    if causal:
        tril = torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).tril()
        s_blk = s_blk.masked_fill(~tril, float("-inf"))
    s_blk = s_blk.reshape(b, hq, q_len, block_size)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    p_ctx, p_blk = p.split([s_ctx.shape[-1], block_size], dim=-1)
    out = p_ctx @ v_ctx.float()  # (B, Hq, Q, D)
    out = out + (p_blk.view(b, hq, n, block_size, block_size) @ v_blk.float().view(b, hq, n, block_size, d)
                 ).view(b, hq, q_len, d)
    return out.to(dtype)


class DFlashAttention(nn.Module):
    """Qwen3-style attention (per-head q/k RMSNorm, always) whose keys are [injected context | own block]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 eps: float, causal: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.causal = num_heads, num_kv_heads, head_dim, causal
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)  # vLLM: o_proj bias = attention_bias
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, H]`` -> post-RoPE keys and values ``[B, Hkv, T, D]`` (also the context injection)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], ctx_mask, block_size: int):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, Hq, Q, D)
        k, v = self.keys_values(x, cos, sin)  # (B, Hkv, Q, D)
        out = block_attention(q, context[0], context[1], k, v, ctx_mask, block_size, 1.0 / math.sqrt(self.head_dim),
                              self.causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, *, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                 rms_norm_eps, attention_bias, causal) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = DFlashAttention(hidden_size, num_attention_heads, num_key_value_heads, head_dim,
                                         attention_bias, rms_norm_eps, causal)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, x, cos, sin, context, ctx_mask, block_size: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, ctx_mask, block_size)  # (B, Q, H)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """DFlash draft: ``num_layers`` Qwen3 layers over [anchor, mask...] blocks, context injected as keys/values.

    Args:
        causal: causal attention inside the block (vLLM's ``dflash_config.causal``); DFlash's is bidirectional.
        num_layers: draft decoder layers.
        block_size: L, the slots per block (anchor + L-1 mask slots) it was trained with.
        mask_token_id: the token id fed at mask slots (its embedding is the verifier's).
        num_aux: verifier layers whose states are fused (about 5 in DFlash).
        train_lm_head: leave the verifier's lm_head trainable (frozen by default, as the embeddings).
        shape: the :class:`~tiny_speculators.models.shape.DraftShape` fields (the verifier's shapes; its
            ``draft_vocab_size`` is usually the verifier's whole vocabulary: its full head).
    """

    def __init__(
        self,
        *,
        num_layers: int = 2,
        block_size: int = 8,
        mask_token_id: int = 0,
        num_aux: int = 5,
        causal: bool = False,
        train_lm_head: bool = False,
        **shape: Any,
    ) -> None:
        super().__init__()
        s = DraftShape(**shape, num_aux=num_aux)
        if num_layers < 1 or block_size < 2:
            raise UserError(f"num_layers must be >= 1 and block_size >= 2 (got {num_layers}, {block_size})")
        check_mask_token(mask_token_id, s.vocab_size)
        self.kwargs = s.record(  # exactly what save_draft writes and load_draft rebuilds from
            KWARGS, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id, causal=causal,
            train_lm_head=train_lm_head)
        self.hidden_size, self.draft_vocab_size, self.num_aux = s.hidden_size, s.draft_vocab_size, s.num_aux
        self.block_size, self.mask_token_id = block_size, mask_token_id

        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(**layer_kwargs(self.kwargs), causal=causal)
                                     for _ in range(num_layers)])
        add_output_layers(self)  # norm, lm_head, rotary, d2t, t2d
        self.reset_parameters()
        self._freeze()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for linear and embedding weights, zero biases, unit norms."""
        init_weights(self, std)

    def _freeze(self) -> None:
        self.embed_tokens.weight.requires_grad_(bool(self.kwargs["train_embeddings"]))
        self.lm_head.weight.requires_grad_(bool(self.kwargs["train_lm_head"]))

    def after_load(self, device: str | torch.device) -> None:
        """After weights were assigned into a meta-device build: rebuild RoPE buffers, re-freeze shared weights."""
        self.rotary = rotary_of(self.kwargs).to(device)
        self._freeze()

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., num_aux*Ht]`` verifier states -> context states ``hidden_norm(fc(.))`` ``[..., H]``."""
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def context(self, aux_hidden_states: torch.Tensor, position_ids: torch.Tensor) -> ContextKV:
        """Injected keys/values of every layer for verifier states ``[B, T, num_aux*Ht]`` at ``position_ids [B, T]``."""
        c = self.fuse(aux_hidden_states)  # (B, T, H)
        cos, sin = self.rotary(position_ids, c.dtype)
        return [layer.self_attn.keys_values(c, cos, sin) for layer in self.layers]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pre-norm output ``[..., H]`` -> draft-vocab logits ``[..., draft_vocab]``."""
        return self.lm_head(self.norm(hidden_states))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, context: ContextKV,
                ctx_mask: torch.Tensor | None = None, *, block_size: int) -> torch.Tensor:
        """Pre-norm outputs ``[B, Q, H]`` of ``Q = N * block_size`` block slots (N blocks one after another).

        Args:
            input_ids: ``[B, Q]`` target ids: each block's anchor token, then ``mask_token_id``.
            position_ids: ``[B, Q]`` RoPE positions (the anchor's position + slot index).
            context: :meth:`context` of the verified positions (keys ``[B, Hkv, T, D]`` per layer).
            ctx_mask: bool ``[B, Q, T]``: which context positions each slot sees (None: all).
            block_size: slots per block (may be smaller than the trained ``self.block_size`` at inference).
        """
        x = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # (B, Q, H)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer, ctx in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, ctx, ctx_mask, block_size)
        return x

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_target_ids(self, draft_ids)
