"""The training recipe's options (loss, position weights, Muon, aux-state noise, frozen weights) through the real
loop: Muon takes the hidden matrices, a SIGTERM + resume run with all of them equals an uninterrupted one exactly (Muon
momentum and AdamW moments included), the noise is seeded, Muon runs under DDP and FSDP2, frozen weights stay put, and
the choices are recorded and validated."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from train_runs import ENV, assert_same, load_weights, one_thread, sigterm_when, train_args, train_cli

from tiny_speculators.cli import main
from tiny_speculators.errors import UserError
from tiny_speculators.train.loop import with_aux_noise, with_loss_positions
from tiny_speculators.train.schedule import OptimizerGroup, build_optimizer
from tiny_speculators.train.stage import train

RECIPE = dict(optimizer="muon", loss={"lk": 1.0, "ce": 0.1}, position_weights="dpace", aux_noise_std=0.05)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from tiny_speculators.models.eagle3.model import Eagle3Draft

    draft = Eagle3Draft(vocab_size=50, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        intermediate_size=32, draft_vocab_size=20)
    opt = build_optimizer(draft, lr=1e-3, weight_decay=0.0, kind="muon")
    assert isinstance(opt, OptimizerGroup)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in draft.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {"fc.weight", *(f"layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                       "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    assert "lm_head.weight" in in_adamw and "norm.weight" in in_adamw and not in_muon & in_adamw
    assert "embed_tokens.weight" not in in_muon | in_adamw  # frozen
    assert muon.defaults["momentum"] == 0.95 and muon.defaults["adjust_lr_fn"] == "match_rms_adamw"
    assert len(opt.param_groups) == len(muon.param_groups) + len(adamw.param_groups)


def test_resume_with_the_whole_recipe_equals_uninterrupted(tiny_inputs, tmp_path):
    out = tmp_path / "run"
    args = train_args(tiny_inputs, out, max_steps=4, batch_size=2, save_every=2, keep_last=0, **RECIPE)
    watcher = sigterm_when(out / "step_000002")
    with pytest.raises(KeyboardInterrupt):
        train(**args)
    watcher.join()
    train(**{**args, "resume": True})
    straight = tmp_path / "straight"
    summary = train(**train_args(tiny_inputs, straight, max_steps=4, batch_size=2, save_every=2, **RECIPE))
    assert_same(load_weights(out), load_weights(straight), atol=0)
    a = torch.load(out / "step_000004" / "optimizer.pt", weights_only=True)["optimizer"]["optimizers"]
    b = torch.load(straight / "step_000004" / "optimizer.pt", weights_only=True)["optimizer"]["optimizers"]
    assert any("momentum_buffer" in st for st in b[0]["state"].values())  # Muon's state is in the checkpoint
    for x, y in zip(a, b, strict=True):
        for i, st in y["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(x["state"][i][key], value, rtol=0, atol=0, msg=key)
    assert summary["recipe"] == {"loss": {"lk": 1.0, "ce": 0.1}, "position_weights": "dpace", "dpace_alpha": 0.5,
                                 "optimizer": "muon", "muon_momentum": 0.95, "muon_weight_decay": 0.1,
                                 "aux_noise_std": 0.05, "loss_positions": "answer", "freeze": None}
    meta = json.loads((straight / "step_000004" / "meta.json").read_text())
    assert meta["args"]["optimizer"] == "muon" and meta["args"]["loss"] == {"lk": 1.0, "ce": 0.1}
    # resuming with another optimizer is refused, not silently mixed
    with pytest.raises(UserError, match="trained with --optimizer muon"):
        train(**{**args, "optimizer": "adamw", "resume": True, "max_steps": 6})


def test_aux_noise_is_seeded_and_only_in_training(tiny_inputs, tmp_path):
    batch = {"aux_hidden_states": torch.zeros(1, 4, 6, dtype=torch.bfloat16), "input_ids": torch.zeros(1, 4)}
    assert with_aux_noise(batch, 0.0) is batch
    torch.manual_seed(0)
    noisy = with_aux_noise(batch, 0.5)["aux_hidden_states"]
    assert noisy.dtype == torch.bfloat16 and 0.2 < noisy.float().std() < 0.9
    assert torch.equal(batch["aux_hidden_states"], torch.zeros(1, 4, 6, dtype=torch.bfloat16))  # not in place
    runs = {}
    for name, std in (("a", 0.05), ("b", 0.05), ("clean", 0.0)):
        runs[name] = train(**train_args(tiny_inputs, tmp_path / name, max_steps=2, batch_size=2, aux_noise_std=std,
                                     eval_fraction=0.25))
    assert_same(load_weights(tmp_path / "a"), load_weights(tmp_path / "b"), atol=0)
    assert runs["a"]["final_train"]["loss"] != runs["clean"]["final_train"]["loss"]


def test_all_loss_positions_supervise_every_real_token_in_training_only(tiny_inputs, tmp_path):
    padded = {"loss_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    assert with_loss_positions(padded, "answer") is padded
    assert with_loss_positions(padded, "all")["loss_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert padded["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]  # not in place
    runs = {name: train(**train_args(tiny_inputs, tmp_path / name, max_steps=1, batch_size=2, eval_fraction=0.25,
                                  loss_positions=name))
            for name in ("answer", "all")}
    # the same first batch, more of its positions supervised (the chat template and the user's turns) ...
    assert runs["all"]["final_train"]["positions"] > runs["answer"]["final_train"]["positions"]
    # ... while validation still counts the answers only
    assert runs["all"]["final_val"]["positions"] == runs["answer"]["final_val"]["positions"]
    assert runs["all"]["recipe"]["loss_positions"] == "all"


def test_frozen_parameters_keep_their_values_and_the_rest_trains(tiny_inputs, tmp_path):
    out = tmp_path / "frozen"
    summary = train(**train_args(tiny_inputs, out, max_steps=2, batch_size=2, save_every=1, keep_last=0,
                              freeze=["lm_head", "layers.0.mlp"]))
    first, second = load_weights(out, "step_000001"), load_weights(out, "step_000002")
    frozen = {k for k in first if k.startswith(("lm_head.", "layers.0.mlp."))}
    assert len(frozen) == 4  # lm_head + gate, up, down
    for k in first:
        assert torch.equal(first[k], second[k]) == (k in frozen or k.startswith(("embed_tokens.", "d2t", "t2d"))), k
    assert summary["recipe"]["freeze"] == ["lm_head", "layers.0.mlp"]
    args = train_args(tiny_inputs, out, max_steps=3, batch_size=2, save_every=1, keep_last=0, resume=True)
    with pytest.raises(UserError, match=r"trained with --freeze lm_head layers.0.mlp; resume with the same"):
        train(**args)  # the optimizer holds the trained parameters only: another set cannot resume it
    with pytest.raises(UserError, match=r"--freeze layers.0.mpl: the draft has no parameter of that name \(trainable"):
        train(**train_args(tiny_inputs, tmp_path / "typo", max_steps=1, batch_size=2, freeze=["layers.0.mpl"]))


def test_muon_under_ddp_and_fsdp2_matches_one_process_to_bf16(tiny_inputs, tmp_path):
    """torch.optim.Muon's Newton-Schulz runs in bf16 (FSDP2: on the sharded DTensors, as the full matrices), so the
    parallel runs agree with one process only to bf16 rounding, not exactly."""
    with one_thread():
        train(**train_args(tiny_inputs, tmp_path / "one", max_steps=1, batch_size=2, optimizer="muon"))
    one = load_weights(tmp_path / "one")
    for mode in ("--no-fsdp", "--fsdp"):
        subprocess.run(train_cli(tiny_inputs, tmp_path / mode, "--max-steps", "1", "--batch-size", "1", mode,
                            "--optimizer", "muon", "--save-every", "1", torchrun=2),
                       check=True, env=ENV, capture_output=True, timeout=300)
        assert_same(one, load_weights(tmp_path / mode), atol=1e-2)
        state = torch.load(tmp_path / mode / "step_000001" / "optimizer.pt", weights_only=True)["optimizer"]
        assert state, mode


def test_recipe_flags_and_bad_values_are_one_line_errors(tmp_path, capsys):
    base = ["train", "--verifier", "v", "--vocab", str(tmp_path), "--out", str(tmp_path / "o"),
            "--hidden-states", str(tmp_path / "missing")]
    for extra, message in ((["--loss", "hinge=1"], "unknown loss hinge"), (["--loss", "kl"], "name=value pairs"),
                           (["--loss", "kl=x"], "loss'.kl must be a number"),
                           (["--aux-noise-std", "-1"], "aux_noise_std must be at least 0"),
                           (["--loss", "ce=0.1", "tv=0.9", "--dpace-alpha", "3"], "dpace_alpha must be in")):
        code = main([*base, *extra])
        err = capsys.readouterr().err.strip()
        assert code == 1 and len(err.splitlines()) == 1 and message in err, (extra, err)
