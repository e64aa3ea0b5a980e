"""Small helpers every draft format shares: JSON and weight files read with one-line errors, fields, dtypes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tiny_speculators.errors import UserError

__all__ = ["cast_state", "dtype_name", "read_json", "read_weights", "require"]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing file, bad JSON or a non-object gives a :class:`UserError`."""
    path = Path(path)
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


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF-style folder: ``model.safetensors``, sharded safetensors, or ``pytorch_model.bin``."""
    directory = Path(directory)
    if (directory / "model.safetensors").is_file():
        return load_file(str(directory / "model.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(read_json(index)["weight_map"].values())):
            state.update(load_file(str(directory / shard)))
        return state
    if (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise UserError(f"{directory / 'pytorch_model.bin'} does not hold a state dict")
        return state
    raise UserError(f"{directory} has no weights (model.safetensors, model.safetensors.index.json or "
                    "pytorch_model.bin)")
