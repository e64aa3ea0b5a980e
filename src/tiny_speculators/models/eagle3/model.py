"""The EAGLE-3 draft model: exactly the computation vLLM runs when it serves the draft.

One decoder layer (or ``num_layers``) on top of the verifier's token embeddings and a fusion of verifier hidden
states (equations as in vLLM's ``llama_eagle3.py``; names as in the speculators format)::

    g      = fc(concat(aux_1, ..., aux_n))                       # fuse(): step 0 only,  (B, T, H)
    e      = input_layernorm(embed_tokens(input_ids))            # (B, T, H)
    hn     = hidden_norm(h);   r = hn if norm_before_residual else h
    a      = o_proj(Attn(q/k/v_proj(concat(e, hn))))            # q/k/v take 2H, RoPE on q/k
    r      = a + r;            x = post_attention_layernorm(r)
    out    = mlp(x) + r                                          # PRE-norm output of layer 0
    # layers 1..L-1 (num_layers > 1): plain Llama/Qwen3 layers on the H stream, the embedding not re-injected
    out    = out + attn_i(input_layernorm_i(out));   out = out + mlp_i(post_attention_layernorm_i(out))
    logits = lm_head(norm(out))                                  # (B, T, draft_vocab)

``h`` is ``fuse(aux)`` at the first draft step and ``out`` of the previous draft step afterwards:
vLLM feeds the pre-norm sum back (its model returns ``(norm(out), out)`` and keeps the second).
Draft id ``i`` is target id ``i + d2t[i]``.

Quick check (tiny CPU draft)::

    python -c "import torch; from tiny_speculators.models.eagle3.model import Eagle3Draft; \
d = Eagle3Draft(vocab_size=100, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
intermediate_size=64, draft_vocab_size=50); ids = torch.randint(0, 100, (1, 5)); \
print(d(ids, d.fuse(torch.randn(1, 5, 96)), torch.arange(5)[None]).logits.shape)"
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3.attention import attend
from tiny_speculators.models.layers import (
    MLP,
    DraftOutput,
    RMSNorm,
    Rotary,
    add_output_layers,
    apply_rope,
    check_draft_shape,
    init_weights,
    layer_kwargs,
    rope_or_default,
    rotary_of,
    to_target_logits,
)

__all__ = ["MLP", "Attention", "DecoderLayer", "Eagle3Draft", "Eagle3Output", "KVCache", "LlamaLayer", "RMSNorm",
           "Rotary", "apply_rope", "check_draft_shape", "init_weights", "to_target_logits"]

Eagle3Output = DraftOutput  # logits (B, T, draft_vocab) or None, hidden_states (B, T, H) pre-norm output


class KVCache:
    """Keys/values of the draft's first attention layer, ``[B, n_kv, S, D]`` each (post-RoPE), and those of any
    later layers in caches of their own (:meth:`layer`).

    ``forward(..., cache=cache)`` appends the new keys/values; ``crop(n)`` drops everything after
    the first ``n`` positions of every layer (rollback after rejected draft tokens).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.later: list[KVCache] = []  # layers 1, 2, ...

    def layer(self, index: int) -> KVCache:
        """The cache of decoder layer ``index`` (this one for 0), made on first use."""
        if index == 0:
            return self
        while len(self.later) < index:
            self.later.append(KVCache())
        return self.later[index - 1]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if self.k is not None:
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]
        for cache in self.later:
            cache.crop(length)

    def reset(self) -> None:
        self.k = self.v = None
        self.later = []


