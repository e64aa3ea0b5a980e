"""Invariance tests of the training loop (fp32, CPU): grad accumulation, 2-process DDP / FSDP2 (gloo),
kill -9 + resume, SIGTERM checkpointing, offline == online, NaN stop."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_runs import ENV, assert_same, load_weights, one_thread, sigterm_when, train_args, train_cli

from tiny_speculators.errors import UserError
from tiny_speculators.train.stage import train


def test_grad_accum_equals_bigger_batch(tiny_inputs, tmp_path):
    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=2, batch_size=1, grad_accum=2))
    train(**train_args(tiny_inputs, tmp_path / "b", max_steps=2, batch_size=2, grad_accum=1))
    assert_same(load_weights(tmp_path / "a"), load_weights(tmp_path / "b"))
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 1e-3 for r in rows)  # not vacuous: both steps moved the weights (lr 1e-2, AdamW)


def test_ddp_two_processes_equal_one(tiny_inputs, tmp_path):
    with one_thread():
        single = train(**train_args(tiny_inputs, tmp_path / "one", max_steps=2, batch_size=2))
    subprocess.run(train_cli(tiny_inputs, tmp_path / "ddp", "--max-steps", "2", "--batch-size", "1", torchrun=2),
                   check=True, env=ENV, capture_output=True, timeout=300)
    assert_same(load_weights(tmp_path / "one"), load_weights(tmp_path / "ddp"))
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2
    assert ddp["final_train"]["loss"] == pytest.approx(single["final_train"]["loss"], rel=1e-5)
    assert ddp["tokens_seen"] == single["tokens_seen"]


def _two_node_agents(cmd: list[str], port: int, logs: Path) -> list[tuple[int | None, str]]:
    """Two torchrun agents, one process each, meeting through c10d rendezvous on 127.0.0.1 as two nodes do: each
    agent's exit code (None: killed after 300 s, or left waiting for an agent that failed) and what it printed."""
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"]
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    logs.mkdir()
    agents = []
    for i in range(2):
        with (logs / f"agent{i}.log").open("w") as log:
            agents.append(subprocess.Popen([*launcher, *rdzv, *cmd[len(launcher) + 1:]], env=ENV,
                                           stdout=subprocess.DEVNULL, stderr=log))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and any(a.poll() is None for a in agents):
        if any(a.returncode not in (None, 0) for a in agents):
            break
        time.sleep(0.2)
    for a in agents:
        if a.poll() is None:
            a.kill()
            a.wait()
    return [(a.returncode if a.returncode != -signal.SIGKILL else None, (logs / f"agent{i}.log").read_text())
            for i, a in enumerate(agents)]


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ddp", "fsdp"])
def test_two_nodes_equal_one_process(tiny_inputs, tmp_path, fsdp):
    """`torchrun --nnodes 2` (c10d rendezvous; each node's only process has LOCAL_RANK 0) trains exactly what
    one process does on the same global batch, reading the offline shards from shared storage."""
    from tiny_speculators.serving import free_port

    with one_thread():
        train(**train_args(tiny_inputs, tmp_path / "one", max_steps=2, batch_size=2))
    extra = ("--fsdp",) if fsdp else ()
    cmd = train_cli(tiny_inputs, tmp_path / "nodes", "--max-steps", "2", "--batch-size", "1", *extra, torchrun=1)
    outputs = _two_node_agents(cmd, free_port(), tmp_path / "logs")
    assert [code for code, _ in outputs] == [0, 0], "\n".join(f"agent {i} exited {code}:\n{err[-3000:]}"
                                                           for i, (code, err) in enumerate(outputs))
    assert_same(load_weights(tmp_path / "one"), load_weights(tmp_path / "nodes"))
    assert json.loads((tmp_path / "nodes" / "summary.json").read_text())["world_size"] == 2


