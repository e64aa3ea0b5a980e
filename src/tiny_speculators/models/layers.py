"""The building blocks every draft family's layers are made of, and the constructor steps they share.

Modules (names as in the speculators format, so state-dict keys are the same in every family): ``RMSNorm``,
``Rotary`` (RoPE), the gated SiLU ``MLP``, ``Attention`` over a :class:`~tiny_speculators.models.attention.KVCache`,
the fused-input ``DecoderLayer`` (reads ``concat(embedding, hidden)``: EAGLE-3's layer, also P-EAGLE's first) and
the plain pre-norm ``LlamaLayer`` that follows it. Constructor steps: the checks on a draft's keyword arguments, the
layer shape taken from them, the output norm + ``lm_head`` + RoPE + vocabulary maps, and the weight init. The base
``FusedInputDraft``: the input layers and methods of the drafts that read EAGLE-3's fused verifier states.

    python -c "import torch; from tiny_speculators.models.layers import RMSNorm, Rotary; \
cos, sin = Rotary(16, {}, 64)(torch.arange(5)[None], torch.float32); print(RMSNorm(16, 1e-6)(cos).shape)"
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache, attend_cached

__all__ = [
    "LAYER_FIELDS", "MLP", "Attention", "DecoderLayer", "DraftOutput", "FusedInputDraft", "LlamaLayer", "RMSNorm",
    "Rotary", "add_output_layers", "apply_rope", "check_aux_layer_ids", "check_heads", "check_layer_type",
    "check_mask_token", "decoder_stack", "init_weights", "layer_kwargs", "o_proj_bias", "rope_or_default",
    "rotary_of", "to_target_ids", "to_target_logits",
]

# The keyword arguments every decoder layer takes from its draft's kwargs (families add their own flags)
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "attention_bias")


@dataclass
class DraftOutput:
    logits: torch.Tensor | None  # (B, T, draft_vocab); None when forward(..., logits=False)
    hidden_states: torch.Tensor  # (B, T, H) the output fed back as the next step's hidden state


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight (Llama / vLLM convention)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Neox-style RoPE (rotate-half) with the verifier's ``rope_parameters`` (HF v5 layout)."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        params = dict(rope_parameters)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", 10000.0))
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        elif rope_type in ("linear", "llama3", "yarn"):
            from transformers import PretrainedConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # A throwaway config object: only the rope init function sees it, the module keeps tensors.
            cfg = PretrainedConfig()
            cfg.rope_parameters = {**params, "rope_type": rope_type, "rope_theta": theta}
            cfg.head_dim = head_dim
            cfg.hidden_size, cfg.num_attention_heads = head_dim, 1  # some init functions derive head_dim
            cfg.max_position_embeddings = max_position_embeddings
            cfg.partial_rotary_factor = 1.0
            with torch.device("cpu"):  # also inside a meta-device build (a load): yarn reads tensor values
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        else:
            raise UserError(f"rope_type {rope_type!r} is not supported by the draft "
                            "(supported: default, linear, llama3, yarn)")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, D]``, ``cos/sin [B, T, D]``."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def o_proj_bias(attention_bias: bool, layer_type: str) -> bool:
    """vLLM: Llama's ``bias_o_proj`` is ``attention_bias``; Qwen3's o_proj never has a bias (only q/k/v do)."""
    return attention_bias and layer_type != "qwen3"


class Attention(nn.Module):
    """Attention over a :class:`KVCache`; with ``window`` a sliding-window layer (when the caller gives no mask:
    the explicit masks carry the window themselves, :mod:`~tiny_speculators.models.attention`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float, input_size: int | None = None, o_bias: bool = False,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.window = num_heads, num_kv_heads, head_dim, window
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
        out = attend_cached(q, k, v, attention_mask, cache, scale=1.0 / math.sqrt(self.head_dim),
                            window=self.window)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, *, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                 rms_norm_eps, attention_bias, layer_type, norm_before_residual, sliding_window=None) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_attention_heads, num_key_value_heads, head_dim,
                                   attention_bias, layer_type == "qwen3", rms_norm_eps,
                                   o_bias=o_proj_bias(attention_bias, layer_type), window=sliding_window)
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
                 rms_norm_eps, attention_bias, layer_type, sliding_window=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_attention_heads, num_key_value_heads, head_dim, attention_bias,
                                   layer_type == "qwen3", rms_norm_eps, input_size=hidden_size,
                                   o_bias=o_proj_bias(attention_bias, layer_type), window=sliding_window)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, x, cos, sin, attention_mask, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cache)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))


def check_aux_layer_ids(aux_layer_ids, num_aux: int) -> None:
    if aux_layer_ids is not None and len(aux_layer_ids) != num_aux:
        raise UserError(f"{len(aux_layer_ids)} aux layer ids {list(aux_layer_ids)} for a draft that fuses "
                        f"{num_aux} verifier layers")


def check_heads(num_attention_heads: int, num_key_value_heads: int) -> None:
    if num_attention_heads % num_key_value_heads:
        raise UserError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                        f"num_key_value_heads {num_key_value_heads}")


