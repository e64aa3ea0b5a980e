"""Our draft checkpoints, for every family: ``model.safetensors`` + ``draft_config.json``
(``{"model_type": <family>, "kwargs": {...}, **meta}``); ``kwargs`` rebuild the module and include the
verifier layers it reads (``aux_layer_ids``).

    save_draft(out / "step_000200", draft, {"verifier": {...}, "trained_with": {...}})
    draft, config = load_draft(out / "step_000200")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tiny_speculators.atomic import atomic_write
from tiny_speculators.errors import UserError
from tiny_speculators.models.family import DraftModel
from tiny_speculators.models.files import read_json

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"

__all__ = ["CONFIG", "WEIGHTS", "load_draft", "materialize", "read_draft_config", "save_draft"]


def save_draft(directory: str | Path, draft: DraftModel, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``draft_config.json`` into ``directory`` (each atomically).

    ``meta`` is merged into the config; callers pass at least ``verifier``
    (``{"name_or_path", "architectures", "hidden_size", "vocab_size"}``), which export needs.
    """
    from tiny_speculators.models import family_of

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"model_type": family_of(draft).name, "kwargs": draft.kwargs, **(meta or {})}
    own, given = draft.kwargs.get("aux_layer_ids"), config.get("aux_layer_ids")
    if own is not None and given is not None and list(own) != list(given):
        raise UserError(f"meta aux_layer_ids {given} disagree with the draft's own {own}")
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"
    atomic_write(directory / CONFIG, lambda tmp: Path(tmp).write_text(text))
    return directory


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    """``draft_config.json``, checked: a known ``model_type`` and ``kwargs``. Checkpoints written before the
    aux layer ids moved into ``kwargs`` are read as if they had."""
    from tiny_speculators.models import FAMILIES

    path = Path(directory) / CONFIG
    if not path.is_file():
        raise UserError(f"{path} does not exist: not a draft checkpoint folder")
    config = read_json(path)
    if config.get("model_type") not in FAMILIES or not isinstance(config.get("kwargs"), dict):
        raise UserError(f"{path} is not a draft config: needs 'kwargs' and a model_type among "
                        f"{', '.join(FAMILIES)} (got {config.get('model_type')!r})")
    if config["kwargs"].get("aux_layer_ids") is None and config.get("aux_layer_ids") is not None:
        config["kwargs"]["aux_layer_ids"] = list(config["aux_layer_ids"])
    config["aux_layer_ids"] = config["kwargs"].get("aux_layer_ids")
    return config


def materialize(model_cls: type[nn.Module], kwargs: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                where: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DraftModel:
    """``model_cls(**kwargs)`` filled with ``state`` without random initialization (built on the meta device);
    a state that does not match the config names the missing / unexpected tensors and bad shapes."""
    with torch.device("meta"):
        draft = model_cls(**kwargs)
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"the weights in {where} do not match its config: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                            f"{tuple(expected[name].shape)}")
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    draft.after_load(device)  # rebuild non-persistent buffers (made on the meta device), re-freeze shared weights
    if any(t.is_meta for t in list(draft.parameters()) + list(draft.buffers())):
        raise RuntimeError(f"draft from {where} still has tensors on the meta device")
    return draft.to(device)


def load_draft(directory: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the draft saved by :func:`save_draft`; floating weights in ``dtype``, maps kept int64/bool."""
    from tiny_speculators.models import get_family

    directory = Path(directory)
    config = read_draft_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{weights} does not exist: the draft checkpoint is incomplete")
    family = get_family(config["model_type"])
    state = load_file(str(weights), device="cpu")
    draft = materialize(family.model, config["kwargs"], state, str(weights), device, dtype)
    return draft, config
