"""The DeepSeek-V3 MTP layer's decoder block (``model.layers.{N+k}.*``): multi-head latent attention and a
mixture-of-experts (or dense) MLP, as vLLM 0.32's ``DeepseekV2DecoderLayer`` runs it inside ``deepseek_mtp.py``.

The parameters are ``transformers``' own DeepSeek-V3 modules (``DeepseekV3Attention``'s projections and norms,
``DeepseekV3MoE`` / ``DeepseekV3MLP``, ``DeepseekV3RMSNorm``), so their names are the checkpoint's; the
attention arithmetic is re-done here (:func:`mla`) so that it runs on the draft's KV cache and training masks:

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))    (or q_proj(x))     # (B, nh, T, nope + rope)
    c, k_pe  = split(kv_a_proj_with_mqa(x), [kv_lora_rank, rope])
    k_nope,v = split(kv_b_proj(kv_a_layernorm(c)), [nope, v_head])        # per head
    q_pe, k_pe = rope(q_pe), rope(k_pe)      # INTERLEAVED pairs (vLLM: is_neox_style=False), k_pe shared by heads
    out      = o_proj(softmax(q.k * scaling) v)      # scaling = (nope+rope)^-0.5 (x yarn mscale^2)

The MoE is ``DeepseekV3MoE``: sigmoid router scores + ``e_score_correction_bias`` for the choice, group-limited
top-k, weights renormalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``, plus the shared experts
— vLLM's ``grouped_topk`` with ``scoring_func: sigmoid`` and ``topk_method: noaux_tc`` (other routers refused).
The layer is an MoE exactly when vLLM makes it one: ``n_routed_experts`` and ``N+k >= first_k_dense_replace``
and ``(N+k) % moe_layer_freq == 0``.

Checkpoint names differ only for the routed experts: transformers fuses them into ``mlp.experts.gate_up_proj
[E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``; the checkpoint has ``mlp.experts.{e}.{gate,up,down}_proj
.weight`` (:func:`to_checkpoint` / :func:`from_checkpoint`, exact inverses).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.attention import KVCache, attend_cached

__all__ = ["FIELDS", "block_forward", "block_modules", "config_fields", "from_checkpoint", "mla", "to_checkpoint"]

# The verifier config fields the MTP block needs (kept in the draft's kwargs under ``deepseek``)
FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
          "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
          "routed_scaling_factor", "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq", "hidden_act",
          "attention_bias", "scoring_func", "topk_method")
DEFAULTS = {"q_lora_rank": None, "n_routed_experts": None, "n_shared_experts": None, "moe_layer_freq": 1,
            "first_k_dense_replace": 0, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
            "topk_group": 1, "hidden_act": "silu", "attention_bias": False, "scoring_func": "softmax",
            "topk_method": None, "num_experts_per_tok": None, "moe_intermediate_size": None}


def config_fields(get, where: str) -> dict[str, Any]:
    """The ``deepseek`` kwargs from a verifier config (``get(key, default)``); bad routers are refused."""
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if get(k) is None]
    if missing:
        raise UserError(f"{where} is missing DeepSeek-V3 field(s) {', '.join(missing)}")
    out = {k: get(k, DEFAULTS.get(k)) for k in FIELDS}
    if out["n_routed_experts"] and (out["scoring_func"] != "sigmoid" or out["topk_method"] != "noaux_tc"):
        raise UserError(f"{where}: the MTP layer supports DeepSeek-V3's router only (scoring_func sigmoid, "
                        f"topk_method noaux_tc), not {out['scoring_func']!r} / {out['topk_method']!r}")
    if out["hidden_act"] != "silu":
        raise UserError(f"{where}: hidden_act {out['hidden_act']!r} (vLLM's DeepSeek MTP layer supports silu only)")
    return out


def is_moe(fields: Mapping[str, Any], layer_idx: int) -> bool:
    """vLLM's rule (``DeepseekV2DecoderLayer``) for whether decoder layer ``layer_idx`` has a routed MoE."""
    return bool(fields["n_routed_experts"]) and layer_idx >= int(fields["first_k_dense_replace"]) \
        and layer_idx % int(fields["moe_layer_freq"] or 1) == 0


def hf_config(fields: Mapping[str, Any], *, vocab_size: int, hidden_size: int, intermediate_size: int,
              num_attention_heads: int, rms_norm_eps: float, rope_parameters: dict[str, Any],
              max_position_embeddings: int):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads, rms_norm_eps=rms_norm_eps,
        rope_parameters=dict(rope_parameters), max_position_embeddings=max_position_embeddings,
        rope_interleave=True, first_k_dense_replace=0,
        **{k: fields[k] for k in FIELDS if k not in ("first_k_dense_replace", "moe_layer_freq", "scoring_func",
                                                     "topk_method") and fields[k] is not None})
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


