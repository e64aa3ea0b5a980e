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

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3.builder import decoder_fields, layer_shape_of
from tiny_speculators.models.family import DraftFormat, ExportInfo
from tiny_speculators.models.files import cast_state, dtype_name, read_json, require

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# The speculators release whose Eagle3SpeculatorConfig schema this writes (norm_before_fc / fc_norm /
# norm_output at top level); vLLM reads the fields, not this string.
SPECULATORS_SCHEMA_VERSION = "0.8.0"
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def transformer_layer_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The draft's decoder layers as a complete HF decoder config (``num_hidden_layers`` = the draft's layers).

    RoPE is written in both layouts (``rope_theta``/``rope_scaling`` for transformers v4 readers,
    ``rope_parameters`` for v5) so that either reconstructs the same frequencies.
    """
    cfg: dict[str, Any] = {
        "model_type": kwargs["layer_type"],
        "architectures": [LAYER_ARCHITECTURES[kwargs["layer_type"]]],
        **decoder_fields(kwargs),
        "mlp_bias": False,
        "rope_parameters": dict(kwargs["rope_parameters"]),
    }
    if int(kwargs.get("num_aux", 3)) != 3:  # vLLM sizes fc from this (default 3)
        cfg["num_aux_hidden_states"] = int(kwargs["num_aux"])
    return cfg


def check_proposal(speculative_tokens: int, verifier_name: str | None) -> None:
    """What every speculators export needs: a positive number of speculative tokens and the verifier's name."""
    if speculative_tokens < 1:
        raise UserError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
    if not verifier_name:
        raise UserError("the verifier's name_or_path is unknown: pass --verifier-name")


def proposal_config(algorithm: str, speculative_tokens: int, verifier_name: str,
                    verifier_architectures: Any) -> dict[str, Any]:
    """The ``speculators_config`` section: greedy proposals of ``speculative_tokens`` tokens, and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{
            "proposal_type": "greedy",
            "speculative_tokens": int(speculative_tokens),
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures or [])},
    }


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
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "draft_vocab_size": int(kwargs["draft_vocab_size"]),
        "norm_before_residual": bool(kwargs.get("norm_before_residual", False)),
        "norm_before_fc": bool(kwargs.get("norm_before_fc", False)),
        "fc_norm": bool(kwargs.get("fc_norm", False)),
        "norm_output": bool(kwargs.get("norm_output", False)),
        "embed_requires_grad": bool(kwargs.get("train_embeddings", False)),
        "tie_word_embeddings": False,
    }
    target_hidden = kwargs.get("target_hidden_size") or kwargs["hidden_size"]
    if target_hidden != kwargs["hidden_size"]:
        cfg["target_hidden_size"] = int(target_hidden)
    if aux_layer_ids:
        if len(aux_layer_ids) != int(kwargs.get("num_aux", 3)):
            raise UserError(f"{len(aux_layer_ids)} aux layer ids {list(aux_layer_ids)} for a draft that fuses "
                            f"{kwargs.get('num_aux', 3)} verifier layers")
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in aux_layer_ids]
    cfg["transformer_layer_config"] = transformer_layer_config(kwargs)
    cfg["speculators_config"] = proposal_config("eagle3", speculative_tokens, str(verifier["name_or_path"]),
                                                verifier.get("architectures"))
    cfg["dtype"] = cfg["torch_dtype"] = dtype_name(dtype)
    return cfg


def export_state(state: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors written to ``model.safetensors``: every draft tensor, minus frozen verifier embeddings and
    :func:`without_identity_maps`."""
    out = without_identity_maps(state, kwargs)
    if not kwargs.get("train_embeddings", False):
        out.pop("embed_tokens.weight", None)
    return cast_state(out, dtype)