def check_mask_token(mask_token_id: int, vocab_size: int) -> None:
    if not 0 <= mask_token_id < vocab_size:
        raise UserError(f"mask_token_id {mask_token_id} is not a token id of the verifier (0..{vocab_size - 1})")


def check_layer_type(layer_type: str) -> None:
    if layer_type not in ("llama", "qwen3"):
        raise UserError(f"layer_type must be 'llama' or 'qwen3', got {layer_type!r}")


def rope_or_default(rope_parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``rope_parameters``; plain RoPE (theta 10000) when there are none."""
    return dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})


def layer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A draft's kwargs -> the :data:`LAYER_FIELDS` its decoder layers are built from."""
    return {k: kwargs[k] for k in LAYER_FIELDS}


def rotary_of(kwargs: Mapping[str, Any]) -> Rotary:
    """The RoPE module a draft's kwargs describe (built anew after a meta-device load)."""
    return Rotary(kwargs["head_dim"], kwargs["rope_parameters"], kwargs["max_position_embeddings"])


def decoder_stack(kwargs: Mapping[str, Any], num_layers: int) -> nn.ModuleList:
    """Layer 0 the fused-input :class:`DecoderLayer`, then ``num_layers - 1`` plain :class:`LlamaLayer` s, shaped by a
    draft's ``kwargs`` (with its ``layer_type``, ``norm_before_residual`` and any ``sliding_window``: every layer
    then attends over that window)."""
    shape = dict(layer_kwargs(kwargs), layer_type=kwargs["layer_type"], sliding_window=kwargs.get("sliding_window"))
    return nn.ModuleList([DecoderLayer(**shape, norm_before_residual=kwargs["norm_before_residual"]),
                          *(LlamaLayer(**shape) for _ in range(num_layers - 1))])


def add_output_layers(draft: nn.Module) -> None:
    """The end of a draft's constructor: final ``norm``, ``lm_head`` over the draft vocabulary, ``rotary``, and the
    vocabulary maps ``d2t`` (zeros: draft id i is target id i) and ``t2d`` (the first ``draft_vocab_size`` ids)."""
    kw = draft.kwargs
    hidden, vocab, draft_vocab = kw["hidden_size"], kw["vocab_size"], kw["draft_vocab_size"]
    draft.norm = RMSNorm(hidden, kw["rms_norm_eps"])
    draft.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
    draft.rotary = rotary_of(kw)
    draft.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.register_buffer("t2d", t2d)


@torch.no_grad()
def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) for linear and embedding weights, zeros for biases, ones for norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(0.0, std)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, std)
        elif isinstance(m, RMSNorm):
            m.weight.fill_(1.0)


def to_target_ids(draft: nn.Module, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids -> target-vocab ids (``i + d2t[i]``)."""
    return draft_ids + draft.d2t[draft_ids]


class FusedInputDraft(nn.Module):
    """What the drafts that read EAGLE-3's fusion of verifier states share (EAGLE-3's and P-EAGLE's): the input
    layers, their init, ``fuse``, the rebuild after a meta-device load and the vocabulary map. A subclass records its
    ``kwargs`` first, then calls :meth:`add_input_layers`."""

    def add_input_layers(self, *, norm_before_fc: bool, fc_norm: bool = False) -> None:
        """``embed_tokens`` (frozen unless ``train_embeddings``); with ``norm_before_fc`` one RMSNorm ``input_norm``
        over the ``num_aux * Ht`` input of ``fc``; with ``fc_norm`` one RMSNorm per aux chunk (``fc_norm.{i}``);
        then ``fc``."""
        kw = self.kwargs
        self.embed_tokens = nn.Embedding(kw["vocab_size"], kw["hidden_size"])
        self.embed_tokens.weight.requires_grad_(kw["train_embeddings"])
        width = kw["num_aux"] * kw["target_hidden_size"]
        self.input_norm = RMSNorm(width, kw["rms_norm_eps"]) if norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(kw["target_hidden_size"], kw["rms_norm_eps"])
                                       for _ in range(kw["num_aux"])]) if fc_norm else None)
        self.fc = nn.Linear(width, kw["hidden_size"], bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for linear and embedding weights, zeros for biases, ones for norms."""
        init_weights(self, std)

    def after_load(self, device: str | torch.device) -> None:
        """After weights were assigned into a meta-device build: rebuild RoPE buffers, re-freeze embeddings."""
        self.rotary = rotary_of(self.kwargs).to(device)
        self.embed_tokens.weight.requires_grad_(bool(self.kwargs.get("train_embeddings", False)))

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., num_aux*Ht]`` verifier states -> ``[..., H]``: the optional ``input_norm`` (one norm over the whole
        input), the optional ``fc_norm`` (one norm per aux chunk), then ``fc``."""
        x = aux_hidden_states.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, x.chunk(self.num_aux, dim=-1), strict=True)], dim=-1)
        return self.fc(x)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_target_ids(self, draft_ids)


def to_target_logits(draft: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf for ids outside the draft vocab)."""
    target_ids = draft.d2t.new_tensor(range(draft.draft_vocab_size)) + draft.d2t
    full = logits.new_full((*logits.shape[:-1], draft.t2d.numel()), float("-inf"))
    full[..., target_ids.to(logits.device)] = logits
    return full
