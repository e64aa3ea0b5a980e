"""The vLLM "speculators" format for EAGLE-3 drafts: what ``vllm serve <dir>`` loads as it is.

``config.json`` (``speculators_model_type: "eagle3"``, the draft's decoder layers as a full HF config in
``transformer_layer_config``, the verifier in ``speculators_config.verifier``) + ``model.safetensors``
with the draft's weights under their speculators names, ``d2t`` and ``t2d`` (left out when the draft vocabulary is
the verifier's whole one: vLLM has nothing to load them into then).

``embed_tokens.weight`` is left out unless the draft trained its own embeddings: vLLM then shares
the verifier's embedding matrix with the draft (``llm_base_proposer``: "EAGLE model without its own
embed_tokens"), exactly what a frozen copy would compute, and the file is ``vocab x H`` smaller.

    from tiny_speculators.models.eagle3.speculators import speculators_config
    cfg = speculators_config(draft.kwargs, aux_layer_ids=[2, 15, 27],
                             verifier={"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import DraftFormat, ExportInfo
from tiny_speculators.models.files import cast_state, read_json
from tiny_speculators.models.shape import layer_shape_of
from tiny_speculators.models.speculators_format import (
    CONFIG,
    LAYER_ARCHITECTURES,
    check_proposal,
    config_json,
    layer_config,
    layer_rows,
    normalize_state,
    recorded,
    serve_command,
    speculative_tokens_of,
    transformer_layer_config,
    verifier_of,
    without_identity_maps,
)

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


def speculators_config(
    kwargs: Mapping[str, Any],
    *,
    aux_layer_ids: list[int] | None,
    verifier: Mapping[str, Any],
    speculative_tokens: int = 3,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``config.json`` for a draft built from ``kwargs`` (``Eagle3Draft.kwargs``).

    ``verifier`` needs ``name_or_path`` (what vLLM loads as the target) and may give ``architectures``.
    """
    if kwargs.get("layer_type", "llama") not in LAYER_ARCHITECTURES:
        raise UserError(f"layer_type {kwargs.get('layer_type')!r} has no speculators equivalent")
    check_proposal(speculative_tokens, verifier.get("name_or_path"))
    if aux_layer_ids and len(aux_layer_ids) != int(kwargs.get("num_aux", 3)):
        raise UserError(f"{len(aux_layer_ids)} aux layer ids {list(aux_layer_ids)} for a draft that fuses "
                        f"{kwargs.get('num_aux', 3)} verifier layers")
    own = {
        "norm_before_residual": bool(kwargs.get("norm_before_residual", False)),
        "norm_before_fc": bool(kwargs.get("norm_before_fc", False)),
        "fc_norm": bool(kwargs.get("fc_norm", False)),
        "norm_output": bool(kwargs.get("norm_output", False)),
        "embed_requires_grad": bool(kwargs.get("train_embeddings", False)),
    }
    info = ExportInfo(str(verifier["name_or_path"]), verifier.get("architectures"), speculative_tokens, dtype)
    return config_json("eagle3", "Eagle3Speculator", kwargs, own, layer=transformer_layer_config(kwargs),
                       aux_layer_ids=aux_layer_ids, info=info)


