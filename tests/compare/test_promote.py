"""The promote stage: the first draft is installed, the same one is a no-op, a new one replaces the current one only
when the gate says so, the pointers move atomically and keep the replaced draft as previous, and bad deploy folders
are one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tiny_speculators.cli import main
from tiny_speculators.compare.promote import promote
from tiny_speculators.errors import UserError
from tiny_speculators.export.stage import export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
from eval_helpers import save_random_checkpoint

FAST = {"max_prompts": 3, "max_new_tokens": 8, "k": 2, "resamples": 300}


@pytest.fixture(scope="module")
def exported(tiny_llama_dir, tmp_path_factory):
    """Two exported random drafts of the tiny verifier (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("promote-drafts")
    out = []
    for seed in (0, 1):
        ckpt = save_random_checkpoint(tiny_llama_dir, root / f"ckpt{seed}", seed=seed)
        export(ckpt, out=root / f"export{seed}", verifier_name=str(tiny_llama_dir), speculative_tokens=2)
        out.append(root / f"export{seed}")
    return out


def test_first_same_and_gated_promotions(exported, tiny_llama_dir, tmp_path):
    a, b = exported
    deploy = tmp_path / "deploy"
    first = promote(a, tmp_path / "p1", deploy, verifier=str(tiny_llama_dir), **FAST)
    assert first["promoted"] and first["reason"] == "there was no current draft" and first["previous"] is None
    current = deploy / "current"
    assert current.is_symlink() and not os.path.isabs(os.readlink(current))  # relative: the folder can move
    assert (current / "config.json").read_bytes() == (a / "config.json").read_bytes()
    assert not (deploy / "previous").exists()

    same = promote(a, tmp_path / "p2", deploy, verifier=str(tiny_llama_dir), **FAST)
    assert not same["promoted"] and "current one already" in same["reason"]

    # two random drafts: neither is better than the other, so 'better' keeps the current one ...
    kept = promote(b, tmp_path / "p3", deploy, verifier=str(tiny_llama_dir), require="better", **FAST)
    assert not kept["promoted"] and kept["reason"].startswith("not better than the current draft (margin 0.0): τ ")
    assert json.loads((tmp_path / "p3" / "summary.json").read_text())["promoted"] is False
    assert current.resolve().name == first["release"].rsplit("/", 1)[1]
    # ... and 'not worse within 0.5' replaces it, keeping it as previous
    replaced = promote(b, tmp_path / "p4", deploy, verifier=str(tiny_llama_dir), require="not-worse", margin=0.5,
                       **FAST)
    assert replaced["promoted"] and replaced["reason"].startswith("not worse than the current draft: τ ")
    assert (current / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (deploy / "previous" / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()
    assert len([p for p in (deploy / "releases").iterdir()]) == 2
    assert replaced["previous"] == str((deploy / "previous").resolve()) != replaced["release"]
    assert replaced["tau_new"] == pytest.approx(replaced["difference"]["tau_difference"] + replaced["tau_current"])
    # the release records the τ it was validated at, which `monitor --draft DEPLOY/current` compares served τ with
    validated = json.loads((current / "summary.json").read_text())["validated"]
    assert validated["acceptance_length"] == replaced["tau_new"] and validated["num_prompts"] == 3
    assert kept["current_evaluation"] == replaced["current_evaluation"] == "decoded"  # the first release has none
    # the installed draft keeps its decoding: the next gate with the same settings decodes only the new draft, and
    # counts the current one as it was counted (the bytes of the release's draft files are unchanged by it)
    again = promote(a, tmp_path / "p5", deploy, verifier=str(tiny_llama_dir), require="better", **FAST)
    assert again["current_evaluation"] == "reused" and again["tau_current"] == replaced["tau_new"]
    assert not (tmp_path / "p5" / "compare" / "drafts" / "current").exists()
    other = promote(a, tmp_path / "p6", deploy, verifier=str(tiny_llama_dir), require="better",
                    **{**FAST, "max_new_tokens": 6})
    assert other["current_evaluation"] == "decoded"


def test_a_folder_put_there_by_hand_becomes_a_release(exported, tmp_path, tiny_llama_dir):
    a, _ = exported
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    import shutil

    shutil.copytree(a, deploy / "current")
    result = promote(a, tmp_path / "p", deploy, verifier=str(tiny_llama_dir), **FAST)
    assert not result["promoted"] and (deploy / "current").is_symlink()
    assert (deploy / "current").resolve().parent == (deploy / "releases").resolve()


def test_bad_inputs_are_one_line(exported, tmp_path, tiny_llama_dir, capsys):
    a, _ = exported
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "current").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match="which does not exist: repoint or remove it"):
        promote(a, tmp_path / "p", deploy, verifier=str(tiny_llama_dir))
    with pytest.raises(UserError, match="is not an exported draft"):
        promote(tmp_path, tmp_path / "p", tmp_path / "d2")
    assert main(["promote", "--draft", str(tmp_path), "--out", str(tmp_path / "p"), "--deploy",
                 str(tmp_path / "d3")]) == 1
    assert "is not an exported draft (no config.json)" in capsys.readouterr().err
