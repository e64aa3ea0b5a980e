"""Results that the xdist workers of one test run share: built once by whichever worker asks first, under a file
lock (the others wait for it, then read it).

Test modules run whole on one worker each (``--dist loadfile``), so a session fixture is per worker: the vLLM
modules each trained the embedded verifier's drafts and generated its distillation answers, plain greedy tokens and
plain vLLM runs again, a few minutes of the suite's two cores. Everything kept here is deterministic for its key
(greedy generation, a seeded training run) and lives under the run's pytest root, so a new run starts empty.

    from shared_cache import shared, key
    folder = shared(f"answers-{key(verifier_dir, new_tokens)}", lambda tmp: ...)  # build into tmp
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT_ENV = "TINY_SPECULATORS_TEST_SHARED"  # set by tests/conftest.py for the run; else a folder per process
DONE = ".complete"


def key(*parts: object) -> str:
    """A short stable name for ``parts`` (paths, numbers, lists, dicts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _root() -> Path:
    if ROOT_ENV not in os.environ:
        os.environ[ROOT_ENV] = tempfile.mkdtemp(prefix="tiny-speculators-shared-")
    root = Path(os.environ[ROOT_ENV])
    root.mkdir(parents=True, exist_ok=True)
    return root


def shared(name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, built once per test run by ``build(folder)`` (into a fresh folder renamed into place when
    it returns; a failed build leaves nothing, and the next asker builds again)."""
    root = _root()
    folder = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / DONE).exists():
            partial = root / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
            partial.mkdir()
            build(partial)
            (partial / DONE).touch()
            partial.rename(folder)
    return folder


def shared_json(name: str, compute: Callable[[], object]) -> object:
    """``compute()``'s JSON result, computed once per test run."""
    folder = shared(name, lambda tmp: (tmp / "value.json").write_text(json.dumps(compute())))
    return json.loads((folder / "value.json").read_text())