def export_state(state: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors written to ``model.safetensors``: every draft tensor, minus frozen verifier embeddings and
    :func:`without_identity_maps`."""
    out = without_identity_maps(state, kwargs)
    if not kwargs.get("train_embeddings", False):
        out.pop("embed_tokens.weight", None)
    return cast_state(out, dtype)


# ---------------------------------------------------------------- reading


def is_speculators_config(config: Mapping[str, Any]) -> bool:
    """An EAGLE-3 draft in the speculators format (not a parallel-drafting P-EAGLE one)."""
    return config.get("speculators_model_type") == "eagle3" and not config.get("parallel_drafting")


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a speculators-format EAGLE-3 draft, checked for the fields vLLM needs."""
    path = Path(directory) / CONFIG
    cfg = read_json(path)
    where = f"{path} (speculators format)"
    if cfg.get("speculators_model_type") != "eagle3":
        raise UserError(f"{path} has speculators_model_type {cfg.get('speculators_model_type')!r}; "
                        "only 'eagle3' drafts can be imported")
    layer = layer_config(cfg, ["draft_vocab_size", "transformer_layer_config", "speculators_config"], where)
    spec = cfg["speculators_config"]
    methods = spec.get("proposal_methods") if isinstance(spec, Mapping) else None
    if not methods or not isinstance(methods, list) or "speculative_tokens" not in methods[0]:
        raise UserError(f"{where} is missing speculators_config.proposal_methods[0].speculative_tokens")
    if not isinstance(spec.get("verifier"), Mapping) or "name_or_path" not in spec["verifier"]:
        raise UserError(f"{where} is missing speculators_config.verifier.name_or_path")
    layers = layer.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or layers < 1:
        raise UserError(f"{where}: transformer_layer_config.num_hidden_layers must be a positive integer, got "
                        f"{layer['num_hidden_layers']!r}")
    if layer.get("model_type", "llama") not in LAYER_ARCHITECTURES:
        raise UserError(f"{where}: transformer_layer_config.model_type {layer.get('model_type')!r} is not "
                        f"supported (use one of {sorted(LAYER_ARCHITECTURES)})")
    return cfg


def draft_kwargs(cfg: Mapping[str, Any], fc_in_features: int | None = None) -> dict[str, Any]:
    """``Eagle3Draft`` keyword arguments from a checked speculators config."""
    layer = cfg["transformer_layer_config"]
    target_hidden = int(cfg.get("target_hidden_size") or layer["hidden_size"])
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    num_aux = int(layer.get("num_aux_hidden_states") or (len(aux) if aux else 3))
    if fc_in_features is not None and fc_in_features != num_aux * target_hidden:
        if fc_in_features % target_hidden:
            raise UserError(f"fc.weight takes {fc_in_features} inputs, not a multiple of the verifier hidden "
                            f"size {target_hidden}")
        num_aux = fc_in_features // target_hidden
    layers = int(layer.get("num_hidden_layers", 1))
    kinds = set(layer.get("layer_types") or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"} or len(kinds) > 1:
        raise UserError(f"transformer_layer_config.layer_types {layer.get('layer_types')} is not supported: a draft's "
                        "layers are all full_attention or all sliding_attention")
    window = {"sliding_window": int(layer["sliding_window"])} if kinds == {"sliding_attention"} else {}
    return dict(
        **layer_shape_of(layer),
        **({"num_layers": layers} if layers != 1 else {}),  # one-layer drafts keep the kwargs they always had
        **window,
        draft_vocab_size=int(cfg["draft_vocab_size"]),
        target_hidden_size=target_hidden,
        num_aux=num_aux,
        layer_type=layer.get("model_type", "llama"),
        # vLLM's default when the field is absent (speculators' own default is False).
        norm_before_residual=bool(cfg.get("norm_before_residual", True)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        train_embeddings=bool(cfg.get("embed_requires_grad", False)),
    )


# ---------------------------------------------------------------- the format, for the family table


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    kwargs = draft.kwargs
    cfg = speculators_config(kwargs, aux_layer_ids=kwargs.get("aux_layer_ids"),
                             verifier={"name_or_path": info.verifier_name,
                                       "architectures": info.verifier_architectures},
                             speculative_tokens=info.speculative_tokens, dtype=info.dtype)
    return cfg, export_state(draft.state_dict(), kwargs, info.dtype)


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    cfg = read_config(directory)
    state = normalize_state(tensors)
    fc = state.get("fc.weight")
    kwargs = draft_kwargs(cfg, fc.shape[1] if fc is not None else None)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    kwargs["aux_layer_ids"] = [int(i) for i in aux] if aux else None
    return kwargs, state, {"verifier": verifier_of(cfg), "speculative_tokens": speculative_tokens_of(cfg)}


def vllm_speculative_config(folder: str, k: int) -> dict[str, Any]:
    return {"model": folder, "num_speculative_tokens": int(k), "method": "eagle3"}


def serve(verifier_name: str, folder: str, k: int) -> str:
    return serve_command(verifier_name, folder, vllm_speculative_config(folder, k))


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"title": "EAGLE-3 draft", "library": "vllm", "tags": ["eagle3", "speculators"],
            "about": f"A {kwargs.get('num_layers', 1)}-layer EAGLE-3 draft model", "rows": layer_rows(kwargs)}


FORMAT = DraftFormat(name="speculators", write=write, detect=is_speculators_config, read=read, serve=serve,
                     card=card, vllm_speculative_config=vllm_speculative_config, recorded=recorded)