def test_ranks_split_the_checksum_pass_and_all_stop_on_a_bad_shard(tiny_inputs, tmp_path):
    """Each rank hashes only its share of the shards; a corrupted shard stops every rank with the shard's name
    (no rank is left waiting for the others)."""
    from tiny_speculators.verifier.extract import extract

    hs = tmp_path / "hs"
    extract(verifier=str(tiny_inputs.verifier), data=tiny_inputs.prepared, out=hs, dtype="float32", device="cpu",
            shard_mb=0.05, progress=False)
    shards = json.loads((hs / "manifest.json").read_text())["shards"]
    assert len(shards) >= 2
    bad = hs / shards[-1]["file"]
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    cmd = train_cli(dataclasses.replace(tiny_inputs, hidden_states=hs), tmp_path / "run", "--max-steps", "1",
                    torchrun=2)
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.count(f"shard {bad} is corrupted") == 2, done.stderr[-3000:]
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
def test_fsdp_two_processes_equal_one(tiny_inputs, tmp_path):
    train(**train_args(tiny_inputs, tmp_path / "one", max_steps=2, batch_size=2))
    subprocess.run(train_cli(tiny_inputs, tmp_path / "fsdp", "--max-steps", "2", "--batch-size", "1", "--fsdp",
                        torchrun=2), check=True, env=ENV, capture_output=True, timeout=300)
    assert_same(load_weights(tmp_path / "one"), load_weights(tmp_path / "fsdp"))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {path} appeared: {proc.stderr.read()}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.02)


def test_kill9_then_resume_equals_uninterrupted(tiny_inputs, tmp_path):
    from tiny_speculators.train.checkpoint import list_checkpoints

    out = tmp_path / "run"
    # 1) a CLI run, SIGKILLed once its step-2 checkpoint exists
    p = subprocess.Popen(train_cli(tiny_inputs, out, "--max-steps", "8", "--batch-size", "2", "--save-every", "2",
                              "--keep-last", "2"), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "step_000002", p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert not (out / "final").exists(), "the run finished before it could be killed"
    # 2) resume; SIGTERM after the step-4 checkpoint: it checkpoints the step it reached, then stops
    args = train_args(tiny_inputs, out, max_steps=8, batch_size=2, save_every=2, keep_last=2, resume=True)
    watcher = sigterm_when(out / "step_000004")
    with pytest.raises(KeyboardInterrupt):
        train(**args)
    watcher.join()
    ckpts = [s for s, _ in list_checkpoints(out)]
    assert len(ckpts) <= 2 and 4 <= ckpts[-1] < 8
    # 3) resume to the end; compare with an uninterrupted run
    train(**args)
    train(**train_args(tiny_inputs, tmp_path / "straight", max_steps=8, batch_size=2, save_every=2))
    assert_same(load_weights(out), load_weights(tmp_path / "straight"))
    assert_same(load_weights(out, "step_000008"), load_weights(tmp_path / "straight", "step_000008"))
    opt_a = torch.load(out / "step_000008" / "optimizer.pt", weights_only=True)
    opt_b = torch.load(tmp_path / "straight" / "step_000008" / "optimizer.pt", weights_only=True)
    for i, st in opt_b["optimizer"]["state"].items():
        torch.testing.assert_close(opt_a["optimizer"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=1e-9)
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 9))  # one row per step, no duplicates from the interrupted runs


