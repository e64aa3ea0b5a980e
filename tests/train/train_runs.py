"""What the training tests share: the arguments of a tiny run (in process and on the command line), its weights,
their comparison, one-thread determinism and a SIGTERM at a checkpoint.

A module of its own: test modules import these by name, and no test module imports another.

    from train_runs import assert_same, load_weights, train_args
    train(**train_args(tiny_inputs, tmp_path / "run", max_steps=2))
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = ["ENV", "assert_same", "load_weights", "one_thread", "sigterm_when", "train_args", "train_cli"]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def train_args(inputs, out: Path, **kw) -> dict:
    args = dict(verifier=str(inputs.verifier), vocab=inputs.vocab, out=out, hidden_states=inputs.hidden_states,
                eval_fraction=0.0, lr=1e-2, warmup_steps=0, progress=False, seed=3, save_every=0)
    args.update(kw)
    return args


class one_thread:
    """Run the in-process side of a DDP comparison on one torch thread, as the torchrun ranks do
    (``ENV`` sets OMP_NUM_THREADS=1): the same summation order, so only DDP's own arithmetic differs."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)


def load_weights(out: Path, name: str = "final") -> dict[str, torch.Tensor]:
    return load_file(str(out / name / "model.safetensors"))


def assert_same(a: dict, b: dict, atol: float = 2e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=f"parameter {k}")


def train_cli(inputs, out: Path, *extra: str, torchrun: int = 0) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}"] if torchrun else \
        [sys.executable]
    return [*launcher, "-m", "tiny_speculators.cli", "train", "--verifier", str(inputs.verifier), "--vocab",
            str(inputs.vocab), "--hidden-states", str(inputs.hidden_states), "--out", str(out), "--eval-fraction",
            "0", "--lr", "1e-2", "--seed", "3", "--no-progress", *extra]


def sigterm_when(path: Path) -> threading.Thread:
    """Send this process SIGTERM once ``path`` exists (the handler runs in the main thread, in the loop)."""
    def watch() -> None:
        t0 = time.time()
        while not path.exists() and time.time() - t0 < 300:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
