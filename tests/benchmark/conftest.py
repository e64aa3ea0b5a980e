"""Fixtures for the serving benchmark: an exported draft of the embedded verifier (the vLLM + GuideLLM environment is
the session's ``vllm_venv``, tests/conftest.py).

The draft is the one ``tests/export/test_vllm.py`` trains (its ``vllm_helpers``, on the same self-distillation
data), trained once per test run by whichever module asks first (``tests/shared_cache.py``).
``TINY_SPECULATORS_SKIP_VLLM=1`` skips everything that needs vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))  # vllm_helpers

K = 3


@pytest.fixture(scope="session")
def exported_draft(tmp_path_factory, smollm2_dir) -> Path:
    """A briefly trained EAGLE-3 draft of the embedded verifier (k=3), exported with the verifier's folder: the
    draft ``tests/export/test_vllm.py`` trains (the embedded default's norms), trained once per test run."""
    from vllm_helpers import train_draft

    from tiny_speculators.export import export

    root = tmp_path_factory.mktemp("bench-draft")
    ckpt = train_draft(smollm2_dir, root / "ckpt", options={"fc_norm": True, "norm_before_residual": True})
    export(ckpt, out=root / "export", verifier_name=str(smollm2_dir), speculative_tokens=K)
    return root / "export"
