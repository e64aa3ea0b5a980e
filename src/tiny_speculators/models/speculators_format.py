"""The vLLM "speculators" format, the parts every family's speculators format shares: ``config.json`` with the draft's
decoder layers as a full HF config (``transformer_layer_config``), the proposal and the verifier
(``speculators_config``), tensors under their speculators names in ``model.safetensors``. Each family's
``speculators.py`` writes and reads its own fields with these.

    from tiny_speculators.models.speculators_format import proposal_config
    proposal_config("eagle3", 3, "HuggingFaceTB/SmolLM2-135M-Instruct", ["LlamaForCausalLM"])
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import ExportInfo
from tiny_speculators.models.files import dtype_name, require
from tiny_speculators.models.shape import decoder_fields

__all__ = ["CONFIG", "LAYER_ARCHITECTURES", "SPECULATORS_SCHEMA_VERSION", "check_proposal", "config_json",
           "layer_config", "layer_rows", "normalize_state", "proposal_config", "serve_command", "speculative_tokens_of",
           "transformer_layer_config", "verifier_of", "without_identity_maps"]

CONFIG = "config.json"
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
    if kwargs.get("sliding_window"):  # vLLM's EAGLE-3 draft layers read their kind from layer_types
        cfg["layer_types"] = ["sliding_attention"] * int(kwargs.get("num_layers", 1))
        cfg["sliding_window"] = int(kwargs["sliding_window"])
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


def config_json(model_type: str, architecture: str, kwargs: Mapping[str, Any], own: Mapping[str, Any], *,
                layer: Mapping[str, Any], aux_layer_ids: list[int] | None, info: ExportInfo) -> dict[str, Any]:
    """A draft's ``config.json``: the speculators header, the family's ``own`` top-level fields, ``target_hidden_size``
    when the verifier is wider than the draft, ``eagle_aux_hidden_state_layer_ids`` (when given), the decoder
    ``layer`` as ``transformer_layer_config``, the proposal (algorithm = ``model_type``) and the dtype."""
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "draft_vocab_size": int(kwargs["draft_vocab_size"]),
        **own,
        "tie_word_embeddings": False,
    }
    target_hidden = kwargs.get("target_hidden_size") or kwargs["hidden_size"]
    if target_hidden != kwargs["hidden_size"]:
        cfg["target_hidden_size"] = int(target_hidden)
    if aux_layer_ids:
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in aux_layer_ids]
    cfg["transformer_layer_config"] = dict(layer)
    cfg["speculators_config"] = proposal_config(model_type, info.speculative_tokens, info.verifier_name,
                                                info.verifier_architectures)
    cfg["dtype"] = cfg["torch_dtype"] = dtype_name(info.dtype)
    return cfg


def without_identity_maps(state: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` without ``d2t``/``t2d`` when the draft vocabulary is the verifier's whole vocabulary: vLLM's EAGLE-3
    model then has no map to load them into and refuses the file (the importer restores identity maps)."""
    out = dict(state)
    if int(kwargs["draft_vocab_size"]) == int(kwargs["vocab_size"]):
        out.pop("d2t", None)
        out.pop("t2d", None)
    return out


# ---------------------------------------------------------------- reading


def layer_config(cfg: Mapping[str, Any], required: list[str], where: str) -> Mapping[str, Any]:
    """``cfg``'s ``transformer_layer_config``, once ``cfg`` has its ``required`` fields and the layer its shape."""
    require(cfg, required, where)
    layer = cfg["transformer_layer_config"]
    if not isinstance(layer, Mapping):
        raise UserError(f"{where}: transformer_layer_config must be an object")
    require(layer, ["vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"],
            f"{where} transformer_layer_config")
    return layer


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


# ---------------------------------------------------------------- serving and model cards


def serve_command(verifier_name: str, folder: str, speculative_config: Mapping[str, Any]) -> str:
    """How to serve a speculators folder with vLLM: the folder alone, or the verifier with ``speculative_config``."""
    return (f"vllm serve {folder}\n# or, explicitly:\nvllm serve {verifier_name} --speculative-config "
            f"'{json.dumps(speculative_config)}'")


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
