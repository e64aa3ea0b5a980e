"""DFlash through the same loop: 2-process DDP == one process, kill + resume == uninterrupted (random anchors
on: their RNG is checkpointed), offline == online on the same aux layers, --init-from its speculators export,
and the summary's per-slot metrics."""

from __future__ import annotations

import json

import pytest
from train_checks import ddp_equals_one, offline_equals_online, resume_equals_uninterrupted
from train_runs import assert_same, load_weights, train_args

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train

SMALL = {"block_size": 4, "num_layers": 2}


def test_dflash_ddp_two_processes_equal_one(tiny_inputs, tmp_path):
    # anchors above any sample's candidates: every anchor is used, so both runs see the same blocks
    single = ddp_equals_one(tiny_inputs, tmp_path, "dflash", {**SMALL, "anchors": 1000})
    assert len(single["final_train"]["acc"]) == 3 and single["final_train"]["accept_len"] >= 1.0


def test_dflash_resume_equals_uninterrupted(tiny_inputs, tmp_path):
    resume_equals_uninterrupted(tiny_inputs, tmp_path, "dflash", {**SMALL, "anchors": 3, "loss_weighting": "dpace"})


def test_dflash_offline_and_online_agree(tiny_inputs, tmp_path):
    aux = json.loads((tiny_inputs.hidden_states / "manifest.json").read_text())["aux_layer_ids"]
    offline_equals_online(tiny_inputs, tmp_path, "dflash", {**SMALL, "anchors": 1000}, aux_layer_ids=aux)


def test_dflash_init_from_its_export_and_family_mismatch(tiny_inputs, tmp_path):
    from tiny_speculators.export.stage import export

    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=3, batch_size=2, algorithm="dflash", dflash=SMALL))
    summary = export(tmp_path / "a", out=tmp_path / "exported")
    assert summary["algorithm"] == "dflash" and summary["speculative_tokens"] == 3
    assert summary["vllm_speculative_config"]["method"] == "dflash"
    cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2 and cfg["sliding_window_non_causal"] is True
    train(**train_args(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, lr=0.0, algorithm="dflash",
                    dflash=SMALL, init_from=tmp_path / "exported"))
    assert_same(load_weights(tmp_path / "b"), load_weights(tmp_path / "a"), atol=0)
    with pytest.raises(UserError, match="is a dflash draft, this run trains eagle3"):
        train(**train_args(tiny_inputs, tmp_path / "c", max_steps=1, batch_size=2, init_from=tmp_path / "exported"))
    with pytest.raises(UserError, match="DFlash trains with --attention sdpa"):
        train(**train_args(tiny_inputs, tmp_path / "d", max_steps=1, algorithm="dflash", attention="flex"))