def without_identity_maps(state: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` without ``d2t``/``t2d`` when the draft vocabulary is the verifier's whole vocabulary: vLLM's EAGLE-3
    model then has no map to load them into and refuses the file (the importer restores identity maps)."""
    out = dict(state)
    if int(kwargs["draft_vocab_size"]) == int(kwargs["vocab_size"]):
        out.pop("d2t", None)
        out.pop("t2d", None)
    return out


# ---------------------------------------------------------------- reading


def is_speculators_config(config: Mapping[str, Any]) -> bool:
    """An EAGLE-3 draft in the speculators format (not a parallel-drafting P-EAGLE one)."""
    return config.get("speculators_model_type") == "eagle3" and not config.get("parallel_drafting")


def layer_config(cfg: Mapping[str, Any], required: list[str], where: str) -> Mapping[str, Any]:
    """``cfg``'s ``transformer_layer_config``, once ``cfg`` has its ``required`` fields and the layer its shape."""
    require(cfg, required, where)
    layer = cfg["transformer_layer_config"]
    if not isinstance(layer, Mapping):
        raise UserError(f"{where}: transformer_layer_config must be an object")
    require(layer, ["vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"],
            f"{where} transformer_layer_config")
    return layer


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
    return dict(
        **layer_shape_of(layer),
        **({"num_layers": layers} if layers != 1 else {}),  # one-layer drafts keep the kwargs they always had
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


def verifier_of(cfg: Mapping[str, Any]) -> dict[str, Any]:
    verifier = cfg["speculators_config"]["verifier"]
    return {"name_or_path": verifier.get("name_or_path"), "architectures": list(verifier.get("architectures") or []),
            "hidden_size": int(cfg.get("target_hidden_size") or cfg["transformer_layer_config"]["hidden_size"]),
            "vocab_size": int(cfg["transformer_layer_config"]["vocab_size"])}


def speculative_tokens_of(cfg: Mapping[str, Any]) -> int:
    return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def recorded(directory: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What a speculators ``config.json`` records for serving, read leniently without the weights: the verifier's
    ``name_or_path`` and, when ``proposal_methods[0]`` gives it, ``speculative_tokens``."""
    spec = cfg.get("speculators_config") or {}
    record: dict[str, Any] = {"verifier": {"name_or_path": (spec.get("verifier") or {}).get("name_or_path")}}
    with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):
        record["speculative_tokens"] = int(spec["proposal_methods"][0]["speculative_tokens"])
    return record


# Tensors that speculators' training checkpoints carry but a draft does not run with.
IGNORED_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight")


def normalize_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Speculators tensor names are ours; drop training-only verifier copies, a ``model.`` prefix, and the unused
    ``hidden_norm`` that speculators may write for decoder layers after the first."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        later_hidden_norm = name.startswith("layers.") and ".hidden_norm." in name and not name.startswith("layers.0.")
        if name not in IGNORED_TENSORS and not later_hidden_norm:
            out[name] = tensor
    return out


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
    import json

    return (f"vllm serve {folder}\n# or, explicitly:\nvllm serve {verifier_name} --speculative-config "
            f"'{json.dumps(vllm_speculative_config(folder, k))}'")


def card(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"title": "EAGLE-3 draft", "library": "vllm", "tags": ["eagle3", "speculators"],
            "about": f"A {kwargs.get('num_layers', 1)}-layer EAGLE-3 draft model", "rows": layer_rows(kwargs)}


def layer_rows(kwargs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The draft's shape for a model card."""
    return [
        ("decoder layer", f"{kwargs['layer_type']} ({kwargs.get('num_layers', 1)} layer(s))"),
        ("hidden size", str(kwargs["hidden_size"])),
        ("verifier hidden size", str(kwargs.get("target_hidden_size") or kwargs["hidden_size"])),
        ("attention heads / kv heads / head dim",
         f"{kwargs['num_attention_heads']} / {kwargs['num_key_value_heads']} / {kwargs['head_dim']}"),
        ("MLP width", str(kwargs["intermediate_size"])),
        ("draft vocab / verifier vocab", f"{kwargs['draft_vocab_size']} / {kwargs['vocab_size']}"),
        ("verifier layers fused (input of layer i)", ", ".join(map(str, kwargs.get("aux_layer_ids") or []))
         or "default"),
        ("norm_before_residual / norm_before_fc / fc_norm",
         f"{kwargs['norm_before_residual']} / {kwargs['norm_before_fc']} / {kwargs['fc_norm']}"),
    ]


FORMAT = DraftFormat(name="speculators", write=write, detect=is_speculators_config, read=read, serve=serve,
                     card=card, vllm_speculative_config=vllm_speculative_config, recorded=recorded)
