"""The extract stage: exact states on tiny Llama/Qwen3 and the embedded verifier, compact layouts, wrapped models,
resume after a real kill, two ranks == one, and clear errors for bad input."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from extract_checks import ATOL, assert_close, check_exact, reference
from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.extract import extract, plan_shards, token_batches
from tiny_speculators.verifier.load import load_verifier

SMALL = dict(shard_mb=0.05, max_tokens_per_batch=40, progress=False)  # ~50 tokens per shard, 1-2 samples per batch


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_extract_is_exact_with_padding_and_batching(request, tmp_path, tiny_vocab, arch, prepared_factory):
    make_prepared = prepared_factory
    verifier = request.getfixturevalue(f"tiny_{arch}_dir")
    prepared = make_prepared(tmp_path / "prepared", str(verifier), tiny_vocab, [3, 17, 30, 8, 25, 12, 5, 1])
    summary = extract(data=prepared, out=tmp_path / "out", dtype="float32", device="cpu", **SMALL)
    assert summary["complete"] and summary["shards_total"] >= 3 and summary["tokens"] == 101
    assert summary["bytes_per_token"] > 4 * 64 * 4 and summary["seconds"] > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tokens"] == 101
    reader = HiddenStateReader(tmp_path / "out")
    m = reader.manifest
    assert m["aux_layer_ids"] == [2, 4, 5] and (m["num_hidden_layers"], m["hidden_size"]) == (8, 64)
    assert m["vocab_size"] == tiny_vocab and m["dtype"] == "float32" and m["verifier_id"] == str(verifier)
    assert all(len(s["sha256"]) == 64 for s in m["shards"])
    model = load_verifier(verifier, with_tokenizer=False)[0]
    check_exact(reader, model, prepared, [2, 4, 5])
    if arch == "qwen3":
        return
    # one big batch per shard stores the same values as small padded batches
    extract(data=prepared, out=tmp_path / "one-batch", dtype="float32", device="cpu", shard_mb=0.05,
            max_tokens_per_batch=100_000, progress=False)
    big = HiddenStateReader(tmp_path / "one-batch")
    for i in range(len(reader)):
        for key in ("aux_hidden_states", "last_hidden_state"):
            assert_close(big[i][key], reader[i][key])


def test_compact_layouts(tmp_path, tiny_llama_dir, prepared_llama):
    full = extract(data=prepared_llama, out=tmp_path / "full", layers=[1, 6], **SMALL)
    compact = extract(data=prepared_llama, out=tmp_path / "fp8-topk", layers=[1, 6], layout="fp8-topk", topk=8,
                      **SMALL)
    assert compact["bytes_per_token"] < full["bytes_per_token"] / 2.5
    model = load_verifier(tiny_llama_dir, with_tokenizer=False)[0]
    reader = HiddenStateReader(tmp_path / "fp8-topk")
    assert reader.manifest["layout"] == "fp8-topk" and reader.manifest["topk"] == 8
    for i in range(0, len(reader), 3):
        got = reader[i]
        ref_aux, ref_logits = reference(model, got["input_ids"], [1, 6])
        scale = ref_aux.reshape(len(ref_aux), 2, 64).abs().amax(-1).repeat_interleave(64, -1)
        assert bool(((got["aux_hidden_states"] - ref_aux).abs() <= scale * 2**-4 + 1e-6).all())
        values, ids = ref_logits.topk(8, dim=-1)
        assert torch.equal(got["target_topk_ids"], ids)
        torch.testing.assert_close(got["target_topk_logits"], values, atol=ATOL, rtol=0)
        torch.testing.assert_close(got["target_logsumexp"], torch.logsumexp(ref_logits, -1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("style", ["new", "old"])
def test_wrapped_verifier_extracts_exactly(tmp_path, tiny_llama_dir, prepared_llama, wrap, monkeypatch, style):
    import tiny_speculators.verifier.extract as stage

    def load_wrapped(name, **kwargs):
        return wrap(load_verifier(name, **kwargs)[0], style), None

    monkeypatch.setattr(stage, "load_verifier", load_wrapped)
    extract(data=prepared_llama, out=tmp_path / "out", **SMALL)
    reader = HiddenStateReader(tmp_path / "out")
    assert reader.manifest["layer_paths"]["layers"] in ("model.language_model.layers", "language_model.model.layers")
    check_exact(reader, load_verifier(tiny_llama_dir, with_tokenizer=False)[0], prepared_llama, [2, 4, 5])


@pytest.mark.slow
def test_embedded_verifier_is_exact(tmp_path, smollm2_dir, prepared_factory):
    make_prepared = prepared_factory
    prepared = make_prepared(tmp_path / "prepared", "smollm2-135m", 49152, [5, 14, 9], seed=3)
    extract(data=prepared, out=tmp_path / "out", max_tokens_per_batch=20, progress=False)
    reader = HiddenStateReader(tmp_path / "out")
    assert reader.manifest["aux_layer_ids"] == [2, 15, 27]
    assert reader.manifest["verifier_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    check_exact(reader, load_verifier("smollm2-135m", with_tokenizer=False)[0], prepared, [2, 15, 27])


def test_bad_input_gives_clear_errors(tmp_path, tiny_llama_dir, tiny_vocab, prepared_llama, prepared_factory):
    make_prepared = prepared_factory
    v = str(tiny_llama_dir)
    with pytest.raises(UserError, match="not a prepared dataset folder"):
        extract(data=tmp_path, out=tmp_path / "o")
    with pytest.raises(UserError, match="embeds only 49152"):
        extract(data=make_prepared(tmp_path / "a", v, tiny_vocab, [4], summary_vocab=60000), out=tmp_path / "o")
    with pytest.raises(UserError, match="tokenizer has 49152"):
        extract(data=make_prepared(tmp_path / "b", v, tiny_vocab, [4], summary_vocab=40000), out=tmp_path / "o")
    with pytest.raises(UserError, match="record 0 has token id .* outside the verifier's vocabulary of 49152"):
        bad = make_prepared(tmp_path / "c", v, 60000, [300], summary_vocab=tiny_vocab)
        extract(data=bad, out=tmp_path / "o", **SMALL)
    with pytest.raises(UserError, match=r"aux layer id\(s\) \[8\] out of range"):
        extract(data=prepared_llama, out=tmp_path / "o", layers=[2, 8])
    extract(data=prepared_llama, out=tmp_path / "d", **SMALL)
    with pytest.raises(UserError, match="different settings"):
        extract(data=prepared_llama, out=tmp_path / "d", **{**SMALL, "layout": "fp8"})
    with pytest.raises(UserError, match="rank 2 is not valid for world size 2"):
        extract(data=prepared_llama, out=tmp_path / "e", rank=2, world_size=2)


def test_disk_full_is_a_user_error(tmp_path, prepared_llama, monkeypatch):
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) > 1:  # plan.json gets written, the first shard does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(UserError, match=r"disk full while writing .*shard-00000.safetensors"):
        extract(data=prepared_llama, out=tmp_path / "out", **SMALL)
    assert not any(p.name.startswith(".shard") for p in (tmp_path / "out").iterdir())


def test_verify_stage(tmp_path, prepared_llama):
    extract(data=prepared_llama, out=tmp_path / "out", **SMALL)
    assert extract(verify=tmp_path / "out")["ok"]
    data = bytearray((tmp_path / "out" / "shard-00001.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "out" / "shard-00001.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"1 of \d+ shards .* are bad: shard .*shard-00001.safetensors is corrupted"):
        extract(verify=tmp_path / "out")


def test_cli_help_lists_every_option(capsys):
    from tiny_speculators.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["extract", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(flag in help_text for flag in ("--verify", "--world-size", "--layout", "--shard-mb", "--layers"))


def test_planning_helpers():
    assert plan_shards([5, 5, 5, 1], 10) == [{"start": 0, "end": 2, "tokens": 10}, {"start": 2, "end": 4, "tokens": 6}]
    assert plan_shards([50], 10) == [{"start": 0, "end": 1, "tokens": 50}]
    batches = token_batches([3, 10, 4, 9, 30], 20)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4] and batches[0] == [4]
    assert all(len(b) * max([3, 10, 4, 9, 30][i] for i in b) <= 20 for b in batches[1:])


# ---- real processes: kill + resume, two ranks -------------------------------------------------------------------

SLOW_MAIN = """
import sys, time
import tiny_speculators.verifier.extract as stage
capture = stage.capture_hidden_states
def slow(*args, **kwargs):
    time.sleep(float(sys.argv[1]))
    return capture(*args, **kwargs)
