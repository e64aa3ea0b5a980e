"""EAGLE-3 as a draft family: its training options, how a fresh draft is built, and its table entry.

    train: {algorithm: eagle3, eagle3: {ttt_steps: 3, decay: 0.8}}       # YAML
    tiny-speculators train ... --eagle3-ttt-steps 3 --eagle3-layer-type qwen3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3 import sglang, speculators
from tiny_speculators.models.eagle3.builder import build_draft, draft_kwargs_from_verifier
from tiny_speculators.models.eagle3.model import Eagle3Draft
from tiny_speculators.models.eagle3.objective import TTTModule
from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.models.eagle3.verifier_init import init_from_verifier_layer
from tiny_speculators.models.family import BuildInputs, DraftFamily
from tiny_speculators.models.losses import LossSpec


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
            ``init_layer + 1``, ... (an early exit of the verifier; ``verifier_init.py``), read from its safetensors.
        init_layer: the first verifier layer ``init: verifier`` copies (default: the last aux layer).
    """

    ttt_steps: int = 3
    decay: float = 0.8
    layer_type: Literal["auto", "llama", "qwen3"] = "auto"
    fc_norm: bool = False
    norm_before_residual: bool = False
    num_layers: int = 1
    init: Literal["random", "verifier"] = "random"
    init_layer: int | None = None

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be at least 1, got {self.ttt_steps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {self.num_layers}")


def resolve_layer_type(layer_type: str, verifier_config) -> str:
    if layer_type != "auto":
        return layer_type
    return "qwen3" if str(getattr(verifier_config, "model_type", "")).startswith("qwen3") else "llama"


def build(inputs: BuildInputs, options: Eagle3Options) -> Eagle3Draft:
    kwargs = draft_kwargs_from_verifier(
        inputs.verifier_config, int(inputs.d2t.shape[0]), num_aux=len(inputs.aux_layer_ids),
        aux_layer_ids=list(inputs.aux_layer_ids), layer_type=resolve_layer_type(options.layer_type,
                                                                                inputs.verifier_config),
        fc_norm=options.fc_norm, norm_before_residual=options.norm_before_residual, num_layers=options.num_layers)
    draft = build_draft(kwargs, inputs.d2t, inputs.t2d, embed_weight=inputs.embed_weight,
                        lm_head_weight=inputs.lm_head_weight)
    if options.init == "verifier":
        from tiny_speculators.verifier.load import resolve_verifier

        if inputs.verifier_path is None:
            raise UserError("eagle3 init 'verifier' reads a verifier layer, but no verifier folder was given")
        layer = inputs.aux_layer_ids[-1] if options.init_layer is None else options.init_layer
        n_layers = int(getattr(inputs.verifier_config, "num_hidden_layers", 0))
        if not 0 <= layer <= n_layers - options.num_layers:
            which = f"eagle3 init_layer {layer}" + (" (the last aux layer)" if options.init_layer is None else "")
            if options.num_layers == 1:
                raise UserError(f"{which} is not a decoder layer of the verifier (0..{n_layers - 1})")
            raise UserError(f"{which} with num_layers {options.num_layers} copies verifier layers "
                            f"{layer}..{layer + options.num_layers - 1}, but its decoder layers are 0..{n_layers - 1}")
        init_from_verifier_layer(draft, resolve_verifier(inputs.verifier_path), layer)
    return draft


def default_aux_layer_ids(num_layers: int) -> list[int]:
    from tiny_speculators.verifier.capture import default_aux_layer_ids as eagle3_default

    return eagle3_default(num_layers)


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
