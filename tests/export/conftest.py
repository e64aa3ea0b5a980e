"""Fixtures for export tests: random-init draft checkpoints of the tiny verifiers, in our format, and the session's
vLLM worker (``vllm_helpers.VllmWorker``) that runs every vLLM engine of these tests in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_helpers import make_checkpoint
from vllm_helpers import VllmWorker


@pytest.fixture
def llama_checkpoint(tmp_path, tiny_llama_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt", tiny_llama_dir)


@pytest.fixture
def qwen3_checkpoint(tmp_path, tiny_qwen3_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt-qwen3", tiny_qwen3_dir, layer_type="qwen3", norm_before_residual=True,
                           fc_norm=True, seed=3)


@pytest.fixture(scope="session")
def vllm_worker(vllm_venv, tmp_path_factory):
    """One ``vllm_check.py worker`` for the session (vLLM imported once), stopped at its end."""
    worker = VllmWorker(vllm_venv, tmp_path_factory.mktemp("vllm-worker") / "vllm.log")
    try:
        yield worker
    finally:
        worker.close()
