"""A verifier's identity for caches: what makes two runs' results comparable (light: no torch)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["verifier_fingerprint"]


def verifier_fingerprint(verifier: str) -> str:
    """The verifier's identity: a hub id / embedded name as is; a local folder by its config and file sizes."""
    path = Path(verifier).expanduser()
    if not path.is_dir():
        return verifier
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        rel = str(p.relative_to(path))
        h.update(rel.encode() + b"\0")
        if p.suffix in (".json", ".jinja", ".txt", ".model") and p.stat().st_size < (16 << 20):
            h.update(p.read_bytes())
        else:  # weights: size + mtime (hashing gigabytes on every run would be slow)
            st = p.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{path.resolve()}#{h.hexdigest()[:16]}"
