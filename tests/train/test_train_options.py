"""Train options: the stage's signature and TrainOptions agree, and family sections are validated with one-line
errors that name the bad key, from YAML, Python and the command line alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tiny_speculators.cli import main
from tiny_speculators.config import bind, stage_params
from tiny_speculators.errors import UserError
from tiny_speculators.models import FAMILIES
from tiny_speculators.train.options import TrainOptions
from tiny_speculators.train.stage import train

WIRED = {"verifier": "v", "vocab": Path("v"), "out": Path("o"), "hidden_states": Path("h")}


def test_signature_and_options_agree():
    fields = {f.name for f in dataclasses.fields(TrainOptions)} - {"family"}
    assert set(stage_params(train)) == fields
    assert set(train.option_sections) == set(FAMILIES)


def test_family_section_binds_to_its_dataclass():
    kwargs = bind(train, {**WIRED, "algorithm": "eagle3", "eagle3": {"ttt_steps": 5, "decay": 0.5}})
    assert kwargs["eagle3"] == FAMILIES["eagle3"].options(ttt_steps=5, decay=0.5)


@pytest.mark.parametrize(("section", "match"), [
    ({"eagle3": {"ttt_stepz": 3}}, r"option 'eagle3': unknown option\(s\) ttt_stepz"),
    ({"eagle3": {"ttt_steps": "three"}}, r"option 'eagle3'\.ttt_steps must be an integer"),
    ({"eagle3": {"ttt_steps": 0}}, r"option 'eagle3': ttt_steps must be at least 1"),
    ({"eagle3": [3]}, r"option 'eagle3' must be a mapping"),
    ({"algorithm": "dflash", "dflash": {"gamma": 5.0}}, r"option 'dflash': gamma acts only with loss_weighting exp"),
    ({"algorithm": "medusa"}, r"option 'algorithm' must be one of"),
    ({"no_such_family": {}}, r"unknown option\(s\) no_such_family"),
])
def test_bad_family_options_name_the_key(section, match):
    with pytest.raises(UserError, match=match):
        bind(train, {**WIRED, **section}, source="cfg.yaml [train]")


def test_cli_family_flags_reach_the_section(tmp_path, capsys):
    code = main(["train", "--verifier", "v", "--vocab", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--hidden-states", str(tmp_path / "missing"), "--eagle3-ttt-steps", "zero"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "eagle3'.ttt_steps must be an integer" in err


def test_vocab_is_required_only_by_families_with_their_own_vocabulary(tmp_path):
    """``--vocab`` is the vocab stage's draft vocabulary; a family drafting over the verifier's whole vocabulary
    (``uses_verifier_vocab``) needs none, every other family gets a one-line error naming the option."""
    own = sorted(name for name, family in FAMILIES.items() if not family.uses_verifier_vocab)
    assert own and len(own) < len(FAMILIES)
    with pytest.raises(UserError, match=rf"--vocab is required for {own[0]}"):
        train(verifier="v", out=tmp_path / "o", hidden_states=tmp_path / "h", algorithm=own[0])


def test_options_take_types_and_defaults_from_the_signature():
    """TrainOptions' fields are read from ``train``'s signature: the same annotations and defaults, no drift."""
    fields = {f.name: f for f in dataclasses.fields(TrainOptions)}
    for name, (p, annotation) in stage_params(train).items():
        assert fields[name].type == annotation, name
        if p.default is not p.empty:
            assert fields[name].default == p.default, name
