"""The comparisons every family's training tests make, for any ``algorithm`` and its options: 2-process DDP == one
process, SIGTERM + resume == uninterrupted, offline == online.

    from train_checks import ddp_equals_one
    ddp_equals_one(tiny_inputs, tmp_path, "dflash", {"block_size": 4, "anchors": 1000})
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from train_runs import ENV, assert_same, load_weights, one_thread, sigterm_when, train_args, train_cli

from tiny_speculators.train.stage import train

__all__ = ["ddp_equals_one", "offline_equals_online", "resume_equals_uninterrupted"]


def ddp_equals_one(inputs, tmp_path: Path, algorithm: str, options: dict, atol: float = 1e-5) -> dict:
    """Two steps of ``algorithm`` in one process (batch 2) and in 2-process DDP (batch 1 each, the options as CLI
    flags) end with the same weights and loss; returns the single process's summary."""
    with one_thread():
        single = train(**train_args(inputs, tmp_path / "one", max_steps=2, batch_size=2, algorithm=algorithm,
                                 **{algorithm: options}))
    flags = [arg for key, value in options.items() for arg in (f"--{algorithm}-{key.replace('_', '-')}", str(value))]
    subprocess.run(train_cli(inputs, tmp_path / "ddp", "--max-steps", "2", "--batch-size", "1", "--algorithm",
                             algorithm, *flags, torchrun=2), check=True, env=ENV, capture_output=True, timeout=300)
    assert_same(load_weights(tmp_path / "one"), load_weights(tmp_path / "ddp"), atol=atol)
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["algorithm"] == algorithm and ddp["world_size"] == 2
    assert ddp["final_train"]["loss"] == pytest.approx(single["final_train"]["loss"], rel=1e-5)
    return single


def offline_equals_online(inputs, tmp_path: Path, algorithm: str, options: dict, **online) -> None:
    """One step of ``algorithm`` from stored hidden states and from the verifier run online (extra ``online``
    arguments, e.g. its ``aux_layer_ids``) sees the same positions and the same loss."""
    off = train(**train_args(inputs, tmp_path / "off", max_steps=1, batch_size=2, algorithm=algorithm,
                          **{algorithm: options}))
    on = train(**train_args(inputs, tmp_path / "on", max_steps=1, batch_size=2, hidden_states=None,
                         data=inputs.prepared, online=True, algorithm=algorithm, **{algorithm: options}, **online))
    assert on["final_train"]["positions"] == off["final_train"]["positions"] > 0
    assert on["final_train"]["loss"] == pytest.approx(off["final_train"]["loss"], rel=1e-4)


def resume_equals_uninterrupted(inputs, tmp_path: Path, algorithm: str, options: dict) -> None:
    """A run of ``algorithm`` stopped by SIGTERM after its step-2 checkpoint and resumed ends with the weights of an
    uninterrupted one (4 steps, batch 2)."""
    args = train_args(inputs, tmp_path / "run", max_steps=4, batch_size=2, save_every=2, algorithm=algorithm,
                   **{algorithm: options})
    watcher = sigterm_when(tmp_path / "run" / "step_000002")
    with pytest.raises(KeyboardInterrupt):
        train(**args)
    watcher.join()
    assert not (tmp_path / "run" / "final").exists()
    train(**{**args, "resume": True})
    train(**train_args(inputs, tmp_path / "straight", max_steps=4, batch_size=2, save_every=2, algorithm=algorithm,
                    **{algorithm: options}))
    assert_same(load_weights(tmp_path / "run"), load_weights(tmp_path / "straight"))
