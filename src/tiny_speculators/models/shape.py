"""The shape a draft takes from its verifier (:class:`DraftShape`), and how it reads and writes HF decoder configs.

Every family's model is built from plain keyword arguments (what ``draft_config.json`` keeps as ``kwargs``): the
:class:`DraftShape` fields they all share (vocabulary, attention, MLP, norms, RoPE, the verifier states they read),
plus the family's own. A constructor takes the shared ones as ``**shape`` and records its ``kwargs`` with
:meth:`DraftShape.record`, in the key order its checkpoints have always had.

    from transformers import AutoConfig
    shape = DraftShape.from_verifier(AutoConfig.from_pretrained(path), draft_vocab_size=len(d2t), num_aux=3)
    shape.fields()  # {"vocab_size": ..., "hidden_size": ..., ...}: keyword arguments of any family's model
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiny_speculators.errors import UserError
from tiny_speculators.models.layers import check_aux_layer_ids, check_heads, rope_or_default
from tiny_speculators.verifier.describe import config_value as _get
from tiny_speculators.verifier.describe import text_config

__all__ = ["LAYER_SHAPE", "DraftShape", "decoder_fields", "layer_shape_of", "mlp_width", "rope_parameters_of",
           "verifier_shape"]


@dataclass(frozen=True)
class DraftShape:
    """What every draft's constructor shares. The first fields (:data:`LAYER_SHAPE`) are a decoder layer's shape,
    the rest describe a draft that fuses verifier states into its own vocabulary.

    Args:
        vocab_size: verifier (target) vocabulary size; size of ``embed_tokens`` and ``t2d``.
        hidden_size: draft hidden size H (= the verifier's, since embeddings are shared).
        num_attention_heads, num_key_value_heads, head_dim: attention shape (GQA allowed).
        intermediate_size: MLP width.
        rms_norm_eps, rope_parameters, max_position_embeddings: as in the verifier's config (RoPE: plain, theta
            10000, when None).
        draft_vocab_size: rows of ``lm_head`` (None: the whole vocabulary).
        target_hidden_size: verifier hidden size Ht (None: H); ``fc`` takes ``num_aux * Ht``.
        num_aux: number of verifier layers whose states are fused.
        attention_bias: biases on the attention projections (vLLM's and HF Llama's ``attention_bias``).
        train_embeddings: leave ``embed_tokens`` trainable (frozen by default).
        hidden_act: only "silu" (gated SiLU MLP) is supported.
        aux_layer_ids: the verifier layers whose states are fused (``num_aux`` of them; None = not recorded).
    """

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    num_aux: int = 3
    attention_bias: bool = False
    train_embeddings: bool = False
    hidden_act: str = "silu"
    aux_layer_ids: list[int] | None = None

    def __post_init__(self) -> None:
        """Defaults filled in (RoPE, draft vocabulary, verifier width), ids as ints; one-line UserErrors."""
        check_aux_layer_ids(self.aux_layer_ids, self.num_aux)
        if self.hidden_act != "silu":
            raise UserError(f"the draft supports hidden_act 'silu' only, got {self.hidden_act!r}")
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        fill = object.__setattr__
        fill(self, "rope_parameters", rope_or_default(self.rope_parameters))
        fill(self, "draft_vocab_size", self.draft_vocab_size or self.vocab_size)
        fill(self, "target_hidden_size", self.target_hidden_size or self.hidden_size)
        if self.aux_layer_ids is not None:
            fill(self, "aux_layer_ids", [int(i) for i in self.aux_layer_ids])

    def fields(self) -> dict[str, Any]:
        """The fields as keyword arguments (of any family's model)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def record(self, order: tuple[str, ...], **own: Any) -> dict[str, Any]:
        """A draft's ``kwargs``: these fields and the family's ``own`` ones, keyed in ``order`` (the family's
        checkpoint layout, kept byte for byte)."""
        values = {**self.fields(), **own}
        return {key: values[key] for key in order}

    @classmethod
    def from_verifier(cls, verifier_config: Any, draft_vocab_size: int, **fields: Any) -> DraftShape:
        """The shape a verifier's HF config (object or dict) gives a draft over ``draft_vocab_size`` tokens;
        ``fields`` set the rest (``num_aux``, ``aux_layer_ids`` ...)."""
        return cls(**{**verifier_shape(verifier_config, draft_vocab_size), **fields})


# The fields that are a decoder layer's shape (what a draft that fuses nothing, like MTP's layer, takes)
LAYER_SHAPE = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings")


def rope_parameters_of(cfg: Any) -> dict[str, Any]:
    """The verifier's RoPE settings in the transformers v5 layout (``rope_type`` + ``rope_theta`` + extras)."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        out = dict(params)
    else:  # transformers v4 layout: rope_theta + rope_scaling
        out = dict(_get(cfg, "rope_scaling") or {})
        out["rope_theta"] = float(_get(cfg, "rope_theta", 10000.0))
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    # a vision-language verifier's M-RoPE: the draft is text-only and runs at 1-D positions (vLLM gives a draft
    # without M-RoPE the temporal row of the verifier's positions), so it keeps the frequencies, not the sections
    for key in ("mrope_section", "mrope_interleaved"):
        out.pop(key, None)
    return out


def verifier_shape(verifier_config: Any, draft_vocab_size: int) -> dict[str, Any]:
    """The :class:`DraftShape` fields a verifier's HF config (object or dict) gives (unchecked, as a dict).

    Attention shape, MLP width (:func:`mlp_width`), norm eps and RoPE follow the verifier (as vLLM does when it
    loads a speculators checkpoint whose ``transformer_layer_config`` is the verifier's); three aux states,
    embeddings frozen.
    """
    cfg = text_config(verifier_config)  # multimodal wrappers
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    vocab = int(_get(cfg, "vocab_size"))
    if not 0 < draft_vocab_size <= vocab:
        raise UserError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the verifier's vocab size)")
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        target_hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(_get(cfg, "num_key_value_heads") or heads),
        head_dim=int(_get(cfg, "head_dim") or hidden // heads),
        intermediate_size=mlp_width(cfg),
        draft_vocab_size=int(draft_vocab_size),
        num_aux=3,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters_of(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        attention_bias=bool(_get(cfg, "attention_bias", False)),
        train_embeddings=False,
        hidden_act=str(_get(cfg, "hidden_act", "silu")),
    )


def mlp_width(cfg: Any) -> int:
    """The MLP width a draft takes from its verifier's (text) config: the dense ``intermediate_size``, or for a
    mixture-of-experts verifier the width active per token, experts per token x one expert's width plus the shared
    experts' (a draft MLP of one expert's width would be much weaker than what the verifier runs per token).

    Qwen3-30B-A3B: 8 x 768 = 6144; gpt-oss-20b: 4 x 2880 = 11520; DeepSeek-V3 / Kimi-K2: 8 x 2048 + 1 x 2048.
    """
    dense = int(_get(cfg, "intermediate_size"))
    per_token = _get(cfg, "num_experts_per_tok")
    experts = _get(cfg, "num_experts") or _get(cfg, "n_routed_experts") or _get(cfg, "num_local_experts")
    if not per_token or not experts or int(experts) <= 1:
        return dense
    expert = int(_get(cfg, "moe_intermediate_size") or dense)  # Mixtral and gpt-oss: intermediate_size is per expert
    shared = int(_get(cfg, "n_shared_experts") or 0) * expert + int(_get(cfg, "shared_expert_intermediate_size") or 0)
    return int(per_token) * expert + shared


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
