"""How a torchrun rank on CPU ends: after a gloo group it skips interpreter finalization (which gloo's
still-running threads may crash), with its exit code and everything it printed intact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tiny_speculators.serving import free_port

SCRIPT = textwrap.dedent("""
    import atexit
    import torch
    import torch.distributed as dist
    from tiny_speculators.train import distributed as D

    atexit.register(print, "finalized")
    t = torch.ones(3)
    if {gloo}:  # one rank, so that no peer is needed: the same backend and threads as a torchrun rank's
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
        dist.all_reduce(t)
    print("sum", float(t.sum()), end="")  # left in the stdout buffer
    D.teardown_distributed()
    D.exit_without_finalizing(3)
    print(" returned")
""")


def _run(gloo: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(gloo=gloo, port=free_port())], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_process_that_ran_a_gloo_group_exits_with_its_code_and_output_but_no_finalization():
    done = _run(gloo=True)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "sum 3.0"  # flushed; neither the code after the exit nor the atexit handler ran


def test_a_process_without_a_group_returns_and_finalizes_normally():
    done = _run(gloo=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "sum 3.0 returned\nfinalized\n"