def o_proj_bias(attention_bias: bool, layer_type: str) -> bool:
    """vLLM: Llama's ``bias_o_proj`` is ``attention_bias``; Qwen3's o_proj never has a bias (only q/k/v do)."""
    return attention_bias and layer_type != "qwen3"


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float, input_size: int | None = None, o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        input_size = input_size or 2 * hidden_size  # the EAGLE-3 layer reads concat(embedding, hidden)
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm:  # Qwen3: RMSNorm over each head's dim, before RoPE
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, attention_mask, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, Hq, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)  # (B, Hkv, S, D), S = past + T
        mask = attention_mask
        if mask is None and past > 0:  # causal over cached + new keys
            s = k.shape[2]
            mask = torch.arange(s, device=x.device)[None, :] <= (past + torch.arange(t, device=x.device))[:, None]
        if isinstance(mask, torch.Tensor) and mask.shape[-1] != k.shape[2]:
            raise ValueError(f"attention_mask covers {mask.shape[-1]} keys, but there are {k.shape[2]}")
        out = attend(q, k, v, mask, scale=1.0 / math.sqrt(self.head_dim), causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, *, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                 rms_norm_eps, attention_bias, layer_type, norm_before_residual) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_attention_heads, num_key_value_heads, head_dim,
                                   attention_bias, layer_type == "qwen3", rms_norm_eps,
                                   o_bias=o_proj_bias(attention_bias, layer_type))
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, embeds, hidden, cos, sin, attention_mask, cache) -> torch.Tensor:
        e = self.input_layernorm(embeds)  # (B, T, H)
        hn = self.hidden_norm(hidden)  # (B, T, H)
        residual = hn if self.norm_before_residual else hidden
        a = self.self_attn(torch.cat([e, hn], dim=-1), cos, sin, attention_mask, cache)  # (B, T, H)
        residual = a + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual  # pre-norm output


