"""Atomic writes: a reader, or a run resumed after a kill, never sees a half-written file.

Every file is written to a temporary name in the same folder and renamed over its target
(``os.replace`` is atomic within a filesystem). A full disk becomes one clear :class:`UserError`.

    from tiny_speculators.atomic import write_json_atomic
    write_json_atomic(Path("out/summary.json"), {"ok": True})
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiny_speculators.errors import UserError

__all__ = ["atomic_write", "replace_dir_atomic", "write_bytes_atomic", "write_json_atomic", "write_text_atomic"]


def atomic_write(path: str | Path, write: Callable[[str], None], *, fsync: bool = False) -> Path:
    """Call ``write(tmp_path)``, then rename the temporary file over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"disk full while writing {path}; free some space and rerun the same command") from None
        raise
    return path


def write_bytes_atomic(path: str | Path, data: bytes, *, fsync: bool = True) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), fsync=fsync)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, obj: Any, *, sort_keys: bool = False) -> Path:
    """Indented UTF-8 JSON with a trailing newline."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def replace_dir_atomic(target: str | Path, fill: Callable[[Path], None]) -> Path:
    """Call ``fill(tmp)`` on a fresh folder next to ``target``, then swap it into place.

    An existing ``target`` is moved aside before the swap and removed after it, so at every moment
    either the old or the new folder is complete under its name (or under ``.old-<name>``).
    """
    target = Path(target)
    tmp = target.parent / f".tmp-{target.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fill(tmp)
    old = target.parent / f".old-{target.name}"
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(tmp, target)
    if old.exists():
        shutil.rmtree(old)
    return target
