"""What every export shares, whatever the family and format: dtypes and atomic JSON files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.models.files import read_json

__all__ = ["EXPORT_DTYPES", "read_json", "write_json"]

EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}


def write_json(path: Path, data: Any) -> None:
    write_json_atomic(path, data)