class LlamaLayer(nn.Module):
    """A plain pre-norm Llama (or Qwen3) decoder layer on the H-wide residual stream (layers 1..L-1)."""

    def __init__(self, *, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                 rms_norm_eps, attention_bias, layer_type) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_attention_heads, num_key_value_heads, head_dim, attention_bias,
                                   layer_type == "qwen3", rms_norm_eps, input_size=hidden_size,
                                   o_bias=o_proj_bias(attention_bias, layer_type))
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, x, cos, sin, attention_mask, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft (one decoder layer, or ``num_layers``), built from plain keyword arguments.

    Args:
        vocab_size: verifier (target) vocabulary size; size of ``embed_tokens`` and ``t2d``.
        hidden_size: draft hidden size H (= the verifier's, since embeddings are shared).
        num_attention_heads, num_key_value_heads, head_dim: attention shape (GQA allowed).
        intermediate_size: MLP width.
        draft_vocab_size: rows of ``lm_head``.
        target_hidden_size: verifier hidden size Ht (default H); ``fc`` takes ``num_aux * Ht``.
        num_aux: number of verifier layers whose states are fused (3 in EAGLE-3).
        rms_norm_eps, rope_parameters, max_position_embeddings: as in the verifier's config.
        attention_bias: biases on q/k/v/o projections (vLLM's and HF Llama's ``attention_bias``).
        layer_type: "llama" (default) or "qwen3" (adds per-head ``q_norm``/``k_norm``).
        norm_before_residual: residual is ``hidden_norm(h)`` instead of ``h`` (vLLM flag).
        norm_before_fc: one RMSNorm (``input_norm``) over the whole ``num_aux * Ht`` input of ``fc``.
        fc_norm: one RMSNorm per aux chunk (``fc_norm.{i}``) before ``fc`` (EAGLE 3.1).
        norm_output: the step's output is ``norm(h)``: that post-norm state is fed back to the next step and
            ``lm_head`` reads it as is (speculators' ``norm_output``, its EAGLE-3 default since 0.9).
        train_embeddings: leave ``embed_tokens`` trainable (frozen by default).
        hidden_act: only "silu" (gated SiLU MLP) is supported.
        aux_layer_ids: the verifier layers whose inputs are fused (``num_aux`` of them; None = not recorded).
        num_layers: decoder layers: layer 0 the EAGLE-3 layer, the rest plain layers of ``layer_type`` (as vLLM
            runs a draft whose ``num_hidden_layers`` is above 1).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        intermediate_size: int,
        draft_vocab_size: int,
        target_hidden_size: int | None = None,
        num_aux: int = 3,
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 4096,
        attention_bias: bool = False,
        layer_type: Literal["llama", "qwen3"] = "llama",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
        train_embeddings: bool = False,
        hidden_act: str = "silu",
        aux_layer_ids: list[int] | None = None,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise UserError(f"num_layers must be at least 1, got {num_layers}")
        check_draft_shape(num_aux=num_aux, aux_layer_ids=aux_layer_ids, layer_type=layer_type, hidden_act=hidden_act,
                          num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads)
        rope_parameters = rope_or_default(rope_parameters)
        target_hidden_size = target_hidden_size or hidden_size
        self.kwargs = dict(  # exactly what save_draft writes and load_draft rebuilds from
            vocab_size=vocab_size, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, head_dim=head_dim, intermediate_size=intermediate_size,
            draft_vocab_size=draft_vocab_size, target_hidden_size=target_hidden_size, num_aux=num_aux,
            rms_norm_eps=rms_norm_eps, rope_parameters=rope_parameters,
            max_position_embeddings=max_position_embeddings, attention_bias=attention_bias, layer_type=layer_type,
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, fc_norm=fc_norm,
            norm_output=norm_output, train_embeddings=train_embeddings, hidden_act=hidden_act,
            aux_layer_ids=None if aux_layer_ids is None else [int(i) for i in aux_layer_ids],
        )
        if num_layers != 1:  # one-layer drafts keep the keyword arguments they always had
            self.kwargs["num_layers"] = int(num_layers)
        self.hidden_size, self.draft_vocab_size, self.num_aux = hidden_size, draft_vocab_size, num_aux
        self.target_hidden_size = target_hidden_size
        self.norm_output = norm_output

        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_tokens.weight.requires_grad_(train_embeddings)
        self.input_norm = RMSNorm(num_aux * target_hidden_size, rms_norm_eps) if norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(target_hidden_size, rms_norm_eps) for _ in range(num_aux)])
                        if fc_norm else None)
        self.fc = nn.Linear(num_aux * target_hidden_size, hidden_size, bias=False)
        shape = dict(layer_kwargs(self.kwargs), layer_type=layer_type)
        self.layers = nn.ModuleList([DecoderLayer(**shape, norm_before_residual=norm_before_residual),
                                     *(LlamaLayer(**shape) for _ in range(num_layers - 1))])
        add_output_layers(self)  # norm, lm_head, rotary, d2t, t2d
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for linear and embedding weights, zeros for biases, ones for norms."""
        init_weights(self, std)

    def after_load(self, device: str | torch.device) -> None:
        """After weights were assigned into a meta-device build: rebuild RoPE buffers, re-freeze embeddings."""
        self.rotary = rotary_of(self.kwargs).to(device)
        self.embed_tokens.weight.requires_grad_(bool(self.kwargs.get("train_embeddings", False)))

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, T, num_aux*Ht]`` verifier states -> ``[B, T, H]`` (optional input_norm / fc_norm, then fc)."""
        x = aux_hidden_states.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, x.chunk(self.num_aux, dim=-1), strict=True)], dim=-1)
        return self.fc(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A step's output ``[..., H]`` (pre-norm; post-norm with ``norm_output``) -> logits ``[..., draft_vocab]``."""
        return self.lm_head(hidden_states if self.norm_output else self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache: KVCache | None = None,
        *,
        logits: bool = True,
    ) -> Eagle3Output:
        """One draft step over ``T`` new positions.

        Args:
            input_ids: ``[B, T]`` target-vocab token ids.
            hidden_states: ``[B, T, H]``: ``fuse(aux)`` or the previous step's pre-norm output.
            position_ids: ``[B, T]`` RoPE positions.
            attention_mask: bool ``[B, 1, T, S]`` (True = attend) over all ``S`` keys (cached + new), a
                flex ``BlockMask``, or None for causal attention (after any cached keys).
            cache: a :class:`KVCache`; the new keys/values are appended to it.
            logits: compute ``lm_head(norm(.))``; False returns only the pre-norm output (the TTT loss
                computes logits itself, in chunks).
        """
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, T, H)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        out = self.layers[0](embeds, hidden_states, cos, sin, attention_mask, cache)  # (B, T, H)
        for i, layer in enumerate(self.layers[1:], start=1):
            out = layer(out, cos, sin, attention_mask, None if cache is None else cache.layer(i))
        if self.norm_output:
            out = self.norm(out)  # (B, T, H), fed back as it is
        return Eagle3Output(logits=self.compute_logits(out) if logits else None, hidden_states=out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (``i + d2t[i]``)."""
        return draft_ids + self.d2t[draft_ids]
