"""Helpers shared by the exporters and importers: atomic writes, dtypes, the verifier's config and embeddings."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}


def write_json(path: Path, data: Any) -> None:
    write_json_atomic(path, data)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    return data


def require(config: Mapping[str, Any], keys: list[str], where: str) -> None:
    """UserError naming every missing key of ``config`` (``where`` names the file and format)."""
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise UserError(f"{where} is missing required field(s) {', '.join(missing)}")


def cast_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors to ``dtype`` (contiguous, on CPU); integer/bool maps unchanged."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def verifier_config(name: str) -> Any | None:
    """The verifier's HF config, or None (with a warning) when it is neither local nor in the HF cache."""
    from transformers import AutoConfig

    from tiny_speculators.verifier.load import resolve_verifier

    source = resolve_verifier(name)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=not Path(source).is_dir())
    except (OSError, ValueError) as e:
        log.warning("cannot read the config of verifier %r (%s): its sizes are not checked", name, e)
        return None
    return getattr(config, "text_config", None) or config


def check_against_verifier(draft_kwargs: Mapping[str, Any], verifier: Any, name: str, aux_layer_ids=None) -> None:
    """UserError when the draft cannot run on this verifier: hidden size, vocab size or aux layer ids."""
    hidden = int(getattr(verifier, "hidden_size", 0) if not isinstance(verifier, Mapping)
                 else verifier.get("hidden_size") or 0)
    vocab = int(getattr(verifier, "vocab_size", 0) if not isinstance(verifier, Mapping)
                else verifier.get("vocab_size") or 0)
    layers = (getattr(verifier, "num_hidden_layers", None) if not isinstance(verifier, Mapping)
              else verifier.get("num_hidden_layers"))
    target_hidden = draft_kwargs.get("target_hidden_size") or draft_kwargs["hidden_size"]
    if hidden and hidden != target_hidden:
        raise UserError(f"verifier {name} has hidden size {hidden} but the draft was built for verifier hidden "
                        f"size {target_hidden}: the draft does not belong to this verifier")
    if vocab and vocab != draft_kwargs["vocab_size"]:
        raise UserError(f"verifier {name} has vocab size {vocab} but the draft's embeddings and t2d cover "
                        f"{draft_kwargs['vocab_size']} tokens: the draft does not belong to this verifier")
    if layers and aux_layer_ids and max(aux_layer_ids) >= int(layers):
        raise UserError(f"aux layer ids {list(aux_layer_ids)} do not exist in verifier {name} "
                        f"({layers} layers)")


_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight", "transformer.wte.weight")


def verifier_embeddings(name: str) -> torch.Tensor:
    """The verifier's input embedding matrix ``[vocab, H]`` (fp32), read from its safetensors when local."""
    from tiny_speculators.verifier.load import load_verifier, resolve_verifier

    source = Path(resolve_verifier(name))
    if source.is_dir():
        from safetensors import safe_open

        index = source / "model.safetensors.index.json"
        files = ([source / f for f in set(read_json(index)["weight_map"].values())] if index.is_file()
                 else sorted(source.glob("*.safetensors")))
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in _EMBED_NAMES:
                    if key in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                        return f.get_tensor(key).float()
    model, _ = load_verifier(name, with_tokenizer=False)  # hub id, .bin weights or an unusual layout
    return model.get_input_embeddings().weight.detach().float().clone()


def decoder_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The HF decoder-config fields of the draft's one layer that every export format writes.

    RoPE goes in the v4 layout (``rope_theta``/``rope_scaling``); formats read by v5 add ``rope_parameters``.
    """
    rope = dict(kwargs["rope_parameters"])
    rope_type = rope.get("rope_type", "default")
    return {
        "vocab_size": int(kwargs["vocab_size"]),
        "hidden_size": int(kwargs["hidden_size"]),
        "intermediate_size": int(kwargs["intermediate_size"]),
        "num_hidden_layers": 1,
        "num_attention_heads": int(kwargs["num_attention_heads"]),
        "num_key_value_heads": int(kwargs["num_key_value_heads"]),
        "head_dim": int(kwargs["head_dim"]),
        "hidden_act": kwargs.get("hidden_act", "silu"),
        "rms_norm_eps": float(kwargs["rms_norm_eps"]),
        "max_position_embeddings": int(kwargs["max_position_embeddings"]),
        "attention_bias": bool(kwargs.get("attention_bias", False)),
        # never tied: the draft's lm_head covers the draft vocab, its embeddings the full one
        "tie_word_embeddings": False,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
    }
