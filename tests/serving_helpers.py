"""Test helper for anything that starts ``vllm serve``: which of its servers are still alive (read from /proc)."""

from __future__ import annotations

import re
from pathlib import Path


def vllm_processes(ports: list[int]) -> list[str]:
    """Command lines of vLLM api servers still listening on one of ``ports`` (from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        text = " ".join(a.decode(errors="replace") for a in args)
        if "vllm.entrypoints.openai.api_server" in text and any(f"--port {p} " in text + " " for p in ports):
            found.append(text)
    return found


def server_port(log_path: Path) -> int:
    """The port of the server whose log this is (its first line is the command line)."""
    command = log_path.read_text().splitlines()[0]
    return int(re.search(r"--port (\d+)", command).group(1))
