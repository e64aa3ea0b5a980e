"""Committed chunks of ``prepare``'s work, so that a killed run resumes where it stopped.

``prepare --out DIR`` works in ``.DIR.partial/`` next to ``DIR``. Every ``chunk_records`` records it
commits one chunk: ``chunk-000007.arrow`` (the rows) and then ``chunk-000007.json`` (counts, bad
records, and the position in the input after the chunk: file index and record within the file).
A chunk exists only once its ``.json`` does, and both are written under temporary names and
renamed, so a kill at any moment leaves whole chunks. A rerun with the same inputs (paths, sizes,
modification times), options, template and tokenizer (``fingerprint.json``) reads the committed
chunks and starts reading the input after the last one; anything else starts over. Chunk
boundaries fall on the same records either way, so the final output is byte-identical.

    store = ChunkStore(Path("runs/.prepared.partial"), fingerprint)
    index, start = store.open()          # 0, (0, 0) on a fresh run
    store.commit(index, rows, stats)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["ChunkStore", "input_fingerprint"]


def input_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """Path, size and modification time of every input file (of every file inside a folder)."""
    out = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        out.append({"path": str(path), "files": [[str(f.relative_to(path)) if path.is_dir() else f.name,
                                                  f.stat().st_size, f.stat().st_mtime_ns] for f in files]})
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ChunkStore:
    """The ``.partial`` folder of one ``prepare`` output; see the module docstring."""

    def __init__(self, folder: Path, fingerprint: dict[str, Any]):
        self.folder = Path(folder)
        self.fingerprint = fingerprint

    def _lock(self) -> None:
        lock = self.folder / "lock"
        if lock.is_file():
            try:
                pid = int(lock.read_text().strip() or 0)
            except ValueError:
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise UserError(f"another prepare (pid {pid}) is writing {self.folder}; wait for it or stop it")
        lock.write_text(f"{os.getpid()}\n")

    def open(self) -> tuple[int, tuple[int, int]]:
        """``(next chunk index, input position to start at)``; a store of other inputs/options is discarded."""
        stored = self.folder / "fingerprint.json"
        if self.folder.is_dir():
            self._lock()
            same = stored.is_file() and json.loads(stored.read_text(encoding="utf-8")) == self.fingerprint
            if not same:
                log.info("%s was written for other inputs or options: starting over", self.folder)
                self.remove()
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True)
            self._lock()
            write_json_atomic(stored, self.fingerprint, sort_keys=True)
        chunks = self.chunks()
        committed = {f"chunk-{i:06d}" for i in range(len(chunks))}
        for extra in [*self.folder.glob("chunk-*"), *self.folder.glob(".chunk-*")]:  # a chunk cut off by the kill
            if extra.name.lstrip(".").split(".")[0] not in committed or extra.name.startswith("."):
                extra.unlink()
        if not chunks:
            return 0, (0, 0)
        file, n = chunks[-1][1]["end"]
        log.info("resuming %s after %d committed chunks (%d records)", self.folder, len(chunks),
                 sum(s["records_read"] for _, s in chunks))
        return len(chunks), (int(file), int(n))

    def commit(self, index: int, rows: dict[str, list[Any]], features: Any, stats: dict[str, Any]) -> None:
        """Write chunk ``index``: its rows (column lists), then its stats, which make it count."""
        from datasets.arrow_writer import ArrowWriter

        def write_rows(tmp: str) -> None:
            with ArrowWriter(features=features, path=tmp) as writer:
                writer.write_batch(rows)
                writer.finalize()

        atomic_write(self.folder / f"chunk-{index:06d}.arrow", write_rows)
        write_json_atomic(self.folder / f"chunk-{index:06d}.json", stats)

    def chunks(self) -> list[tuple[Path, dict[str, Any]]]:
        """``(rows file, stats)`` of the committed chunks, in order (stops at the first gap)."""
        out = []
        i = 0
        while (self.folder / f"chunk-{i:06d}.json").is_file() and (self.folder / f"chunk-{i:06d}.arrow").is_file():
            out.append((self.folder / f"chunk-{i:06d}.arrow",
                        json.loads((self.folder / f"chunk-{i:06d}.json").read_text(encoding="utf-8"))))
            i += 1
        return out

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
