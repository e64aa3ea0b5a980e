"""The commands in the README and the docs, as a test reads them.

A ``bash`` code block is split into commands at newlines, ``&&``, ``;`` and ``|`` (a trailing backslash continues a
line, ``#`` starts a comment). A command is ours when it starts with ``tiny-speculators`` or runs the module
``tiny_speculators.cli`` (``python -m``, ``torchrun ... -m``); its words after that are the CLI's arguments.

A block right after an HTML comment ``<!-- docs-test: run -->`` is run by ``tests/test_docs.py`` (on a tiny
verifier in place of the embedded one); every other command of ours is parsed, so a flag that does not exist fails.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- docs-test: run -->"
_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```(?:bash|sh|shell|console)[^\n]*\n(?P<body>.*?)^(?P=indent)```",
                    flags=re.S | re.M)


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repository root
    line: int  # of the block's first line
    words: tuple[str, ...]  # the CLI's arguments: words[0] is the stage (or a top-level flag)
    run: bool  # in a block marked to be run

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: tiny-speculators {' '.join(self.words)}"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]


def _logical_lines(body: str) -> list[str]:
    lines, current = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    if current:
        lines.append(current)
    return lines


def _ours(words: list[str]) -> list[str] | None:
    """The CLI arguments of a command of ours, or None for any other command."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if words[0] == "tiny-speculators":
        return words[1:]
    if "tiny_speculators.cli" in words:
        i = words.index("tiny_speculators.cli")
        if i > 0 and words[i - 1] == "-m":
            return words[i + 1:]
    return None


def commands_in(text: str, file: str) -> list[DocCommand]:
    out = []
    for m in _BLOCK.finditer(text):
        before = text[:m.start()].rstrip()
        run = before.endswith(RUN_MARK)
        line_no = text.count("\n", 0, m.start()) + 1
        for line in _logical_lines(m.group("body")):
            for part in re.split(r"&&|;|\|\|?", line):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue  # a quote spanning parts (e.g. a ';' inside quotes) is not one of ours
                args = _ours(words)
                if args is not None:
                    out.append(DocCommand(file, line_no, tuple(args), run))
    return out


def all_commands() -> list[DocCommand]:
    out = []
    for path in doc_files():
        out += commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return out