stage.capture_hidden_states = slow
from tiny_speculators.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _cli(prepared: Path, out: Path, *extra: str, sleep: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["extract", "--data", str(prepared), "--out", str(out), "--shard-mb", "0.05",
            "--max-tokens-per-batch", "40", "--no-progress", *extra]
    return subprocess.Popen([sys.executable, "-c", SLOW_MAIN, str(sleep), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    return output


def _shard_digests(out: Path) -> list[tuple[int, int, int, str]]:
    manifest = json.loads((out / "manifest.json").read_text())
    return [(s["index"], s["start"], s["end"], s["sha256"]) for s in manifest["shards"]]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, prepared_llama) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    _wait(_cli(prepared_llama, out))
    return out


def test_resume_after_kill_equals_uninterrupted_run(tmp_path, prepared_llama, reference_run):
    out = tmp_path / "out"
    proc = _cli(prepared_llama, out, sleep=0.5)
    part = out / "parts" / "rank-00000.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if part.exists() and json.loads(part.read_text())["shards"]:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the slowed-down run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    first = out / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    done_before = set(json.loads(part.read_text())["shards"])
    assert 0 < len(done_before) < len(_shard_digests(reference_run))
    output = _wait(_cli(prepared_llama, out))
    assert "resuming" in output
    assert first.stat().st_mtime_ns == stamp  # the complete shard was kept, not recomputed
    assert _shard_digests(out) == _shard_digests(reference_run)
    assert HiddenStateReader(out).manifest["samples"] == 12
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_two_ranks_equal_one_process(tmp_path, prepared_llama, reference_run):
    out = tmp_path / "out"
    procs = [_cli(prepared_llama, out, "--world-size", "2", "--rank", str(r)) for r in (0, 1)]
    for proc in procs:
        _wait(proc)
    assert sorted(p.name for p in (out / "parts").glob("rank-*.json")) == ["rank-00000.json", "rank-00001.json"]
    assert _shard_digests(out) == _shard_digests(reference_run)
    ranks = {s["index"]: s["rank"] for s in json.loads((out / "manifest.json").read_text())["shards"]}
    assert ranks == {k: k % 2 for k in ranks}
    reader, ref = HiddenStateReader(out), HiddenStateReader(reference_run)
    assert torch.equal(reader[11]["aux_hidden_states"], ref[11]["aux_hidden_states"])
    shutil.rmtree(out)
