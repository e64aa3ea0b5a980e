"""EAGLE-3 as a draft family: its training options, how a fresh draft is built, and its table entry.

    train: {algorithm: eagle3, eagle3: {ttt_steps: 3, decay: 0.8}}       # YAML
    tiny-speculators train ... --eagle3-ttt-steps 3 --eagle3-layer-type qwen3

    kwargs = draft_kwargs_from_verifier(AutoConfig.from_pretrained(path), draft_vocab_size=len(d2t))
    draft = build_draft(kwargs, d2t, t2d, embed_weight=verifier.get_input_embeddings().weight)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.compat import copy_verifier_weights
from tiny_speculators.models.eagle3 import sglang, speculators
from tiny_speculators.models.eagle3.model import Eagle3Draft
from tiny_speculators.models.eagle3.objective import TTTModule
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.models.family import BuildInputs, DraftFamily, resolve_layer_type
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.shape import verifier_shape
from tiny_speculators.models.verifier_init import start_from_verifier
from tiny_speculators.options import AT_LEAST_1, FRACTION, check_ranges
from tiny_speculators.verifier.capture import default_aux_layer_ids

log = logging.getLogger(__name__)

_OVERRIDABLE = {
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_aux", "rms_norm_eps",
    "rope_parameters", "max_position_embeddings", "attention_bias", "layer_type", "norm_before_residual",
    "norm_before_fc", "fc_norm", "train_embeddings", "hidden_act", "aux_layer_ids", "num_layers", "sliding_window",
}


@dataclass(frozen=True)
class Eagle3Options:
    """EAGLE-3's own training options.

    Args:
        ttt_steps: TTT rollout length K (draft steps trained per position); also the default number of
            speculative tokens the export writes.
        decay: weight of TTT step k's loss is decay**k.
        layer_type: draft decoder layer: auto (qwen3 for Qwen3 verifiers, else llama), llama, or qwen3.
        fc_norm: RMSNorm each aux chunk before fc (EAGLE 3.1).
        norm_before_residual: use hidden_norm(h) as the residual (vLLM's flag).
        num_layers: decoder layers of the draft (layer 0 the EAGLE-3 layer, the rest plain layers; vLLM serves any
            number, SGLang's export only one).
        init: random, or verifier: the decoder layers start as the verifier's layers ``init_layer``,
            ``init_layer + 1``, ... (an early exit of the verifier; ``models/verifier_init.py``), read from its
            safetensors.
        init_layer: the first verifier layer ``init: verifier`` copies (default: the last aux layer).
        intermediate_size: MLP width of the draft's layers; default: the verifier's, for a mixture-of-experts
            verifier the width it runs per token (experts per token x expert width + shared experts).
        sliding_window: the draft's layers attend only to this many latest positions, as vLLM 0.32 runs a draft
            whose config says ``sliding_attention`` (e.g. the window of a sliding-window verifier's layers); default
            the whole context. Chain drafting only (no EAGLE-2 trees); exported to the speculators format.
    """

    ttt_steps: int = 3
    decay: float = 0.8
    layer_type: Literal["auto", "llama", "qwen3"] = "auto"
    fc_norm: bool = False
    norm_before_residual: bool = False
    num_layers: int = 1
    init: Literal["random", "verifier"] = "random"
    init_layer: int | None = None
    intermediate_size: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        check_ranges(("ttt_steps", self.ttt_steps, AT_LEAST_1), ("decay", self.decay, FRACTION),
                     ("num_layers", self.num_layers, AT_LEAST_1))
        for name in ("intermediate_size", "sliding_window"):
            if getattr(self, name) is not None:
                check_ranges((name, getattr(self, name), AT_LEAST_1))


def draft_kwargs_from_verifier(verifier_config: Any, draft_vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for :class:`Eagle3Draft` from a verifier's HF config (object or dict): its
    :func:`~tiny_speculators.models.shape.verifier_shape` and EAGLE-3's defaults. ``overrides`` may change any of:
    ``intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_aux, rms_norm_eps, rope_parameters,
    max_position_embeddings, attention_bias, layer_type, norm_before_residual, norm_before_fc, fc_norm,
    train_embeddings, hidden_act, aux_layer_ids, num_layers, sliding_window``.
    """
    unknown = set(overrides) - _OVERRIDABLE
    if unknown:
        raise UserError(f"unknown draft setting(s) {sorted(unknown)}; allowed: {sorted(_OVERRIDABLE)}")
    kwargs = verifier_shape(verifier_config, draft_vocab_size)
    kwargs.update(layer_type="llama", norm_before_residual=False, norm_before_fc=False, fc_norm=False)
    kwargs.update(overrides)
    return kwargs


def build_draft(kwargs: Mapping[str, Any], d2t: torch.Tensor, t2d: torch.Tensor,
                embed_weight: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None) -> Eagle3Draft:
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


def build(inputs: BuildInputs, options: Eagle3Options) -> Eagle3Draft:
    kwargs = draft_kwargs_from_verifier(
        inputs.verifier_config, int(inputs.d2t.shape[0]), num_aux=len(inputs.aux_layer_ids),
        aux_layer_ids=list(inputs.aux_layer_ids), layer_type=resolve_layer_type(options.layer_type,
                                                                                inputs.verifier_config),
        fc_norm=options.fc_norm, norm_before_residual=options.norm_before_residual, num_layers=options.num_layers,
        **({} if options.intermediate_size is None else {"intermediate_size": options.intermediate_size}),
        **({} if options.sliding_window is None else {"sliding_window": options.sliding_window}))
    draft = build_draft(kwargs, inputs.d2t, inputs.t2d, embed_weight=inputs.embed_weight,
                        lm_head_weight=inputs.lm_head_weight)
    if options.init == "verifier":
        start_from_verifier(draft, inputs, "eagle3", options.init_layer)
    return draft


def objective(draft: nn.Module, target_head: nn.Module, options: Eagle3Options, attention: str,
              loss: LossSpec | None = None) -> TTTModule:
    return TTTModule(draft, target_head, options.ttt_steps, options.decay, attention, loss=loss)


FAMILY = DraftFamily(
    name="eagle3",
    summary="EAGLE-3: a decoder layer (or a few) over fused verifier states, trained with training-time test (TTT)",
    model=Eagle3Draft,
    options=Eagle3Options,
    build=build,
    default_aux_layer_ids=default_aux_layer_ids,
    objective=objective,
    proposer=Eagle3Proposer,
    formats=(speculators.FORMAT, sglang.FORMAT),
    speculative_tokens=lambda options: options.ttt_steps,
    shape_options=("num_layers", "fc_norm", "norm_before_residual"),
    fresh_options=("init", "init_layer"),
)
