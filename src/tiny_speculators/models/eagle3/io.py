"""Draft checkpoints: ``model.safetensors`` (speculators parameter names, incl. ``d2t``/``t2d``)
plus ``draft_config.json`` (``{"model_type": "eagle3", "kwargs": {...}, **meta}``).

    save_draft(out / "step_000200", draft, {"aux_layer_ids": [2, 15, 27], "verifier": {...}})
    draft, config = load_draft(out / "step_000200")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tiny_speculators.atomic import atomic_write
from tiny_speculators.errors import UserError
from tiny_speculators.models.eagle3.model import Eagle3Draft

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"


def save_draft(directory: str | Path, draft: Eagle3Draft, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``draft_config.json`` into ``directory`` (each atomically).

    ``meta`` is merged into the config; callers pass at least ``aux_layer_ids`` and ``verifier``
    (``{"name_or_path", "architectures", "hidden_size", "vocab_size"}``), which export needs.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"model_type": "eagle3", "kwargs": draft.kwargs, **(meta or {})}
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"
    atomic_write(directory / CONFIG, lambda tmp: Path(tmp).write_text(text))
    return directory


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise UserError(f"{path} does not exist: not a draft checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from e
    if config.get("model_type") != "eagle3" or not isinstance(config.get("kwargs"), dict):
        raise UserError(f"{path} is not an EAGLE-3 draft config (needs model_type 'eagle3' and 'kwargs')")
    return config


def load_draft(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Rebuild the draft saved by :func:`save_draft`; floating weights in ``dtype``, maps kept int64/bool."""
    directory = Path(directory)
    config = read_draft_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{weights} does not exist: the draft checkpoint is incomplete")
    with torch.device("meta"):
        draft = Eagle3Draft(**config["kwargs"])
    state = load_file(str(weights), device=str(device))
    missing = set(draft.state_dict()) - set(state)
    unexpected = set(state) - set(draft.state_dict())
    if missing or unexpected:
        raise UserError(f"{weights} does not match its config: missing {sorted(missing)}, "
                        f"unexpected {sorted(unexpected)}")
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    draft.rotary = draft.rotary.__class__(draft.kwargs["head_dim"], draft.kwargs["rope_parameters"],
                                          draft.kwargs["max_position_embeddings"]).to(device)
    draft.embed_tokens.weight.requires_grad_(bool(draft.kwargs.get("train_embeddings", False)))
    return draft.to(device), config
