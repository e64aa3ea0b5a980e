"""What every export shares, whatever the family and format: dtypes, and reading JSON files (written with
``tiny_speculators.atomic.write_json_atomic``)."""

from __future__ import annotations

import torch

from tiny_speculators.models.files import read_json

__all__ = ["EXPORT_DTYPES", "read_json"]

EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}
