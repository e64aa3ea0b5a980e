"""The docs' blocks marked ``<!-- docs-test: run -->`` run as written, one command after the other in one folder (the
stages chained by their output folders), on a tiny verifier in place of the embedded one; the Python examples bind
to the functions they call."""

from __future__ import annotations

import ast
import inspect
import json
import re
from importlib import import_module

import pytest

from docs_commands import ROOT, all_commands, doc_files
from tiny_speculators.cli import main

EMBEDDED = "smollm2-135m"


@pytest.mark.slow
def test_the_marked_docs_commands_run_in_order(tmp_path, tiny_llama_dir, monkeypatch):
    commands = [c for c in all_commands() if c.run]
    assert commands
    monkeypatch.chdir(tmp_path)
    for command in commands:
        args = [str(tiny_llama_dir) if w == EMBEDDED else w for w in command.words]
        assert main(args) == 0, str(command)
    evaluation = json.loads((tmp_path / "runs" / "evaluation" / "summary.json").read_text())
    assert evaluation["matches_baseline"] is True  # the chain ends lossless


def _python_blocks() -> list[tuple[str, str]]:
    out = []
    for path in doc_files():
        for body in re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M):
            out.append((str(path.relative_to(ROOT)), body))
    return out


def test_the_docs_have_python_examples():
    assert any(file == "docs/getting-started.md" for file, _ in _python_blocks())


@pytest.mark.parametrize("file,body", _python_blocks(), ids=lambda v: v if v.endswith(".md") else "")
def test_python_examples_call_what_exists_with_arguments_it_takes(file, body):
    """Every name imported from tiny_speculators exists, and every call to one binds to its signature (the
    arguments are not evaluated: a call is checked for the number and names of its arguments)."""
    tree = ast.parse(body)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiny_speculators"):
            module = import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{file}: {node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            func = imported[node.func.id]
            if not callable(func) or any(k.arg is None for k in node.keywords) \
                    or any(isinstance(a, ast.Starred) for a in node.args):
                continue  # **kwargs or *args: the names are not known here
            args = [object()] * len(node.args)
            kwargs = {k.arg: object() for k in node.keywords if k.arg}
            try:
                inspect.signature(func).bind(*args, **kwargs)
            except TypeError as e:
                pytest.fail(f"{file}: {ast.unparse(node)}: {e}")
