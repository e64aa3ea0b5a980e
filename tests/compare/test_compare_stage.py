"""The compare stage: drafts evaluated here or read from evaluate outputs, the verdict as the exit code, the
per-category split, the report files, and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tiny_speculators.cli import main
from tiny_speculators.compare.stage import compare
from tiny_speculators.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
from eval_helpers import save_random_checkpoint


@pytest.fixture(scope="module")
def random_checkpoint(tiny_llama_dir, tmp_path_factory):
    return save_random_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("random-draft"))


def test_a_draft_against_itself_is_not_better_and_the_gate_exits_3(tiny_llama_dir, random_checkpoint, tmp_path,
                                                                    capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--drafts", str(random_checkpoint), str(random_checkpoint), "--verifier", str(tiny_llama_dir),
            "--out", str(out), "--max-prompts", "3", "--max-new-tokens", "8", "--k", "2", "--resamples", "500"]
    assert main(args) == 0  # no --require: the numbers only
    summary = json.loads((out / "summary.json").read_text())
    name = random_checkpoint.name  # random-draftN: N counts the worker's earlier folders of that name
    assert summary["prompts"] == 3 and summary["passed"] is None and summary["names"] == [f"0:{name}", f"1:{name}"]
    (diff,) = summary["differences"]
    assert diff["tau_difference"] == 0 and diff["interval"] == [0.0, 0.0] and not diff["better"]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out / "drafts").iterdir()) == [f"0-{name}", f"1-{name}"]
    # the evaluations just written are read back, not rerun; the gate decides the exit code
    evaluated = sorted((out / "drafts").iterdir())
    capsys.readouterr()
    gate = ["compare", "--drafts", *map(str, evaluated), "--out", str(tmp_path / "gate"), "--resamples", "500"]
    assert main([*gate, "--require", "better"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tiny-speculators compare: error: 1-{name} not better than 0-{name} at 95%")
    assert "\n" not in err and (tmp_path / "gate" / "compare.json").is_file()  # the numbers are written
    assert main([*gate, "--require", "not-worse", "--margin", "0.01"]) == 0


def _evaluated(folder: Path, accepted: dict[str, int], drafts: int = 20, k: int = 3) -> Path:
    """An evaluate output folder with these per-prompt counts (what compare reads from evaluate's results.json)."""
    rows = []
    for prompt_id, a in accepted.items():
        per_pos = [max(0, min(drafts, a - i * drafts)) for i in range(k)]
        rows.append({"id": prompt_id, "num_drafts": drafts, "num_accepted_tokens": a,
                     "num_accepted_tokens_per_pos": per_pos})
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"verifier_id": "v", "k": k, "per_prompt": rows}))
    return folder


def test_a_better_draft_passes_the_gate_overall_and_per_category(tmp_path):
    ids = [f"{c}-{i:02d}" for c in ("chat", "code", "math") for i in range(8)]
    a = _evaluated(tmp_path / "a", {p: 4 + (i * 5) % 11 for i, p in enumerate(ids)})
    b = _evaluated(tmp_path / "b", {p: 10 + (i * 5) % 11 for i, p in enumerate(ids)})
    summary = compare([a, b], tmp_path / "out", resamples=1000, require="better", margin=0.1)
    assert summary["passed"] is True and summary["differences"][0]["better"]
    assert summary["differences"][0]["tau_difference"] == pytest.approx(6 / 20)
    per_category = json.loads((tmp_path / "out" / "compare.json").read_text())["per_category"]
    assert sorted(per_category) == ["chat", "code", "math"]
    assert all(c["prompts"] == 8 and c["differences"][0]["tau_difference"] == pytest.approx(6 / 20)
               for c in per_category.values())


def test_bad_input_is_one_line(tmp_path, random_checkpoint):
    a = _evaluated(tmp_path / "a", {"chat-00": 3, "chat-01": 4})
    other = _evaluated(tmp_path / "other", {"chat-00": 3, "code-00": 4})
    with pytest.raises(UserError, match="at least two drafts"):
        compare([a], tmp_path / "out")
    with pytest.raises(UserError, match="evaluated on other prompts than"):
        compare([a, other], tmp_path / "out")
    with pytest.raises(UserError, match="--verifier is needed to evaluate it"):
        compare([a, random_checkpoint], tmp_path / "out")
    with pytest.raises(UserError, match="does not exist"):
        compare([a, tmp_path / "nope"], tmp_path / "out", verifier="v")
    with pytest.raises(UserError, match="confidence must be in"):
        compare([a, a], tmp_path / "out", confidence=1.0)
