"""DFlash through the same loop: 2-process DDP == one process, kill + resume == uninterrupted (random anchors
on: their RNG is checkpointed), offline == online on the same aux layers, --init-from its speculators export,
and the summary's per-slot metrics."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_train_invariants import ENV, _assert_same, _cli, _common, _sigterm_when, _weights, one_thread

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train

SMALL = {"block_size": 4, "num_layers": 2}


def test_dflash_ddp_two_processes_equal_one(tiny_inputs, tmp_path):
    # anchors above any sample's candidates: every anchor is used, so both runs see the same blocks
    with one_thread():
        single = train(**_common(tiny_inputs, tmp_path / "one", max_steps=2, batch_size=2, algorithm="dflash",
                                 dflash={**SMALL, "anchors": 1000}))
    subprocess.run(_cli(tiny_inputs, tmp_path / "ddp", "--max-steps", "2", "--batch-size", "1", "--algorithm", "dflash",
                        "--dflash-block-size", "4", "--dflash-num-layers", "2", "--dflash-anchors", "1000",
                        torchrun=2), check=True, env=ENV, capture_output=True, timeout=300)
    _assert_same(_weights(tmp_path / "one"), _weights(tmp_path / "ddp"), atol=1e-5)
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["algorithm"] == "dflash" and ddp["world_size"] == 2
    assert ddp["final_train"]["loss"] == pytest.approx(single["final_train"]["loss"], rel=1e-5)
    assert len(single["final_train"]["acc"]) == 3 and single["final_train"]["accept_len"] >= 1.0


def test_dflash_resume_equals_uninterrupted(tiny_inputs, tmp_path):
    opts = {**SMALL, "anchors": 3, "loss_weighting": "dpace"}
    args = _common(tiny_inputs, tmp_path / "run", max_steps=4, batch_size=2, save_every=2, algorithm="dflash",
                   dflash=opts)
    watcher = _sigterm_when(tmp_path / "run" / "step_000002")
    with pytest.raises(KeyboardInterrupt):
        train(**args)
    watcher.join()
    assert not (tmp_path / "run" / "final").exists()
    train(**{**args, "resume": True})
    train(**_common(tiny_inputs, tmp_path / "straight", max_steps=4, batch_size=2, save_every=2, algorithm="dflash",
                    dflash=opts))
    _assert_same(_weights(tmp_path / "run"), _weights(tmp_path / "straight"))


def test_dflash_offline_and_online_agree(tiny_inputs, tmp_path):
    aux = json.loads((tiny_inputs.hidden_states / "manifest.json").read_text())["aux_layer_ids"]
    opts = {**SMALL, "anchors": 1000}
    off = train(**_common(tiny_inputs, tmp_path / "off", max_steps=1, batch_size=2, algorithm="dflash", dflash=opts))
    on = train(**_common(tiny_inputs, tmp_path / "on", max_steps=1, batch_size=2, hidden_states=None,
                         data=tiny_inputs.prepared, online=True, aux_layer_ids=aux, algorithm="dflash", dflash=opts))
    assert on["final_train"]["positions"] == off["final_train"]["positions"] > 0
    assert on["final_train"]["loss"] == pytest.approx(off["final_train"]["loss"], rel=1e-4)


def test_dflash_init_from_its_export_and_family_mismatch(tiny_inputs, tmp_path):
    from tiny_speculators.export.stage import export

    train(**_common(tiny_inputs, tmp_path / "a", max_steps=3, batch_size=2, algorithm="dflash", dflash=SMALL))
    summary = export(tmp_path / "a", out=tmp_path / "exported")
    assert summary["algorithm"] == "dflash" and summary["speculative_tokens"] == 3
    assert summary["vllm_speculative_config"]["method"] == "dflash"
    cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2 and cfg["sliding_window_non_causal"] is True
    train(**_common(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, lr=0.0, algorithm="dflash",
                    dflash=SMALL, init_from=tmp_path / "exported"))
    _assert_same(_weights(tmp_path / "b"), _weights(tmp_path / "a"), atol=0)
    with pytest.raises(UserError, match="is a dflash draft, this run trains eagle3"):
        train(**_common(tiny_inputs, tmp_path / "c", max_steps=1, batch_size=2, init_from=tmp_path / "exported"))
    with pytest.raises(UserError, match="DFlash trains with --attention sdpa"):
        train(**_common(tiny_inputs, tmp_path / "d", max_steps=1, algorithm="dflash", attention="flex"))
