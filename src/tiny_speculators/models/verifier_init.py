"""Start a fused-input draft's decoder layers from the verifier's own decoder layers (``init: verifier``).

For the families whose draft reads the fusion of verifier states (``layers.FusedInputDraft``): ``init: verifier``
in the family's options.
The fresh draft then computes, at its first step, those verifier layers on the verifier's state that enters the
first of them, followed by the verifier's final norm and lm_head: an early exit of the verifier itself, instead of
a random guess. With verifier layer ``j`` (default: the last aux layer, whose input is aux state ``j``):

    fc                        picks aux state j (identity block; zeros for the other aux states)
    hidden_norm               <- layer j's input_layernorm      (the draft's norm of the fed-back state)
    q/k/v_proj[:, H:]         <- layer j's q/k/v_proj           (the state half; the embedding half starts at 0)
    o_proj, post_attention_layernorm, mlp, q_norm/k_norm, biases  <- layer j's
    layers.i (i >= 1)         <- layer j + i, all of it          (plain layers, as in the verifier)
    norm                      <- the verifier's final norm       (lm_head rows are copied as always)

Without ``fc_norm``/``norm_before_fc``/``norm_before_residual`` that is exact: the fresh draft's step-0 logits (at
P-EAGLE's depth-0 slots) are the verifier's logits after layers j..j+L-1 (tests/models/test_verifier_init.py);
with them it is the same computation on normalized states, which training adapts. P-EAGLE's mask hidden state
starts as always (it goes through the same fc).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import BuildInputs
from tiny_speculators.models.layers import FusedInputDraft
from tiny_speculators.verifier.describe import read_tensors, safetensor_index
from tiny_speculators.verifier.load import resolve_verifier

__all__ = ["init_from_verifier_layer", "start_from_verifier"]

NORM_KEYS = ("model.norm.weight", "norm.weight", "model.language_model.norm.weight")


def start_from_verifier(draft: FusedInputDraft, inputs: BuildInputs, family: str, init_layer: int | None) -> None:
    """``init: verifier`` of ``family``'s options: check the layers against the verifier, then copy them."""
    if inputs.verifier_path is None:
        raise UserError(f"{family} init 'verifier' reads a verifier layer, but no verifier folder was given")
    layer = inputs.aux_layer_ids[-1] if init_layer is None else init_layer
    n_layers, num_layers = int(getattr(inputs.verifier_config, "num_hidden_layers", 0)), len(draft.layers)
    if not 0 <= layer <= n_layers - num_layers:
        which = f"{family} init_layer {layer}" + (" (the last aux layer)" if init_layer is None else "")
        if num_layers == 1:
            raise UserError(f"{which} is not a decoder layer of the verifier (0..{n_layers - 1})")
        raise UserError(f"{which} with num_layers {num_layers} copies verifier layers "
                        f"{layer}..{layer + num_layers - 1}, but its decoder layers are 0..{n_layers - 1}")
    init_from_verifier_layer(draft, resolve_verifier(inputs.verifier_path), layer, family)


def _tensors(folder: str, first: int, count: int, family: str) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Verifier layers ``first .. first + count - 1`` (names relative to the layer) and its final norm, one read."""
    index = safetensor_index(Path(folder))
    if not index:
        raise UserError(f"{family} init 'verifier' reads the verifier's decoder layer from its safetensors, and "
                        f"{folder} has none: pass a local verifier folder, or init 'random'")
    prefixes = []
    for layer in range(first, first + count):
        prefix = next((p for p in (f"model.layers.{layer}.", f"model.language_model.layers.{layer}.")
                       if any(k.startswith(p) for k in index)), None)
        if prefix is None:
            raise UserError(f"verifier {folder} has no decoder layer {layer} in its safetensors ({family} init_layer)")
        prefixes.append(prefix)
    norm = next((k for k in NORM_KEYS if k in index), None)
    if norm is None:
        raise UserError(f"verifier {folder} has no final norm in its safetensors (looked for {', '.join(NORM_KEYS)})")
    state = read_tensors(index, [k for k in index if k.startswith(tuple(prefixes))] + [norm])
    layers = [{k.removeprefix(p): v for k, v in state.items() if k.startswith(p)} for p in prefixes]
    return layers, state[norm]


@torch.no_grad()
def init_from_verifier_layer(draft: FusedInputDraft, folder: str, layer: int, family: str) -> None:
    """Copy verifier decoder layers ``layer``, ``layer + 1``, ... (one per draft layer) and the verifier's final norm
    into ``draft`` as laid out above."""
    aux_ids = draft.kwargs.get("aux_layer_ids") or []
    h = draft.hidden_size  # the copies below fail with a one-line error unless it is the verifier's
    all_tensors, final_norm = _tensors(folder, layer, len(draft.layers), family)
    for i, (ours, tensors) in enumerate(zip(draft.layers, all_tensors, strict=True)):
        plain = {f"self_attn.{n}_proj.weight": getattr(ours.self_attn, f"{n}_proj").weight
                 for n in ("q", "k", "v", "o") if i > 0 or n == "o"}
        plain |= {"post_attention_layernorm.weight": ours.post_attention_layernorm.weight,
                  "input_layernorm.weight": ours.hidden_norm.weight if i == 0 else ours.input_layernorm.weight,
                  **{f"mlp.{n}_proj.weight": getattr(ours.mlp, f"{n}_proj").weight for n in ("gate", "up", "down")}}
        for name in ("q_norm", "k_norm"):
            if getattr(ours.self_attn, name) is not None:
                plain[f"self_attn.{name}.weight"] = getattr(ours.self_attn, name).weight
        for name in ("q", "k", "v", "o"):
            bias = getattr(ours.self_attn, f"{name}_proj").bias
            if bias is not None:
                plain[f"self_attn.{name}_proj.bias"] = bias
        halves = ({f"self_attn.{n}_proj.weight": getattr(ours.self_attn, f"{n}_proj").weight for n in ("q", "k", "v")}
                  if i == 0 else {})
        missing = sorted((set(plain) | set(halves)) - set(tensors))
        if missing:
            raise UserError(f"verifier {folder} layer {layer + i} lacks {', '.join(missing)}: its decoder layer is "
                            "not the draft's (a llama/qwen3-style layer); use {family} init 'random'")
        for name, param in plain.items():
            _copy(param, tensors[name], f"layer {layer + i} {name}")
        for name, param in halves.items():
            _copy(param[:, h:], tensors[name], f"layer {layer + i} {name}")
            param[:, :h].zero_()
    _copy(draft.norm.weight, final_norm, "final norm")
    block = aux_ids.index(layer) if layer in aux_ids else draft.num_aux - 1  # fc picks that aux state (or the last)
    draft.fc.weight.zero_()
    draft.fc.weight[:, block * h:(block + 1) * h] = torch.eye(h)


def _copy(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise UserError(f"verifier {what} has shape {tuple(value.shape)}, the draft needs {tuple(param.shape)}")
    param.copy_(value.to(param.dtype))
