"""The building blocks every draft family's layers are made of, and the constructor steps they share.

Modules (names as in the speculators format, so state-dict keys are the same in every family): ``RMSNorm``,
``Rotary`` (RoPE) and the gated SiLU ``MLP``. Constructor steps: the checks on a draft's keyword arguments, the
layer shape taken from them, the output norm + ``lm_head`` + RoPE + vocabulary maps, and the weight init.

    python -c "import torch; from tiny_speculators.models.layers import RMSNorm, Rotary; \
cos, sin = Rotary(16, {}, 64)(torch.arange(5)[None], torch.float32); print(RMSNorm(16, 1e-6)(cos).shape)"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError

__all__ = [
    "LAYER_FIELDS", "MLP", "DraftOutput", "RMSNorm", "Rotary", "add_output_layers",
    "apply_rope", "check_aux_layer_ids", "check_draft_shape", "check_heads", "check_mask_token", "init_weights",
    "layer_kwargs", "rope_or_default", "rotary_of", "to_target_logits",
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


def check_draft_shape(*, num_aux: int, aux_layer_ids, layer_type: str, hidden_act: str, num_attention_heads: int,
                      num_key_value_heads: int) -> None:
    """The checks a draft of fused verifier layers makes on its keyword arguments (one-line UserErrors)."""
    check_aux_layer_ids(aux_layer_ids, num_aux)
    if layer_type not in ("llama", "qwen3"):
        raise UserError(f"layer_type must be 'llama' or 'qwen3', got {layer_type!r}")
    if hidden_act != "silu":
        raise UserError(f"the draft supports hidden_act 'silu' only, got {hidden_act!r}")
    check_heads(num_attention_heads, num_key_value_heads)


def rope_or_default(rope_parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``rope_parameters``; plain RoPE (theta 10000) when there are none."""
    return dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})


def layer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A draft's kwargs -> the :data:`LAYER_FIELDS` its decoder layers are built from."""
    return {k: kwargs[k] for k in LAYER_FIELDS}


def rotary_of(kwargs: Mapping[str, Any]) -> Rotary:
    """The RoPE module a draft's kwargs describe (built anew after a meta-device load)."""
    return Rotary(kwargs["head_dim"], kwargs["rope_parameters"], kwargs["max_position_embeddings"])


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


def to_target_logits(draft: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf for ids outside the draft vocab)."""
    target_ids = draft.d2t.new_tensor(range(draft.draft_vocab_size)) + draft.d2t
    full = logits.new_full((*logits.shape[:-1], draft.t2d.numel()), float("-inf"))
    full[..., target_ids.to(logits.device)] = logits
    return full
