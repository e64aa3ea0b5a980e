"""Turn a verifier's config into the plain keyword arguments of :class:`Eagle3Draft`, and build one.

    from transformers import AutoConfig
    kwargs = draft_kwargs_from_verifier(AutoConfig.from_pretrained(path), draft_vocab_size=len(d2t))
    draft = build_draft(kwargs, d2t, t2d, embed_weight=verifier.get_input_embeddings().weight)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3.model import Eagle3Draft
from tiny_speculators.models.importing import copy_verifier_weights
from tiny_speculators.verifier.describe import config_value as _get
from tiny_speculators.verifier.describe import text_config

log = logging.getLogger(__name__)

_OVERRIDABLE = {
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_aux", "rms_norm_eps",
    "rope_parameters", "max_position_embeddings", "attention_bias", "layer_type", "norm_before_residual",
    "norm_before_fc", "fc_norm", "train_embeddings", "hidden_act", "aux_layer_ids", "num_layers",
}


def rope_parameters_of(cfg: Any) -> dict[str, Any]:
    """The verifier's RoPE settings in the transformers v5 layout (``rope_type`` + ``rope_theta`` + extras)."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        out = dict(params)
    else:  # transformers v4 layout: rope_theta + rope_scaling
        out = dict(_get(cfg, "rope_scaling") or {})
        out["rope_theta"] = float(_get(cfg, "rope_theta", 10000.0))
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    return out


def draft_kwargs_from_verifier(verifier_config: Any, draft_vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for :class:`Eagle3Draft` from a verifier's HF config (object or dict).

    Attention shape, MLP width, norm eps and RoPE follow the verifier (as vLLM does when it loads
    a speculators checkpoint whose ``transformer_layer_config`` is the verifier's). ``overrides``
    may change any of: ``intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_aux,
    rms_norm_eps, rope_parameters, max_position_embeddings, attention_bias, layer_type,
    norm_before_residual, norm_before_fc, fc_norm, train_embeddings, hidden_act, aux_layer_ids, num_layers``.
    """
    cfg = text_config(verifier_config)  # multimodal wrappers
    unknown = set(overrides) - _OVERRIDABLE
    if unknown:
        raise UserError(f"unknown draft setting(s) {sorted(unknown)}; allowed: {sorted(_OVERRIDABLE)}")
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    vocab = int(_get(cfg, "vocab_size"))
    if not 0 < draft_vocab_size <= vocab:
        raise UserError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the verifier's vocab size)")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        target_hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(_get(cfg, "num_key_value_heads") or heads),
        head_dim=int(_get(cfg, "head_dim") or hidden // heads),
        intermediate_size=int(_get(cfg, "intermediate_size")),
        draft_vocab_size=int(draft_vocab_size),
        num_aux=3,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters_of(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        attention_bias=bool(_get(cfg, "attention_bias", False)),
        layer_type="llama",
        norm_before_residual=False,
        norm_before_fc=False,
        fc_norm=False,
        train_embeddings=False,
        hidden_act=str(_get(cfg, "hidden_act", "silu")),
    )
    kwargs.update(overrides)
    return kwargs


def build_draft(
    kwargs: Mapping[str, Any],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
) -> Eagle3Draft:
    """A fresh draft with vocab maps, the verifier's embeddings copied in (frozen unless
    ``train_embeddings``), and optionally ``lm_head`` initialized from the verifier's lm_head rows
    selected by ``t2d`` (``lm_head_weight`` is the verifier's full ``[vocab, H]`` matrix).

    Randomly initialized weights depend on the caller's torch seed.
    """
    draft = Eagle3Draft(**kwargs)
    if embed_weight is None:
        log.warning("no verifier embeddings given: the draft's embed_tokens stay random")
    copy_verifier_weights(draft, d2t, t2d, embed_weight, lm_head_weight)
    return draft


def decoder_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The HF decoder-config fields of the draft's decoder layer(s) that every export format writes.

    RoPE goes in the v4 layout (``rope_theta``/``rope_scaling``); formats read by v5 add ``rope_parameters``.
    """
    rope = dict(kwargs["rope_parameters"])
    rope_type = rope.get("rope_type", "default")
    return {
        "vocab_size": int(kwargs["vocab_size"]),
        "hidden_size": int(kwargs["hidden_size"]),
        "intermediate_size": int(kwargs["intermediate_size"]),
        "num_hidden_layers": int(kwargs.get("num_layers", 1)),
        "num_attention_heads": int(kwargs["num_attention_heads"]),
        "num_key_value_heads": int(kwargs["num_key_value_heads"]),
        "head_dim": int(kwargs["head_dim"]),
        "hidden_act": kwargs.get("hidden_act", "silu"),
        "rms_norm_eps": float(kwargs["rms_norm_eps"]),
        "max_position_embeddings": int(kwargs["max_position_embeddings"]),
        "attention_bias": bool(kwargs.get("attention_bias", False)),
        # never tied: the draft's lm_head covers the draft vocab, its embeddings the full one
        "tie_word_embeddings": False,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
    }


def layer_shape_of(layer: Mapping[str, Any]) -> dict[str, Any]:
    """The draft keyword arguments an HF decoder config gives (a ``transformer_layer_config``, SGLang's flat
    config): vocabulary, attention and MLP shape, norm eps, RoPE, activation; what :func:`decoder_fields` wrote."""
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    return dict(
        vocab_size=int(layer["vocab_size"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters_of(layer),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        attention_bias=bool(layer.get("attention_bias", False)),
        hidden_act=layer.get("hidden_act", "silu"),
    )
