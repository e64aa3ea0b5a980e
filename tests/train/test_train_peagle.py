"""P-EAGLE through the same loop: 2-process DDP == one process, kill + resume == uninterrupted (COD sampling
on: its RNG is checkpointed), offline == online, --init-from its speculators export, wrong-family errors."""

from __future__ import annotations

import json

import pytest
import torch
from train_checks import ddp_equals_one, offline_equals_online, resume_equals_uninterrupted
from train_runs import assert_same, load_weights, train_args

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train

SMALL = {"depths": 3, "num_layers": 2}


def test_peagle_ddp_two_processes_equal_one(tiny_inputs, tmp_path):
    # ratio 1: every anchor at every depth, so both runs see the same elements (sampling is per process); two layers
    # and lr 1e-2 (AdamW) amplify fp32 summation-order noise: measured max difference 3e-6 on Intel hosts, 1.6e-5 on
    # an AMD EPYC host (one element of 8192: Adam dividing by a near-zero gradient's rounding; the rest <= 4e-6)
    ddp_equals_one(tiny_inputs, tmp_path, "peagle", {**SMALL, "ratio": 1.0, "ratio_min": 1.0}, atol=5e-5)


def test_peagle_resume_equals_uninterrupted(tiny_inputs, tmp_path):
    resume_equals_uninterrupted(tiny_inputs, tmp_path, "peagle", SMALL)


def test_peagle_offline_and_online_agree(tiny_inputs, tmp_path):
    offline_equals_online(tiny_inputs, tmp_path, "peagle", SMALL)


def test_peagle_init_from_its_export_and_family_mismatch(tiny_inputs, tmp_path):
    from tiny_speculators.export.stage import export

    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=3, batch_size=2, algorithm="peagle", peagle=SMALL))
    summary = export(tmp_path / "a", out=tmp_path / "exported")
    assert summary["algorithm"] == "peagle" and summary["speculative_tokens"] == 3
    assert summary["vllm_speculative_config"]["parallel_drafting"] is True
    cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    train(**train_args(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, lr=0.0, algorithm="peagle",
                    peagle=SMALL, init_from=tmp_path / "exported"))
    assert_same(load_weights(tmp_path / "b"), load_weights(tmp_path / "a"), atol=0)
    with pytest.raises(UserError, match="so peagle.train_embeddings True would have no effect"):
        train(**train_args(tiny_inputs, tmp_path / "e", max_steps=1, batch_size=2, algorithm="peagle",
                           peagle={**SMALL, "train_embeddings": True}, init_from=tmp_path / "exported"))
    with pytest.raises(UserError, match="is a peagle draft, this run trains eagle3"):
        train(**train_args(tiny_inputs, tmp_path / "c", max_steps=1, batch_size=2, init_from=tmp_path / "exported"))
    with pytest.raises(UserError, match="options for peagle given, but the algorithm is 'eagle3'"):
        train(**train_args(tiny_inputs, tmp_path / "d", max_steps=1, peagle=SMALL))


def test_peagle_trained_embeddings_are_trained_exported_and_read_back(tiny_inputs, tmp_path):
    """``train_embeddings`` (speculators' P-EAGLE default): the embeddings move, the mask token's row among them
    (frozen they stay the verifier's), the export carries them (vLLM then reads the draft's own instead of sharing
    the verifier's) and importing the export gives them back."""
    from safetensors.torch import load_file

    from tiny_speculators.export.stage import export
    from tiny_speculators.models.importing import import_draft

    for name, trained in (("frozen", False), ("trained", True)):
        train(**train_args(tiny_inputs, tmp_path / name, max_steps=2, batch_size=2, algorithm="peagle",
                           peagle={**SMALL, "train_embeddings": trained}))
    frozen, trained = (load_weights(tmp_path / name)["embed_tokens.weight"] for name in ("frozen", "trained"))
    draft, config = import_draft(tmp_path / "trained")
    mask = config["kwargs"]["mask_token_id"]
    assert not torch.equal(frozen[mask], trained[mask]) and torch.equal(draft.embed_tokens.weight, trained)
    export(tmp_path / "trained", out=tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["embed_requires_grad"] is True
    assert torch.equal(load_file(str(tmp_path / "exported" / "model.safetensors"))["embed_tokens.weight"], trained)
    assert torch.equal(import_draft(tmp_path / "exported")[0].embed_tokens.weight, trained)
