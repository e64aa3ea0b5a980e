"""Training checkpoints people can read: ``OUT/step_000200/`` written atomically, found again by ``--resume``.

A checkpoint folder holds the loadable draft (``model.safetensors`` + ``draft_config.json``, written by
``models.checkpoint.save_draft``), ``optimizer.pt`` (AdamW state in fp32 + the schedule position),
``rng.pt`` (torch / CUDA / python / numpy generator states, one entry per rank) and ``meta.json`` (step,
epoch, position inside the epoch, tokens seen, best validation score, the run's options). Everything is
written into ``OUT/.tmp-step_000200`` and renamed into place, so a ``step_*`` folder is always complete;
``.pt`` files hold only tensors, numbers and strings, so they load with ``torch.load(weights_only=True)``.

    latest = latest_checkpoint(Path("runs/draft"))   # -> runs/draft/step_000200 or None
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiny_speculators.atomic import replace_dir_atomic
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{6,})$")
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
META_FILE = "meta.json"


def step_dir(out: Path, step: int) -> Path:
    return Path(out) / f"step_{step:06d}"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete ``step_*`` checkpoints under ``out``, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / META_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1][1] if found else None


write_atomic_dir = replace_dir_atomic  # step_XXXXXX/, best/ and final/ are swapped in whole


def prune_checkpoints(out: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step checkpoints (``best/`` and ``final/`` are separate)."""
    if keep_last <= 0:
        return
    for _, p in list_checkpoints(out)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def capture_rng() -> dict[str, Any]:
    """This process's generator states as plain tensors / tuples (weights_only-loadable)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_files(folder: Path, *, optimizer_state: dict, schedule_state: dict, rng_states: list[dict],
                        meta: dict) -> None:
    """Write the non-model files of a checkpoint into ``folder`` (meta.json last)."""
    torch.save({"optimizer": optimizer_state, "schedule": schedule_state}, folder / OPTIMIZER_FILE)
    torch.save({"ranks": rng_states}, folder / RNG_FILE)
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_training_files(folder: Path) -> tuple[dict, dict, list[dict], dict]:
    """``(optimizer_state, schedule_state, rng_states, meta)`` from a checkpoint folder."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        opt = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(folder / RNG_FILE, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {folder} is incomplete or unreadable: {e}") from None
    return opt["optimizer"], opt["schedule"], rng["ranks"], meta