def block_modules(config, moe: bool) -> dict[str, nn.Module]:
    """The block's modules, registered by the draft under the checkpoint's names (``self_attn``, ``mlp`` ...)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3MLP,
        DeepseekV3MoE,
        DeepseekV3RMSNorm,
    )

    return {"input_layernorm": DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            "self_attn": DeepseekV3Attention(config, layer_idx=0),
            "post_attention_layernorm": DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            "mlp": DeepseekV3MoE(config) if moe else DeepseekV3MLP(config)}


def rotary(config) -> nn.Module:
    """transformers' DeepSeek-V3 RoPE (``qk_rope_head_dim`` wide, the verifier's ``rope_parameters``)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    return DeepseekV3RotaryEmbedding(config)


def block_forward(m: nn.Module, u: torch.Tensor, position_ids: torch.Tensor, attention_mask,
                  cache: KVCache | None) -> torch.Tensor:
    """``input_layernorm -> MLA -> residual -> post_attention_layernorm -> MoE/MLP -> residual`` on ``m``'s
    modules; ``u [B, T, H]`` -> ``[B, T, H]`` (before the final norm)."""
    cos, sin = m.rotary(u, position_ids)  # (B, T, rope)
    r = u + mla(m.self_attn, m.input_layernorm(u), cos, sin, attention_mask, cache)  # (B, T, H)
    return r + m.mlp(m.post_attention_layernorm(r))


def mla(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask,
        cache: KVCache | None) -> torch.Tensor:
    """Multi-head latent attention of ``x [B, T, H]`` with the parameters of a ``DeepseekV3Attention``."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    b, t, _ = x.shape
    nh, nope, rope, vd = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q = attn.q_proj(x) if attn.q_proj is not None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(b, t, nh, nope + rope).transpose(1, 2)  # (B, nh, T, nope + rope)
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    c, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c)).view(b, t, nh, nope + vd).transpose(1, 2)
    k_nope, v = kv.split([nope, vd], dim=-1)  # (B, nh, T, nope), (B, nh, T, vd)
    # de-interleaves q and k alike (the same permutation of both, so q.k equals vLLM's interleaved rotation)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, t, rope), cos, sin)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(b, nh, t, rope)], dim=-1)  # (B, nh, T, nope + rope)
    if vd < nope + rope:  # every attention path expects one head dim: zero-pad v, cut the output back
        v = torch.nn.functional.pad(v, (0, nope + rope - vd))
    out = attend_cached(q, k, v, attention_mask, cache, scale=attn.scaling)[..., :vd]  # (B, nh, T, vd)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, nh * vd))


@torch.no_grad()
def reset_named(module: nn.Module, std: float) -> None:
    """A fresh layer: Normal(0, std) matrices (experts and router included), unit norms, zero biases."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std)
    for name, buf in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()


def to_checkpoint(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block tensors -> checkpoint names (the fused routed experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name == "mlp.experts.gate_up_proj":  # (E, 2I, H): gate rows first, then up (transformers' chunk(2))
            for e, (gate, up) in enumerate(v.chunk(2, dim=0) for v in value):
                out[f"mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mlp.experts.down_proj":  # (E, H, I)
            for e, down in enumerate(value):
                out[f"mlp.experts.{e}.down_proj.weight"] = down
        else:
            out[name] = value
    return out


def from_checkpoint(tensors: Mapping[str, torch.Tensor], block_names: list[str], where: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (names after the layer prefix) -> the block's ``block_names`` (inverse of
    :func:`to_checkpoint`); a missing tensor is a one-line error naming it."""
    out: dict[str, torch.Tensor] = {}
    for name in block_names:
        if name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            n = len({k.split(".")[2] for k in tensors if k.startswith("mlp.experts.")})
            if n == 0:
                raise UserError(f"{where} lacks the routed experts mlp.experts.{{e}}.*")
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            keys = [f"mlp.experts.{e}.{p}.weight" for e in range(n) for p in parts]
            absent = [k for k in keys if k not in tensors]
            if absent:
                raise UserError(f"{where} lacks MTP tensor(s) {', '.join(absent[:3])}")
            rows = [torch.cat([tensors[f"mlp.experts.{e}.{p}.weight"] for p in parts], dim=0) for e in range(n)]
            out[name] = torch.stack(rows)
        elif name not in tensors:
            raise UserError(f"{where} lacks MTP tensor {name}")
        else:
            out[name] = tensors[name]
    return out
