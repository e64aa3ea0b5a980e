"""docs/verifiers.md is what scripts/verifier_table.py writes, and every test it names as a proof exists."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("verifier_table", ROOT / "scripts" / "verifier_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_verifier_table_is_current_and_names_real_tests():
    table = load_script()
    assert table.missing_tests() == []
    assert (ROOT / "docs" / "verifiers.md").read_text(encoding="utf-8") == table.render(), \
        "docs/verifiers.md is stale: run python scripts/verifier_table.py"


def test_a_missing_test_is_caught():
    table = load_script()
    assert table.test_exists("tests/test_verifier_table.py::test_a_missing_test_is_caught")
    assert not table.test_exists("tests/test_verifier_table.py::test_that_is_not_there")
    assert not table.test_exists("tests/no_such_file.py::test_a_missing_test_is_caught")
