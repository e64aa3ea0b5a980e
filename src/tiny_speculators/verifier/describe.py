"""One description of a verifier: its (text) config, where its tensors are, its embeddings, and the record
that drafts and manifests keep of it. Every stage asks here instead of reading configs itself.

    from tiny_speculators.verifier.describe import verifier_config, verifier_record
    cfg = verifier_config("smollm2-135m")          # the text config (multimodal wrappers unwrapped)
    verifier_record("smollm2-135m", cfg)           # {"name_or_path", "architectures", "hidden_size", ...}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.dequantize import COMPANIONS, PACKED, dequantize
from tiny_speculators.verifier.load import load_verifier, resolve_verifier, verifier_id

log = logging.getLogger(__name__)

__all__ = ["config_value", "read_prefixed", "read_tensors", "safetensor_index", "text_config", "verifier_config",
           "verifier_embeddings", "verifier_record"]

# Where the token embedding lives in the checkpoints we know (plain decoders and multimodal wrappers).
EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "transformer.wte.weight")


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a config that is either a mapping (a ``config.json`` read as a dict, a recorded verifier) or an
    HF config object; ``default`` where it has none."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def text_config(config: Any) -> Any:
    """The decoder's config: ``text_config`` of a multimodal wrapper, else the config itself."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    if isinstance(config, dict):
        return config.get("text_config") or config
    return getattr(config, "text_config", None) or config


def verifier_config(name: str, trust_remote_code: bool = False, required: bool = False,
                    whole: bool = False) -> Any | None:
    """The verifier's text config (``whole``: the config itself, a multimodal wrapper's included); None (with a
    warning) when it is neither local nor cached, unless ``required``."""
    from transformers import AutoConfig

    source = resolve_verifier(name)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=not Path(source).is_dir(),
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if required:
            raise UserError(f"cannot read the config of verifier {name!r}: {e}") from None
        log.warning("cannot read the config of verifier %r (%s): its sizes are not checked", name, e)
        return None
    return config if whole else text_config(config)


def verifier_record(name: str, config: Any) -> dict[str, Any]:
    """What a draft records about its verifier (``config`` may be a wrapper config; the text config is used)."""
    text = text_config(config)
    return {"name_or_path": verifier_id(name), "architectures": list(getattr(config, "architectures", None) or []),
            "hidden_size": int(text.hidden_size), "vocab_size": int(text.vocab_size),
            "num_hidden_layers": int(text.num_hidden_layers)}


def safetensor_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> file of a local checkpoint folder (sharded index or one model.safetensors); {} if none.

    A packed quantized weight (``X.weight_packed``) is listed as ``X.weight`` too: :func:`read_tensors` reads it
    dequantized."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = {k: folder / v for k, v in weight_map.items()}
    elif single.is_file():
        with safe_open(str(single), "pt") as f:
            files = dict.fromkeys(f.keys(), single)
    else:
        return {}
    suffix = "." + PACKED
    return files | {k.removesuffix(PACKED) + "weight": v for k, v in files.items() if k.endswith(suffix)}


def read_tensors(index: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a checkpoint, ``index`` from :func:`safetensor_index` (each file opened once);
    a quantized weight comes back dequantized in fp32 (:mod:`~tiny_speculators.verifier.dequantize`), the scales
    and packed parts beside it are read for that and not returned."""
    with ExitStack() as stack:
        handles: dict[Path, tuple[Any, set[str]]] = {}

        def get(name: str) -> torch.Tensor | None:
            path = index.get(name)
            if path is None:
                return None
            if path not in handles:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
                handles[path] = handle, set(handle.keys())
            handle, keys = handles[path]
            return handle.get_tensor(name) if name in keys else None

        out: dict[str, torch.Tensor] = {}
        for name in names:
            weight = dequantize(name, get) if name.endswith("weight") else None
            out[name] = weight if weight is not None else get(name)
            if out[name] is None:
                raise KeyError(name)
        return out


def read_prefixed(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint whose name starts with ``prefix`` (e.g. ``model.layers.61.``), keyed
    without it; quantized weights dequantized, without their scales and packed parts."""
    keys = safetensor_index(folder)
    state = read_tensors(keys, [k for k in keys if k.startswith(prefix) and not k.endswith(COMPANIONS)])
    return {k.removeprefix(prefix): v for k, v in state.items()}


def verifier_embeddings(name: str) -> torch.Tensor:
    """The verifier's input embedding matrix ``[vocab, H]`` (fp32), read from its safetensors when local."""
    source = Path(resolve_verifier(name))
    if source.is_dir():
        files = safetensor_index(source)
        for key in EMBED_NAMES:
            if key in files:
                return read_tensors(files, [key])[key].float()
    model, _ = load_verifier(name, with_tokenizer=False)  # hub id, .bin weights or an unusual layout
    return model.get_input_embeddings().weight.detach().float().clone()
