"""``extract --backend vllm`` without vLLM: the version gate and the one-line errors of an environment that cannot be
built and of a worker that dies while starting (the proofs with vLLM are in test_vllm_extract.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.vllm_extract import (
    TESTED_VLLM,
    VllmHiddenStates,
    check_vllm_version,
    installed_vllm_version,
)


def test_the_version_gate(caplog):
    low, high = TESTED_VLLM
    for inside in (low, "0.32.4", "0.32.0+cpu"):
        check_vllm_version(inside)
    for outside in ("0.31.9", high, "0.40.1", "not-a-version"):
        with pytest.raises(UserError) as err:
            check_vllm_version(outside, where="/venv")
        message = str(err.value)
        assert "\n" not in message and f"vLLM {outside} in /venv" in message
        assert f">={low},<{high}" in message and "--backend hf" in message and "--allow-untested-vllm" in message
    check_vllm_version("0.40.1", allow_untested=True)
    assert any("0.40.1" in r.getMessage() and "--allow-untested-vllm" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="has no vllm installed: .* or use --backend hf"):
        check_vllm_version(None)


def test_a_python_without_vllm_has_no_version():
    assert installed_vllm_version(Path(sys.executable)) is None  # the project's own env never holds vLLM


def test_a_vllm_env_that_cannot_be_built_is_one_line(tmp_path, prepared_factory, monkeypatch):
    monkeypatch.setenv("PYTHON", str(tmp_path / "no-such-python"))  # scripts/vllm_env.sh fails at once
    prepared = prepared_factory(tmp_path / "prepared", "smollm2-135m", 49152, [4])
    with pytest.raises(UserError) as err:
        extract(data=prepared, out=tmp_path / "out", backend="vllm", vllm_venv=tmp_path / "venv", progress=False)
    assert re.fullmatch(r"backend vllm is not available \(scripts/vllm_env.sh failed .*\); use --backend hf",
                        str(err.value))
    assert (tmp_path / "out" / "vllm-env.log").is_file() and not (tmp_path / "out" / "plan.json").exists()


def test_a_worker_that_dies_while_starting_is_one_line(tmp_path):
    """The worker started by a python without vLLM exits at once: one line with the log's reason, no leftovers."""
    worker = VllmHiddenStates(Path(sys.executable), "some/model", [2], 4, "float32", tmp_path / "scratch",
                              tmp_path / "worker.log")
    with pytest.raises(UserError) as err:
        worker.__enter__()
    assert str(err.value) == (f"vLLM exited while starting: ModuleNotFoundError: No module named 'vllm' "
                              f"(log: {tmp_path / 'worker.log'})")
    assert worker.process is None and not (tmp_path / "scratch").exists()
