"""Capture a verifier's hidden states for draft training with forward hooks on just the layers that are needed.

``aux`` holds the INPUTS of the aux layers (``hidden_states[i]`` in Hugging Face's
``output_hidden_states`` convention, and what vLLM's aux layer ids in a draft's config mean),
concatenated in the order given; ``last`` is the final decoder layer's output before the final norm,
so ``lm_head(norm(last))`` equals the verifier's logits. Only the decoder runs (no lm_head, no KV cache),
and only the requested layers' states are kept.

    import torch
    from tiny_speculators.verifier.load import load_verifier
    from tiny_speculators.verifier.capture import capture_hidden_states, default_aux_layer_ids
    model, _ = load_verifier("smollm2-135m", with_tokenizer=False)
    ids = torch.tensor([[1, 2, 3]])
    aux, last = capture_hidden_states(model, ids, torch.ones_like(ids), default_aux_layer_ids(30))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.modules import VerifierParts, find_parts

__all__ = ["capture_hidden_states", "check_layer_ids", "default_aux_layer_ids", "first_aux_layer", "past_deepstack"]


def default_aux_layer_ids(num_layers: int, first: int = 2) -> list[int]:
    """The default spread of aux layers (what extract stores unless told): the inputs of layers 2, N//2 and N-3.
    ``first`` moves the lowest one up (:func:`first_aux_layer`: past a Qwen3-VL verifier's DeepStack layers)."""
    if num_layers < 4 or not first < num_layers // 2:
        raise UserError(f"a verifier with {num_layers} layers is too shallow for the default aux layers "
                        f"[{first}, N//2, N-3]; give the layer ids explicitly")
    return [first, num_layers // 2, num_layers - 3]


def first_aux_layer(config: Any) -> int:
    """The lowest default aux layer for a verifier of ``config`` (a transformers config or its dict): 2, or for a
    Qwen3-VL-style verifier whose vision tower adds DeepStack features to the outputs of its first n decoder layers,
    n (3 for Qwen3-VL): the input of layer n is the first that holds all of them, in HF and in vLLM alike (both add
    them after the layer, before the next layer's input is taken), as SpecForge's Qwen3-VL recipe starts at 3."""
    vision = config.get("vision_config") if isinstance(config, dict) else getattr(config, "vision_config", None)
    indexes = (vision.get("deepstack_visual_indexes") if isinstance(vision, dict)
               else getattr(vision, "deepstack_visual_indexes", None)) if vision is not None else None
    return max(2, len(indexes)) if indexes else 2


def past_deepstack(layer_ids: Sequence[int], first: int) -> list[int]:
    """A family's default ``layer_ids`` for a verifier whose lowest default aux layer is ``first``
    (:func:`first_aux_layer`): the lowest id, if below ``first``, becomes ``first`` (unless it is taken)."""
    ids = [int(i) for i in layer_ids]
    low = min(ids)
    if low < first and first not in ids:
        ids[ids.index(low)] = first
    return ids


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, allow_last: bool = False) -> list[int]:
    """Validate aux layer ids (each the index of a layer whose INPUT is captured: 0 .. N-1; with ``allow_last``
    also N: the last layer's output before the final norm, what a draft layer stacked on the verifier reads)."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise UserError("at least one aux layer id is needed")
    bad = [i for i in ids if not 0 <= i < num_layers + int(allow_last)]
    if bad and allow_last:
        raise UserError(f"aux layer id(s) {bad} out of range: the verifier has {num_layers} layers, so ids must be "
                        f"in 0..{num_layers} (id i = the input of layer i, id {num_layers} = the last layer's output)")
    if bad:
        raise UserError(f"aux layer id(s) {bad} out of range: the verifier has {num_layers} layers, so ids must be "
                        f"in 0..{num_layers - 1} (id i = the input of layer i)")
    if len(set(ids)) != len(ids):
        raise UserError(f"aux layer ids {ids} contain duplicates")
    return ids


@torch.inference_mode()
def capture_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: Sequence[int],
    parts: VerifierParts | None = None,
    images: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the verifier's decoder once and return ``(aux (B, T, n_aux*H), last (B, T, H))``.

    Args:
        model: the verifier (a causal LM, possibly wrapped); ignored when ``parts`` is given.
        input_ids: (B, T) token ids, right-padded.
        attention_mask: (B, T) 1 for real tokens, 0 for padding (or None: no padding).
        aux_layer_ids: layers whose INPUT to capture, in output order (N: the last layer's output).
        parts: ``find_parts(model)``, to skip the module search on every call.
        images: a vision-language verifier's image inputs for the batch (``pixel_values``, ``image_grid_thw``,
            ``mm_token_type_ids``: :meth:`~tiny_speculators.verifier.vision.Vision.inputs`): the vision tower and
            the model's own M-RoPE positions run too.
    """
    parts = parts or find_parts(model)
    ids = check_layer_ids(aux_layer_ids, parts.num_hidden_layers, allow_last=True)
    captured: dict[int | str, torch.Tensor] = {}

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            captured[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return hook

    def last_hook(module, args, output):
        captured["last"] = output[0] if isinstance(output, (tuple, list)) else output

    handles = [parts.layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
               for i in ids if i < parts.num_hidden_layers]
    handles.append(parts.layers[-1].register_forward_hook(last_hook))
    try:
        if images:
            if parts.multimodal is None:
                raise UserError(f"{type(model).__name__} has no vision tower to read images with")
            parts.multimodal(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images)
        else:
            parts.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in [*ids, "last"] if i not in captured and i != parts.num_hidden_layers]
    if missing:
        raise RuntimeError(f"the decoder {parts.decoder_name or type(parts.decoder).__name__} did not run "
                           f"layer(s) {missing}")
    last = parts.num_hidden_layers  # id N: the last layer's output (before the final norm)
    aux = torch.cat([captured["last" if i == last else i] for i in ids], dim=-1)  # (B, T, n_aux*H)
    return aux, captured["last"]  # (B, T, H)
