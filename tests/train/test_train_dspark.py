"""DSpark through the same loop: 2-process DDP == one process, kill + resume == uninterrupted (random anchors: their
RNG is checkpointed), offline == online on the same aux layers, warm start (--init-from) from a trained DFlash draft
(its checkpoint or its speculators export: its weights load, the heads start fresh), export in the speculators DSpark
layout and --init-from that export, and the summary's per-prediction metrics."""

from __future__ import annotations

import json

import pytest
from train_checks import ddp_equals_one, offline_equals_online, resume_equals_uninterrupted
from train_runs import assert_same, load_weights, train_args

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train

SMALL = {"block_size": 4, "num_layers": 2, "markov_rank": 16}
HEADS = ("markov_head.", "confidence_head.")


def test_dspark_ddp_two_processes_equal_one(tiny_inputs, tmp_path):
    # anchors above any sample's candidates: every anchor is used, so both runs see the same blocks
    final = ddp_equals_one(tiny_inputs, tmp_path, "dspark", {**SMALL, "anchors": 1000})["final_train"]
    assert len(final["acc"]) == 4 and len(final["accept_rate"]) == 4 and final["accept_len"] >= 1.0
    assert final["confidence_bce"] > 0 and 1.0 <= final["expected_accept_len"] <= 5.0


def test_dspark_resume_equals_uninterrupted(tiny_inputs, tmp_path):
    resume_equals_uninterrupted(tiny_inputs, tmp_path, "dspark", {**SMALL, "anchors": 3, "markov_head": "gated"})


def test_dspark_offline_and_online_agree(tiny_inputs, tmp_path):
    aux = json.loads((tiny_inputs.hidden_states / "manifest.json").read_text())["aux_layer_ids"]
    offline_equals_online(tiny_inputs, tmp_path, "dspark", {**SMALL, "anchors": 1000}, aux_layer_ids=aux)


def test_dspark_warm_starts_from_a_trained_dflash_draft(tiny_inputs, tmp_path):
    from tiny_speculators.export.stage import export

    train(**train_args(tiny_inputs, tmp_path / "dflash", max_steps=3, batch_size=2, algorithm="dflash",
                    dflash={"block_size": 4, "num_layers": 2}))
    export(tmp_path / "dflash", out=tmp_path / "dflash-export")
    dflash = load_weights(tmp_path / "dflash")
    for source in (tmp_path / "dflash", tmp_path / "dflash-export"):  # our checkpoint, its speculators export
        out = tmp_path / f"warm-{source.name}"
        train(**train_args(tiny_inputs, out, max_steps=1, batch_size=2, lr=0.0, algorithm="dspark", dspark=SMALL,
                        init_from=source))
        warm = load_weights(out)
        assert {k for k in warm if not k.startswith(HEADS)} == set(dflash)
        assert_same({k: v for k, v in warm.items() if k in dflash}, dflash, atol=0)
        assert not warm["markov_head.markov_w2.weight"].any() and warm["markov_head.markov_w1.weight"].std() > 0
    # online too, with this run's block size (the backbone does not depend on it)
    aux = json.loads((tiny_inputs.hidden_states / "manifest.json").read_text())["aux_layer_ids"]
    summary = train(**train_args(tiny_inputs, tmp_path / "online", max_steps=2, batch_size=2, hidden_states=None,
                              data=tiny_inputs.prepared, online=True, aux_layer_ids=aux, algorithm="dspark",
                              dspark={**SMALL, "block_size": 6}, init_from=tmp_path / "dflash"))
    assert len(summary["final_train"]["acc"]) == 6
    with pytest.raises(UserError, match="is a dflash draft, this run trains mtp"):
        train(**train_args(tiny_inputs, tmp_path / "c", max_steps=1, batch_size=2, algorithm="mtp",
                        init_from=tmp_path / "dflash"))


def test_dspark_export_and_init_from_its_export(tiny_inputs, tmp_path):
    from tiny_speculators.export.stage import export

    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=3, batch_size=2, algorithm="dspark", dspark=SMALL))
    summary = export(tmp_path / "a", out=tmp_path / "exported")
    assert summary["algorithm"] == "dspark" and summary["speculative_tokens"] == 4  # sample_from_anchor: L tokens
    assert summary["vllm_speculative_config"] is None  # vLLM serves DSpark on GPU only; not offered here
    cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    assert (cfg["block_size"], cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"]) == \
        (4, 16, "vanilla", True)
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    train(**train_args(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, lr=0.0, algorithm="dspark",
                    dspark=SMALL, init_from=tmp_path / "exported"))
    assert_same(load_weights(tmp_path / "b"), load_weights(tmp_path / "a"), atol=0)
    with pytest.raises(UserError, match="DSpark trains with --attention sdpa"):
        train(**train_args(tiny_inputs, tmp_path / "d", max_steps=1, algorithm="dspark", attention="flex"))
