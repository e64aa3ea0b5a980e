"""The speculators format of P-EAGLE drafts, as vLLM 0.32 loads it (``speculators_model_type: "peagle"``, which
vLLM runs as ``eagle3`` with ``parallel_drafting``):

* ``config.json``: the EAGLE-3 fields, ``transformer_layer_config`` with ``num_hidden_layers`` = the draft's
  layers, and at top level ``mask_token_id`` (required by vLLM), ``norm_before_residual`` / ``norm_before_fc``
  (vLLM's P-EAGLE reader takes them only there; ``fc_norm`` is not read for P-EAGLE, so it is not offered),
  ``num_depths`` (the depths it was trained for).
* ``model.safetensors``: ``layers.{i}.*`` (layer 0 the EAGLE-3 layer with 2H-wide q/k/v and ``hidden_norm``,
  the rest plain layers), ``fc``, ``norm``, ``lm_head``, ``d2t``/``t2d`` (not for a whole-vocabulary draft),
  ``mask_hidden`` [1, 1, n_aux*Ht], and
  ``embed_tokens.weight`` only when the draft trained its own (else vLLM shares the verifier's).

vLLM's draft loader does not report missing tensors (they stay uninitialized), so :func:`write` checks that
every tensor of the model is written.
"""

from __future__ import annotations

import json
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
    check_proposal,
    config_json,
    layer_config,
    layer_rows,
    normalize_state,
    recorded,
    speculative_tokens_of,
    transformer_layer_config,
    verifier_of,
    without_identity_maps,
)


def config(kwargs: Mapping[str, Any], info: ExportInfo) -> dict[str, Any]:
    layer = transformer_layer_config({**kwargs, "num_aux": kwargs.get("num_aux", 3)})
    layer["num_hidden_layers"] = int(kwargs["num_layers"])
    own = {
        "norm_before_residual": bool(kwargs.get("norm_before_residual", False)),
        "norm_before_fc": bool(kwargs.get("norm_before_fc", False)),
        "norm_output": False,
        "mask_token_id": int(kwargs["mask_token_id"]),
        "num_depths": int(kwargs["num_depths"]),
        "embed_requires_grad": bool(kwargs.get("train_embeddings", False)),
    }
    return config_json("peagle", "PEagleSpeculator", kwargs, own, layer=layer,
                       aux_layer_ids=kwargs.get("aux_layer_ids"), info=info)


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    check_proposal(info.speculative_tokens, info.verifier_name)
    full = draft.state_dict()
    state = without_identity_maps(full, draft.kwargs)
    if not draft.kwargs.get("train_embeddings", False):
        state.pop("embed_tokens.weight")
    expected = set(full) - ({"embed_tokens.weight", "d2t", "t2d"} - set(state))
    if set(state) != expected:
        raise UserError(f"P-EAGLE export is missing tensors {sorted(expected - set(state))}")
    return config(draft.kwargs, info), cast_state(state, info.dtype)


def detect(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("speculators_model_type") == "peagle" or (
        cfg.get("speculators_model_type") == "eagle3" and bool(cfg.get("parallel_drafting")))


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    path = Path(directory) / CONFIG
    cfg = read_json(path)
    where = f"{path} (speculators P-EAGLE format)"
    layer = layer_config(cfg, ["draft_vocab_size", "transformer_layer_config", "speculators_config"], where)
    mask = cfg.get("mask_token_id", layer.get("mask_token_id", cfg.get("ptd_token_id", cfg.get("pard_token"))))
    if mask is None:
        raise UserError(f"{where} has no mask_token_id (vLLM needs it for parallel drafting)")
    if layer.get("model_type", "llama") not in ("llama", "qwen3"):
        raise UserError(f"{where}: transformer_layer_config.model_type {layer.get('model_type')!r} is not supported")
    state = normalize_state(tensors)
    if "mask_hidden" not in state:
        raise UserError(f"{directory} has no mask_hidden tensor: not a P-EAGLE draft vLLM could run")
    target_hidden = int(cfg.get("target_hidden_size") or layer["hidden_size"])
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    num_aux = len(aux) if aux else state["fc.weight"].shape[1] // target_hidden
    state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    kwargs = dict(
        **layer_shape_of(layer),
        draft_vocab_size=int(cfg["draft_vocab_size"]), num_layers=int(layer.get("num_hidden_layers", 1)),
        mask_token_id=int(mask), num_depths=int(cfg.get("num_depths") or cfg.get("para_depths") or 4),
        target_hidden_size=target_hidden, num_aux=num_aux, layer_type=layer.get("model_type", "llama"),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),  # vLLM's P-EAGLE default
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        train_embeddings=bool(cfg.get("embed_requires_grad", False)) and "embed_tokens.weight" in tensors,
        aux_layer_ids=[int(i) for i in aux] if aux else None,
    )
    return kwargs, state, {"verifier": verifier_of(cfg), "speculative_tokens": speculative_tokens_of(cfg)}


def vllm_speculative_config(folder: str, k: int) -> dict[str, Any]:
    return {"model": folder, "num_speculative_tokens": int(k), "method": "eagle3", "parallel_drafting": True}


def serve(verifier_name: str, folder: str, k: int) -> str:
    return (f"vllm serve {folder}\n# or, explicitly:\nvllm serve {verifier_name} --speculative-config "
            f"'{json.dumps(vllm_speculative_config(folder, k))}'")


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    rows = [r for r in layer_rows({**kwargs, "fc_norm": False}) if not r[0].startswith("norm_before_residual")]
    rows[0] = ("decoder layers", f"{kwargs['layer_type']} x {kwargs['num_layers']}")
    rows += [("norm_before_residual / norm_before_fc",
              f"{kwargs['norm_before_residual']} / {kwargs['norm_before_fc']}"),
             ("mask token id / trained depths", f"{kwargs['mask_token_id']} / {kwargs['num_depths']}")]
    return {"title": "P-EAGLE draft", "library": "vllm", "tags": ["peagle", "parallel-drafting", "speculators"],
            "about": f"A {kwargs['num_layers']}-layer P-EAGLE (parallel drafting) draft model, proposing all draft "
                     "tokens of a step in one forward,", "rows": rows}


FORMAT = DraftFormat(name="speculators", write=write, detect=detect, read=read, serve=serve, card=card,
                     vllm_speculative_config=vllm_speculative_config, recorded=recorded)
