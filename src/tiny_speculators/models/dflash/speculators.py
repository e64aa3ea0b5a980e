"""The speculators format of DFlash drafts, as vLLM 0.32 loads it (``speculators_model_type: "dflash"``, served as
``method: dflash`` by ``DFlashQwen3ForCausalLM``):

* ``config.json``: ``transformer_layer_config`` (a Qwen3 decoder config with the verifier's shapes and
  ``num_hidden_layers`` = the draft's layers), and at top level ``draft_vocab_size``, ``block_size``,
  ``mask_token_id`` and ``aux_hidden_state_layer_ids`` (both required by vLLM's ``update_dflash``; the ids are
  ours = vLLM's EAGLE-3 ids, it derives ``target_layer_ids = id - 1`` itself), ``sliding_window_non_causal``
  (vLLM 0.32 reads ``causal = not sliding_window_non_causal``, default non-causal), ``target_hidden_size`` when
  it differs; ``speculators_config`` with ``speculative_tokens`` = ``block_size - 1``.
* ``model.safetensors``: ``fc``, ``hidden_norm``, ``layers.{i}.*`` (q/k/v/o, q_norm/k_norm, norms, MLP),
  ``norm``; ``lm_head`` + ``d2t``/``t2d`` only with a draft vocabulary or a trained head (else vLLM shares the
  verifier's lm_head, as speculators writes it); ``embed_tokens`` only when trained.

Not supported (a UserError names the field): sliding-window layers, ``sample_from_anchor``, a separate
``mask_embedding.pt``, the Domino projector.

    tiny-speculators export runs/dflash/best --out runs/dflash-export && vllm serve runs/dflash-export
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
from tiny_speculators.models.shape import decoder_fields, layer_shape_of
from tiny_speculators.models.speculators_format import (
    CONFIG,
    check_proposal,
    config_json,
    layer_config,
    normalize_state,
    recorded,
    speculative_tokens_of,
    verifier_of,
)


def config(kwargs: Mapping[str, Any], info: ExportInfo) -> dict[str, Any]:
    if not kwargs.get("aux_layer_ids"):
        raise UserError("the DFlash draft records no aux_layer_ids: vLLM needs aux_hidden_state_layer_ids")
    layer = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **decoder_fields(kwargs),
             "num_hidden_layers": int(kwargs["num_layers"]), "mlp_bias": False,
             "rope_parameters": dict(kwargs["rope_parameters"]), "use_sliding_window": False}
    own = {
        "block_size": int(kwargs["block_size"]),
        "mask_token_id": int(kwargs["mask_token_id"]),
        "aux_hidden_state_layer_ids": [int(i) for i in kwargs["aux_layer_ids"]],
        "sliding_window_non_causal": not bool(kwargs.get("causal", False)),
        "sample_from_anchor": False,
        "projector_type": "dflash",
    }
    return config_json("dflash", "DFlashSpeculator", kwargs, own, layer=layer, aux_layer_ids=None, info=info)


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    check_proposal(info.speculative_tokens, info.verifier_name)
    kw = draft.kwargs
    state = dict(draft.state_dict())
    if not kw.get("train_embeddings", False):
        state.pop("embed_tokens.weight")
    if kw["draft_vocab_size"] == kw["vocab_size"] and not kw.get("train_lm_head", False):
        for key in ("lm_head.weight", "d2t", "t2d"):  # the verifier's own head: vLLM shares it
            state.pop(key)
    return config(kw, info), cast_state(state, info.dtype)


def detect(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("speculators_model_type") == "dflash"


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    path = Path(directory) / CONFIG
    cfg = read_json(path)
    where = f"{path} (speculators DFlash format)"
    if cfg.get("sample_from_anchor"):
        raise UserError(f"{where}: sample_from_anchor true is not supported "
                        "(vLLM's DFlash proposes from the mask slots)")
    return read_backbone(directory, cfg, tensors, where)


def read_backbone(directory: Path, cfg: Mapping[str, Any], tensors: dict[str, torch.Tensor], where: str):
    """The DFlash part of a speculators config (also DSpark's): ``(kwargs, state, record)``."""
    layer = layer_config(cfg, ["transformer_layer_config", "speculators_config", "mask_token_id",
                               "aux_hidden_state_layer_ids"], where)
    if any(t == "sliding_attention" for t in layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise UserError(f"{where}: sliding-window draft layers (transformer_layer_config.layer_types) "
                        "are not supported")
    if cfg.get("projector_type", "dflash") != "dflash":
        raise UserError(f"{where}: projector_type {cfg['projector_type']!r} is not supported (only 'dflash')")
    if (Path(directory) / "mask_embedding.pt").exists():
        raise UserError(f"{directory}/mask_embedding.pt (a separate mask embedding) is not supported")
    state = normalize_state(tensors)
    target_hidden = int(cfg.get("target_hidden_size") or layer["hidden_size"])
    aux = [int(i) for i in cfg["aux_hidden_state_layer_ids"]]
    vocab = int(layer["vocab_size"])
    block = int(cfg.get("block_size") or 8)
    kwargs = dict(
        **layer_shape_of(layer),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab), num_layers=int(layer.get("num_hidden_layers", 1)),
        block_size=block, mask_token_id=int(cfg["mask_token_id"]), target_hidden_size=target_hidden,
        num_aux=len(aux),
        causal=not bool(cfg.get("sliding_window_non_causal", True)),  # vLLM 0.32's reading (update_dflash)
        train_embeddings="embed_tokens.weight" in state,
        train_lm_head="lm_head.weight" in state and int(cfg.get("draft_vocab_size") or vocab) == vocab,
        aux_layer_ids=aux,
    )
    return kwargs, state, {"verifier": verifier_of(cfg), "speculative_tokens": speculative_tokens_of(cfg)}


def vllm_speculative_config(folder: str, k: int) -> dict[str, Any]:
    return {"model": folder, "num_speculative_tokens": int(k), "method": "dflash"}


def serve(verifier_name: str, folder: str, k: int) -> str:
    return (f"vllm serve {folder}\n# or, explicitly:\nvllm serve {verifier_name} --speculative-config "
            f"'{json.dumps(vllm_speculative_config(folder, k))}'")


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    rows = [("decoder layers", f"qwen3 x {kwargs['num_layers']} (KV injection)"),
            ("block size / mask token id", f"{kwargs['block_size']} / {kwargs['mask_token_id']}"),
            ("verifier layers fused", str(kwargs.get("aux_layer_ids"))),
            ("draft vocabulary", f"{kwargs['draft_vocab_size']} of {kwargs['vocab_size']}"),
            ("block attention", "causal" if kwargs.get("causal") else "bidirectional")]
    return {"title": "DFlash draft", "library": "vllm", "tags": ["dflash", "block-diffusion", "speculators"],
            "about": f"A {kwargs['num_layers']}-layer DFlash (block diffusion) draft model, proposing a block of "
                     f"{kwargs['block_size'] - 1} tokens in one forward,", "rows": rows}


FORMAT = DraftFormat(name="speculators", write=write, detect=detect, read=read, serve=serve, card=card,
                     vllm_speculative_config=vllm_speculative_config, recorded=recorded)
