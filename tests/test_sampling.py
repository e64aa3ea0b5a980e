"""``sampling.py`` is a ground floor: the proposers (``models/``) and the decoding loop (``evaluate/``) import it, and
it imports neither (its numbers are tested with the decoding loop, ``tests/evaluate/test_eval_decoding.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import tiny_speculators.sampling


def test_sampling_imports_neither_models_nor_evaluate():
    tree = ast.parse(Path(tiny_speculators.sampling.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = sorted(name for name in imported if name.startswith("tiny_speculators"))
    assert ours == ["tiny_speculators.errors"]
