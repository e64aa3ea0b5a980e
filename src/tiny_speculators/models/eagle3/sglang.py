"""The SafeAILab EAGLE-3 / SGLang draft format (``LlamaForCausalLMEagle3``), as SGLang and SpecForge load it.

``config.json`` is a Llama config of the one draft layer plus ``draft_vocab_size`` (and
``target_hidden_size`` when the verifier is wider) and ``eagle_config.eagle_aux_hidden_state_layer_ids``;
weights use ``midlayer.*`` for the decoder layer, the rest as in the speculators format.

Layer ids: SGLang's ``set_eagle3_layers_to_capture`` captures the INPUT of layer ``id + 1`` (the
output of layer ``id``), while our ids (and vLLM's) name the layer whose input is captured; so the
file holds ``our_id - 1``. SGLang replaces the draft's embeddings with the verifier's, so none are written.

What SGLang's ``LlamaForCausalLMEagle3`` cannot express (Qwen3 q/k norms, ``norm_before_residual``,
norms before ``fc``) is refused with a UserError rather than exported wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import DraftFormat, ExportInfo
from tiny_speculators.models.files import cast_state, dtype_name, read_json, require
from tiny_speculators.models.shape import decoder_fields, layer_shape_of
from tiny_speculators.models.speculators_format import layer_rows

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def check_exportable(kwargs: Mapping[str, Any]) -> None:
    unsupported = []
    if kwargs.get("layer_type", "llama") != "llama":
        unsupported.append(f"layer_type {kwargs['layer_type']!r} (q/k norms)")
    if kwargs.get("norm_before_residual"):
        unsupported.append("norm_before_residual")
    if kwargs.get("norm_before_fc"):
        unsupported.append("norm_before_fc")
    if kwargs.get("fc_norm"):
        unsupported.append("fc_norm")
    if kwargs.get("norm_output"):
        unsupported.append("norm_output")
    if int(kwargs.get("num_layers", 1)) != 1:
        unsupported.append(f"{kwargs['num_layers']} decoder layers (its midlayer is one)")
    if kwargs.get("sliding_window"):
        unsupported.append(f"a sliding window of {kwargs['sliding_window']}")
    if unsupported:
        raise UserError(f"SGLang's {ARCHITECTURE} cannot run a draft with {', '.join(unsupported)}; "
                        "export it with --format speculators instead")


def sglang_config(kwargs: Mapping[str, Any], *, aux_layer_ids: list[int] | None,
                  dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    check_exportable(kwargs)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "draft_vocab_size": int(kwargs["draft_vocab_size"]),
        **decoder_fields(kwargs),  # tie_word_embeddings False: True would make SGLang use embed_tokens as lm_head
        "bias": False,
        "torch_dtype": dtype_name(dtype),
    }
    target_hidden = kwargs.get("target_hidden_size") or kwargs["hidden_size"]
    if target_hidden != kwargs["hidden_size"]:
        cfg["target_hidden_size"] = int(target_hidden)
    if aux_layer_ids:
        if len(aux_layer_ids) != int(kwargs.get("num_aux", 3)):
            raise UserError(f"{len(aux_layer_ids)} aux layer ids for a draft that fuses {kwargs.get('num_aux', 3)}")
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layer_ids],
                               "use_aux_hidden_state": True}
    elif int(kwargs.get("num_aux", 3)) != 3:
        raise UserError("a draft fusing other than 3 verifier layers needs its aux layer ids recorded")
    return cfg


def export_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name == "embed_tokens.weight":
            continue
        out[("midlayer." + name.removeprefix("layers.0.")) if name.startswith("layers.0.") else name] = tensor
    return cast_state(out, dtype)


# ---------------------------------------------------------------- reading


def is_sglang_config(config: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or (
        "draft_vocab_size" in config and config.get("model_type") == "llama" and "speculators_config" not in config)


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    cfg = read_json(path)
    require(cfg, ["vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"],
            f"{path} ({ARCHITECTURE} format)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{path}: drafts with {cfg['num_hidden_layers']} decoder layers are not supported")
    return cfg


def aux_layer_ids_of(cfg: Mapping[str, Any], verifier_layers: int | None) -> list[int] | None:
    """Our aux layer ids (input of layer i) from the file's SGLang ids, or SGLang's default for the verifier."""
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, Mapping) else None
    if ids:
        return [int(i) + 1 for i in ids]
    if verifier_layers:
        return [2, verifier_layers // 2, verifier_layers - 3]
    return None


def draft_kwargs(cfg: Mapping[str, Any], draft_vocab_size: int, fc_in_features: int) -> dict[str, Any]:
    target_hidden = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    if fc_in_features % target_hidden:
        raise UserError(f"fc.weight takes {fc_in_features} inputs, not a multiple of the verifier hidden size "
                        f"{target_hidden}")
    return dict(
        **layer_shape_of(cfg),
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=target_hidden,
        num_aux=fc_in_features // target_hidden,
        layer_type="llama",
        norm_before_residual=False,  # SGLang's layer keeps the un-normed hidden state as residual
        norm_before_fc=False,
        fc_norm=False,
        train_embeddings=False,
    )


def normalize_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``midlayer.*`` -> ``layers.0.*``; a leading ``model.`` (SGLang's own module path) is dropped."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        elif name.startswith("midlayers.0."):
            name = "layers.0." + name.removeprefix("midlayers.0.")
        out[name] = tensor
    return out


# ---------------------------------------------------------------- the format, for the family table


def write(draft, info: ExportInfo) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = sglang_config(draft.kwargs, aux_layer_ids=draft.kwargs.get("aux_layer_ids"), dtype=info.dtype)
    return cfg, export_state(draft.state_dict(), info.dtype)


def read(directory: Path, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]):
    cfg = read_config(directory)
    state = normalize_state(tensors)
    if "fc.weight" not in state or "lm_head.weight" not in state:
        raise UserError(f"{directory} ({ARCHITECTURE} format) lacks fc.weight or lm_head.weight")
    rows = int(state["lm_head.weight"].shape[0])
    if cfg.get("draft_vocab_size") not in (None, rows):
        raise UserError(f"{directory}/config.json has draft_vocab_size {cfg['draft_vocab_size']} but "
                        f"lm_head.weight has {rows} rows")
    kwargs = draft_kwargs(cfg, rows, state["fc.weight"].shape[1])
    kwargs["aux_layer_ids"] = aux_layer_ids_of(cfg, None)
    record = {"verifier": {"name_or_path": None, "architectures": [], "hidden_size": kwargs["target_hidden_size"],
                           "vocab_size": kwargs["vocab_size"]},
              "resolve_aux": lambda layers: aux_layer_ids_of(cfg, layers)}
    return kwargs, state, record


def serve(verifier_name: str, folder: str, k: int) -> str:
    return (f"python -m sglang.launch_server --model-path {verifier_name} --speculative-algorithm EAGLE3 \\\n"
            f"    --speculative-draft-model-path {folder} --speculative-num-steps {k} \\\n"
            f"    --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"title": "EAGLE-3 draft", "library": "sglang", "tags": ["eagle3"],
            "about": "A one-layer EAGLE-3 draft model", "rows": layer_rows(kwargs)}


FORMAT = DraftFormat(name="eagle3-sglang", write=write, detect=is_sglang_config, read=read, serve=serve, card=card)
