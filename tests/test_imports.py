"""Imports run one way: the import-linter contracts in pyproject.toml (``[tool.importlinter]``) hold.

cli -> pipeline -> stages -> models -> verifier/data -> storage, and no draft family imports another family's
folder (DSpark builds on DFlash, by design). ``lint-imports`` prints the same report with the offending lines.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lint(config: Path, cache: Path) -> tuple[int, str]:
    """``lint-imports`` in a child process: import-linter configures logging (``dictConfig``), which would disable
    every logger already made in this one, and the log-capturing tests after it would see nothing."""
    import subprocess
    import sys

    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, cache_dir={str(cache)!r}, no_logo=True))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def test_import_contracts_hold(tmp_path):
    code, report = _lint(REPO / "pyproject.toml", tmp_path)
    assert code == 0, report
    for name in ("cli -> pipeline -> stages -> models", "no draft family imports another's folder"):
        assert any(line.startswith(name) and "KEPT" in line for line in report.splitlines()), report


def test_a_broken_contract_is_reported(tmp_path):
    """The check can fail: a contract that forbids what the code does (models use torch's tensors, storage is
    below models) is reported as broken."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_package = "tiny_speculators"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
                      'layers = ["tiny_speculators.errors", "tiny_speculators.models"]\n')
    code, report = _lint(config, tmp_path / "cache")
    assert code != 0 and "upside down BROKEN" in report, report


def _imported(modules: list[str]) -> set[str]:
    """The top-level packages a fresh interpreter holds after importing ``modules``."""
    import json
    import subprocess
    import sys

    code = (f"import sys; [__import__(m) for m in {modules!r}]; "
            "import json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_start_up_stays_light():
    """`tiny-speculators --help` and the pipeline's planning import no torch; a stage module imports torch but no
    transformers, datasets or plotting until it runs (the imports kept inside functions are these)."""
    heavy = {"transformers", "datasets", "pyarrow", "matplotlib", "vllm", "tensorboard", "accelerate", "gguf"}
    assert not _imported(["tiny_speculators.cli", "tiny_speculators.pipeline"]) & (heavy | {"torch"})
    stages = ["tiny_speculators.models", "tiny_speculators.train.stage", "tiny_speculators.evaluate.stage",
              "tiny_speculators.export.stage", "tiny_speculators.verifier.extract", "tiny_speculators.data.prepare",
              "tiny_speculators.data.regenerate", "tiny_speculators.benchmark.stage"]
    assert not _imported(stages) & heavy