def test_offline_and_online_first_step_loss_agree(tiny_inputs, tmp_path):
    off = train(**train_args(tiny_inputs, tmp_path / "off", max_steps=1, batch_size=2))
    on = train(**train_args(tiny_inputs, tmp_path / "on", max_steps=1, batch_size=2, hidden_states=None,
                         data=tiny_inputs.prepared, online=True))
    assert off["final_train"]["positions"] == on["final_train"]["positions"] > 0
    assert on["final_train"]["loss"] == pytest.approx(off["final_train"]["loss"], rel=1e-4)
    assert_same(load_weights(tmp_path / "off"), load_weights(tmp_path / "on"), atol=1e-5)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_inputs, tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(UserError, match="loss became"):
        train(**train_args(tiny_inputs, out, max_steps=20, batch_size=2, save_every=1, lr=1e30, max_grad_norm=0))
    from tiny_speculators.train.checkpoint import latest_checkpoint

    last = latest_checkpoint(out)
    assert last is not None
    weights = load_file(str(last / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    assert not (out / "final").exists()


def test_bad_arguments_are_user_errors(tiny_inputs, tmp_path):
    with pytest.raises(UserError, match="online"):
        train(**train_args(tiny_inputs, tmp_path / "x", max_steps=1, data=tiny_inputs.prepared))
    train(**train_args(tiny_inputs, tmp_path / "y", max_steps=1, batch_size=2))
    with pytest.raises(UserError, match="already holds checkpoints"):
        train(**train_args(tiny_inputs, tmp_path / "y", max_steps=1, batch_size=2))


def test_init_from_continues_from_a_trained_and_exported_draft(tiny_inputs, tmp_path):
    """--init-from takes our checkpoint or its speculators export; with lr 0 the weights come back unchanged,
    and the first step's loss is the trained draft's, far below a fresh draft's."""
    from tiny_speculators.export.stage import export

    fresh = train(**train_args(tiny_inputs, tmp_path / "a", max_steps=12, batch_size=2))
    export(tmp_path / "a" / "final", out=tmp_path / "exported", format="speculators")
    trained = load_weights(tmp_path / "a")
    first_loss = {}
    for name, source in (("ckpt", tmp_path / "a"), ("speculators", tmp_path / "exported")):
        out = tmp_path / f"from-{name}"
        train(**train_args(tiny_inputs, out, max_steps=1, batch_size=2, lr=0.0, init_from=source))
        assert_same(load_weights(out), trained, atol=0)
        first_loss[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    start = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    assert first_loss["ckpt"] == pytest.approx(first_loss["speculators"], rel=1e-6)
    assert first_loss["ckpt"] < 0.8 * start, (first_loss, start, fresh["final_train"]["loss"])


def test_init_from_with_another_vocabulary_is_a_user_error(tiny_inputs, tmp_path):
    from tiny_speculators.data.vocab import vocab

    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=1, batch_size=2))
    vocab(data=tiny_inputs.prepared, out=tmp_path / "vocab128", size=128)
    with pytest.raises(UserError, match="different draft vocabulary"):
        train(**train_args(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, init_from=tmp_path / "a",
                        vocab=tmp_path / "vocab128"))


def test_init_from_with_another_shape_or_an_init_option_is_a_user_error(tiny_inputs, tmp_path):
    """The draft started from keeps its shape and weights: a shape option set to another value is refused, as is
    an option that initializes a fresh draft; a shape option left at its default takes the draft's (a 2-layer draft
    continues as 2 layers)."""
    train(**train_args(tiny_inputs, tmp_path / "a", max_steps=1, batch_size=2))
    with pytest.raises(UserError, match=r"has num_layers 1, this run sets eagle3.num_layers 2: a draft started"):
        train(**train_args(tiny_inputs, tmp_path / "b", max_steps=1, batch_size=2, init_from=tmp_path / "a",
                        eagle3={"num_layers": 2}))
    with pytest.raises(UserError, match=r"has fc_norm False, this run sets eagle3.fc_norm True"):
        train(**train_args(tiny_inputs, tmp_path / "c", max_steps=1, batch_size=2, init_from=tmp_path / "a",
                        eagle3={"fc_norm": True}))
    with pytest.raises(UserError, match=r"gives the draft's weights, so eagle3.init verifier would have no effect"):
        train(**train_args(tiny_inputs, tmp_path / "e", max_steps=1, batch_size=2, init_from=tmp_path / "a",
                        eagle3={"init": "verifier"}))
    train(**train_args(tiny_inputs, tmp_path / "two", max_steps=1, batch_size=2, eagle3={"num_layers": 2}))
    train(**train_args(tiny_inputs, tmp_path / "d", max_steps=1, batch_size=2, init_from=tmp_path / "two"))
    config = json.loads((tmp_path / "d" / "final" / "draft_config.json").read_text())
    assert config["kwargs"]["num_layers"] == 2, config


def test_offline_subset_of_stored_layers_equals_online(tiny_inputs, tmp_path):
    """One extraction serves several families: offline training on a subset of the stored layers (in another
    order) sees the same states as online training on those layers; a layer that is not stored is refused."""
    stored = json.loads((tiny_inputs.hidden_states / "manifest.json").read_text())["aux_layer_ids"]
    subset = [stored[-1], stored[0]]
    off = train(**train_args(tiny_inputs, tmp_path / "off", max_steps=1, batch_size=2, aux_layer_ids=subset))
    on = train(**train_args(tiny_inputs, tmp_path / "on", max_steps=1, batch_size=2, hidden_states=None,
                         data=tiny_inputs.prepared, online=True, aux_layer_ids=subset))
    assert json.loads((tmp_path / "off" / "final" / "draft_config.json").read_text())["kwargs"][
        "aux_layer_ids"] == subset
    assert on["final_train"]["loss"] == pytest.approx(off["final_train"]["loss"], rel=1e-4)
    with pytest.raises(UserError, match=r"not stored in .*manifest.json holds"):
        train(**train_args(tiny_inputs, tmp_path / "bad", max_steps=1, aux_layer_ids=[max(stored) + 1]))
