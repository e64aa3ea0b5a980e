"""MTP through the same loop on a tiny MiMo verifier: offline == online (the last pre-norm state is what both feed),
2-process DDP == one process, kill + resume == uninterrupted, it learns, a top-k extraction is refused, and the
train output exports as the stitched verifier checkpoint. On a tiny DeepSeek-V3 verifier, without a vocab stage:
online == offline, it learns, evaluates lossless with our proposer, and ``--init-from`` resumes from the train output
or its export.

    pytest -q tests/train/test_train_mtp.py
"""

from __future__ import annotations

import json

import pytest
from train_checks import ddp_equals_one, resume_equals_uninterrupted
from train_inputs import build_inputs, make_chats
from train_runs import train_args

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train

MTP = {"steps": 3}


@pytest.fixture(scope="module")
def mimo_inputs(tmp_path_factory, tiny_mimo_dir):
    return build_inputs(tmp_path_factory.mktemp("mtp-inputs"), tiny_mimo_dir, n_chats=8, vocab_size=256,
                        max_length=96)


def test_mtp_offline_and_online_agree_and_learn(mimo_inputs, tmp_path):
    off = train(**train_args(mimo_inputs, tmp_path / "off", max_steps=1, batch_size=2, algorithm="mtp", mtp=MTP))
    on = train(**train_args(mimo_inputs, tmp_path / "on", max_steps=1, batch_size=2, hidden_states=None,
                         data=mimo_inputs.prepared, online=True, algorithm="mtp", mtp=MTP))
    assert on["final_train"]["positions"] == off["final_train"]["positions"] > 0
    assert on["final_train"]["loss"] == pytest.approx(off["final_train"]["loss"], rel=1e-5)
    first = json.loads((tmp_path / "off" / "metrics.jsonl").read_text().splitlines()[0])
    long = train(**train_args(mimo_inputs, tmp_path / "long", max_steps=12, batch_size=4, lr=3e-3, algorithm="mtp",
                           mtp=MTP))
    assert long["final_train"]["loss"] < 0.8 * first["train/loss"]
    assert len(long["final_train"]["acc"]) == 3 and long["final_train"]["accept_len"] >= 1.0
    config = json.loads((tmp_path / "long" / "final" / "draft_config.json").read_text())
    assert config["model_type"] == "mtp" and config["kwargs"]["aux_layer_ids"] == [8]


def test_mtp_ddp_two_processes_equal_one(mimo_inputs, tmp_path):
    ddp_equals_one(mimo_inputs, tmp_path, "mtp", MTP)


def test_mtp_resume_equals_uninterrupted(mimo_inputs, tmp_path):
    resume_equals_uninterrupted(mimo_inputs, tmp_path, "mtp", MTP)


def test_mtp_refuses_topk_extraction_and_exports_stitched(mimo_inputs, tmp_path):
    from tiny_speculators.export.stage import export
    from tiny_speculators.verifier.extract import extract

    extract(verifier=str(mimo_inputs.verifier), data=mimo_inputs.prepared, out=tmp_path / "topk", dtype="float32",
            device="cpu", progress=False, layout="topk", topk=8)
    with pytest.raises(UserError, match="top-k extract layouts drop: extract with --layout full or fp8"):
        train(**train_args(mimo_inputs, tmp_path / "t", max_steps=1, batch_size=2, hidden_states=tmp_path / "topk",
                        algorithm="mtp", mtp=MTP))
    train(**train_args(mimo_inputs, tmp_path / "a", max_steps=1, batch_size=2, algorithm="mtp", mtp=MTP))
    summary = export(tmp_path / "a", out=tmp_path / "exported")
    assert summary["format"] == "verifier-mtp" and summary["speculative_tokens"] == 3
    assert '"method": "mtp"' in summary["serve"]


@pytest.fixture(scope="module")
def deepseek_inputs(tmp_path_factory, tiny_deepseek_dir):
    """Prepared chats and a full extraction (it stores the last pre-norm state) of the tiny DeepSeek-V3; no vocab."""
    from tiny_speculators.data.prepare import prepare
    from tiny_speculators.verifier.extract import extract

    root = tmp_path_factory.mktemp("mtp-deepseek")
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_chats(8, False)), encoding="utf-8")
    prepare(verifier=str(tiny_deepseek_dir), data=[root / "chats.jsonl"], out=root / "prepared", max_length=96)
    extract(verifier=str(tiny_deepseek_dir), data=root / "prepared", out=root / "hs", dtype="float32", device="cpu",
            progress=False, layers=[1])  # 2 layers: too shallow for the EAGLE-3 default; MTP reads the last state
    return root


def test_mtp_deepseek_learns_evaluates_lossless_and_resumes_from_its_export(deepseek_inputs, tiny_deepseek_dir,
                                                                            tmp_path):
    from tiny_speculators.evaluate.stage import evaluate
    from tiny_speculators.export.stage import export

    common = dict(verifier=str(tiny_deepseek_dir), hidden_states=deepseek_inputs / "hs", eval_fraction=0.0,
                  warmup_steps=0, progress=False, seed=3, save_every=0, batch_size=4, lr=3e-3, algorithm="mtp",
                  mtp={"steps": 2})
    online = {**common, "hidden_states": None, "data": deepseek_inputs / "prepared", "online": True}
    on = train(out=tmp_path / "on", max_steps=1, **online)  # the verifier's own last pre-norm state, live
    run = train(out=tmp_path / "run", max_steps=12, **common)  # no --vocab: MTP drafts over the whole vocabulary
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    assert on["final_train"]["loss"] == pytest.approx(first, rel=1e-5)  # online == offline
    assert run["final_train"]["loss"] < 0.6 * first
    config = json.loads((tmp_path / "run" / "final" / "draft_config.json").read_text())
    assert config["kwargs"]["layout"] == "deepseek_v3" and config["kwargs"]["aux_layer_ids"] == [2]
    summary = export(tmp_path / "run", out=tmp_path / "exported")
    assert summary["format"] == "verifier-mtp"
    result = evaluate(str(tiny_deepseek_dir), tmp_path / "exported", tmp_path / "eval", prompts="chat", k=2,
                      max_prompts=1, max_new_tokens=16)
    assert result["matches_baseline"] is True and result["draft_forwards_per_step"] == 2.0
    again = [train(out=tmp_path / name, max_steps=1, init_from=source, **common)["final_train"]["loss"]
             for name, source in (("from-run", tmp_path / "run"), ("from-export", tmp_path / "exported"))]
    assert again[0] == pytest.approx(again[1], rel=1e-6) and again[0] < 0.6 * first  # starts where the run ended
