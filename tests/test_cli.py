"""The CLI is generated from stage signatures; YAML and flags go through the same validation."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import pytest

from tiny_speculators import __version__, cli
from tiny_speculators.config import bind, load_yaml, param_docs
from tiny_speculators.errors import UserError


def toy_stage(src: Path, /, out: Path, size: int = 8, mode: Literal["a", "b"] = "a", strict: bool = False,
              layers: list[int] | None = None, rate: float = 0.5) -> dict:
    """A toy stage.

    Args:
        out: where to write.
        size: how many
            things to make (100% of them).
    """
    return {"src": src, "out": out, "size": size, "mode": mode, "strict": strict, "layers": layers, "rate": rate}


@pytest.fixture
def toy(monkeypatch):
    """Register ``toy_stage`` as a CLI stage; returns the list of its calls' results."""
    calls = []

    @functools.wraps(toy_stage)  # the CLI reads toy_stage's signature and docstring through it
    def recording(*args, **kwargs):
        calls.append(toy_stage(*args, **kwargs))
    monkeypatch.setitem(cli.STAGES, "toy", ("x:y", "a toy"))
    monkeypatch.setattr(cli, "load_stage", lambda name: recording)
    return calls


def test_version_names_what_it_runs_with(capsys, tmp_path, monkeypatch):
    import torch
    import transformers

    monkeypatch.setenv("TINY_SPECULATORS_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"tiny-speculators {__version__}" in out
    assert f"torch {torch.__version__}" in out and f"transformers {transformers.__version__}" in out
    assert "vLLM environment: none in" in out and "scripts/vllm_env.sh" in out


def test_flags_and_yaml_bind_to_the_signature(toy, tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("out: o\nsize: 3\nlayers: [1, 2, 3]\nmode: b\n")
    args = ["toy", "in", "--config", str(config), "--size", "5", "--strict"]
    assert cli.main(args) == 0
    assert toy == [{"src": Path("in"), "out": Path("o"), "size": 5, "mode": "b", "strict": True,
                    "layers": [1, 2, 3], "rate": 0.5}]
    kwargs = bind(toy_stage, {**load_yaml(config), "src": "in", "rate": "0.25"})
    assert kwargs["rate"] == 0.25 and kwargs["size"] == 3 and kwargs["src"] == Path("in")


def test_bad_config_values_are_one_sentence(toy, tmp_path, capsys):
    with pytest.raises(UserError, match="unknown option.*colour"):
        bind(toy_stage, {"out": "o", "colour": 1})
    with pytest.raises(UserError, match="'size' must be an integer"):
        bind(toy_stage, {"src": "i", "out": "o", "size": "many"})
    with pytest.raises(UserError, match="must be one of a, b"):
        bind(toy_stage, {"src": "i", "out": "o", "mode": "c"})
    with pytest.raises(UserError, match="needs a value for 'out'"):
        bind(toy_stage, {"src": "i"})
    assert cli.main(["toy", "in", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_docstring_args_become_help():
    assert param_docs(toy_stage) == {"out": "where to write.", "size": "how many things to make (100% of them)."}


def test_help_with_percent_signs(toy, capsys):
    with pytest.raises(SystemExit):
        cli.main(["toy", "--help"])
    assert "100% of them" in capsys.readouterr().out


def test_every_stage_is_listed_and_unbuilt_ones_say_so(capsys, monkeypatch):
    assert set(cli.STAGES) >= {"prepare", "vocab", "extract", "train", "export", "evaluate", "pipeline"}
    monkeypatch.setitem(cli.STAGES, "future", ("tiny_speculators.not_yet_written:run", "later"))
    assert cli.main(["future", "--help"]) == 2
    assert "not built yet" in capsys.readouterr().err
