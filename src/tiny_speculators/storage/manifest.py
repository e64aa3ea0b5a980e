"""The manifest of an extraction folder, built so that several ranks on shared storage never clobber one another.

Files in ``OUT/``:

- ``plan.json``: the settings that decide shard contents (verifier, layers, dtype, layout, dataset
  fingerprint) and the shard plan (sample range of every shard). Every rank computes the same plan from the
  same inputs and writes it atomically (identical bytes), or checks it against the one already there: a
  rerun with different settings is refused instead of mixing shards.
- ``shard-00000.safetensors``...: written atomically (temp file + ``os.replace``) by the rank that owns
  the shard (shard k belongs to rank ``k % world_size``).
- ``parts/rank-00000.json``: one file per rank, rewritten atomically by that rank only, listing the shards it
  has completed with their sha256, byte size and sample range. A shard counts as done only once it is listed
  here, so a kill between the rename and the listing just redoes that shard.
- ``manifest.json``: the merged view = plan settings + the union of all parts; written (atomically, with
  identical content whichever rank gets there) by any rank that finds every planned shard done.
  Readers use it, or build the same merged view from ``plan.json`` + ``parts/`` if it is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_speculators import atomic
from tiny_speculators.errors import UserError

__all__ = ["MANIFEST", "PLAN", "done_shards", "init_plan", "load_manifest", "merge_manifest", "read_json",
           "record_shard", "shard_name", "write_json_atomic"]

FORMAT = "tiny-speculators/hidden-states"
FORMAT_VERSION = 1
PLAN = "plan.json"
MANIFEST = "manifest.json"
PARTS = "parts"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder + fsync + rename; ENOSPC -> UserError."""
    try:
        atomic.write_bytes_atomic(path, data)
    except UserError as e:
        raise UserError(f"{e} ({len(data)} bytes): extraction resumes after the last complete shard") from None


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def init_plan(out: Path, settings: dict[str, Any], shards: list[dict[str, int]]) -> dict[str, Any]:
    """Write ``plan.json`` or check that the one in ``out`` has the same settings and shard plan."""
    plan = {"format": FORMAT, "format_version": FORMAT_VERSION, "settings": settings, "shards": shards}
    path = out / PLAN
    if path.exists():
        old = read_json(path)
        old_settings = old.get("settings", {})
        diff = sorted(k for k in {*settings, *old_settings} if settings.get(k) != old_settings.get(k))
        if diff:
            details = "; ".join(f"{k}: {old_settings.get(k)!r} there, {settings.get(k)!r} now" for k in diff)
            raise UserError(f"{out} holds an extraction with different settings ({details}); "
                            "use a new --out folder or the same settings to resume")
        if old.get("shards") != shards:
            raise UserError(f"{out} holds an extraction with a different shard plan (was --shard-mb changed?); "
                            "use a new --out folder or the same settings to resume")
        return old
    write_json_atomic(path, plan)
    return plan


def _part_path(out: Path, rank: int) -> Path:
    return out / PARTS / f"rank-{rank:05d}.json"


def read_part(out: Path, rank: int) -> dict[str, Any]:
    path = _part_path(out, rank)
    return read_json(path) if path.exists() else {"rank": rank, "shards": {}}


def record_shard(out: Path, rank: int, entry: dict[str, Any]) -> None:
    """Add a completed shard to this rank's part file (only this rank ever writes it)."""
    part = read_part(out, rank)
    part["shards"][str(entry["index"])] = entry
    write_json_atomic(_part_path(out, rank), part)


def done_shards(out: Path) -> dict[int, dict[str, Any]]:
    """Union of all ranks' completed shards; entries whose file is gone or has another size are dropped."""
    done: dict[int, dict[str, Any]] = {}
    parts_dir = out / PARTS
    for path in sorted(parts_dir.glob("rank-*.json")) if parts_dir.is_dir() else []:
        for key, entry in read_json(path).get("shards", {}).items():
            index = int(key)
            if index in done and done[index]["sha256"] != entry["sha256"]:
                raise UserError(f"{out}: shard {index} is recorded twice with different checksums "
                                f"(in {path.name} and another part file); remove {out} and extract again")
            file = out / entry["file"]
            if file.is_file() and file.stat().st_size == entry["bytes"]:
                done[index] = entry
    return done


def _merged(out: Path, plan: dict[str, Any], done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    shards = [done[i] for i in range(len(plan["shards"])) if i in done]
    return {"format": plan["format"], "format_version": plan["format_version"], **plan["settings"],
            "samples": sum(s["end"] - s["start"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards), "num_shards": len(plan["shards"]), "shards": shards}


def merge_manifest(out: Path) -> dict[str, Any] | None:
    """Write ``manifest.json`` if every planned shard is done; return it (None while shards are missing)."""
    plan = read_json(out / PLAN)
    done = done_shards(out)
    if len(done) < len(plan["shards"]):
        return None
    manifest = _merged(out, plan, done)
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def load_manifest(out: Path) -> dict[str, Any]:
    """The manifest of a complete extraction: ``manifest.json`` or the same view merged from ``parts/``."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"hidden-state folder {out} does not exist")
    if (out / MANIFEST).exists():
        return read_json(out / MANIFEST)
    if not (out / PLAN).exists():
        raise UserError(f"{out} is not an extraction folder (no {MANIFEST} or {PLAN})")
    plan = read_json(out / PLAN)
    done = done_shards(out)
    missing = [i for i in range(len(plan["shards"])) if i not in done]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise UserError(f"extraction in {out} is incomplete: {len(missing)} of {len(plan['shards'])} shards "
                        f"missing ({shown}); rerun extract (every rank) to finish it")
    return _merged(out, plan, done)
