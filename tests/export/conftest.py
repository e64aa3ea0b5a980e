"""Fixtures for export tests: random-init draft checkpoints of the tiny verifiers, in our format."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_helpers import make_checkpoint


@pytest.fixture
def llama_checkpoint(tmp_path, tiny_llama_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt", tiny_llama_dir)


@pytest.fixture
def qwen3_checkpoint(tmp_path, tiny_qwen3_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt-qwen3", tiny_qwen3_dir, layer_type="qwen3", norm_before_residual=True,
                           fc_norm=True, seed=3)
