"""prepare after a kill: a rerun resumes after the last committed chunk, duplicates nothing and writes
the same bytes as an uninterrupted run; changed inputs or options start over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_speculators
from tiny_speculators.data.prepare import prepare
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.data.resume import ChunkStore

VOLATILE = {"seconds", "records_per_second", "resumed_records"}
CHUNK = 25


def write_chats(path: Path, n: int) -> None:
    """``n`` varied chats, every 17th one bad (so bad_records.jsonl spans chunks too)."""
    rows = []
    for i in range(n):
        if i % 17 == 5:
            rows.append('{"messages": [{"role": "user", "content": "cut')
            continue
        turns = [{"role": "user", "content": f"Question {i}: what is {i} + {i * 3}?"},
                 {"role": "assistant", "content": f"{i} + {i * 3} = {i * 4}." + " Indeed." * (i % 5)}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": f"Because {i * 4}."}]
        key = "messages" if i % 2 else "conversations"
        rows.append(json.dumps({key: turns}))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "summary.json"}


def stable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in VOLATILE}


KILLER = """
import os, signal, sys
import tiny_speculators.data.prepare as p
render, calls = p._render, [0]
def dying_render(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(sys.argv[4]):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: like the OOM killer or a pulled plug
    return render(*args, **kwargs)
p._render = dying_render
p.prepare(verifier=sys.argv[1], data=[sys.argv[2]], out=sys.argv[3], chunk_records=25)
"""


def test_kill_then_resume_is_byte_identical(tmp_path, smollm2_dir):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 240)
    reference = prepare(str(smollm2_dir), [data], tmp_path / "ref", chunk_records=CHUNK)
    assert reference["resumed_records"] == 0 and reference["dropped"] == {"invalid JSON": 14}

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(tiny_speculators.__file__).parents[1])}
    killed = subprocess.run([sys.executable, "-c", KILLER, str(smollm2_dir), str(data), str(out), "113"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    partial = tmp_path / ".out.partial"
    assert not out.exists() and partial.is_dir()
    store = ChunkStore(partial, {})
    assert [stats["records_read"] for _, stats in store.chunks()] == [CHUNK] * 4  # record 113 never finished

    resumed = prepare(str(smollm2_dir), [data], out, chunk_records=CHUNK)
    assert resumed["resumed_records"] == 4 * CHUNK
    assert files(out) == files(tmp_path / "ref")  # dataset/, token_counts, bad_records: same bytes
    assert stable(resumed) == stable(reference)
    assert not partial.exists()
    sources = load_prepared(out).dataset["source"]
    assert len(sources) == len(set(sources)) == reference["samples"]  # nothing duplicated, nothing lost


def test_changed_options_or_inputs_start_over(tmp_path, smollm2_dir, monkeypatch):
    import tiny_speculators.data.prepare as p

    data = tmp_path / "chats.jsonl"
    write_chats(data, 60)
    render, calls = p._render, [0]

    def failing_render(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 40:
            raise KeyboardInterrupt  # Ctrl-C: the committed chunk stays
        return render(*args, **kwargs)

    monkeypatch.setattr(p, "_render", failing_render)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK)
    monkeypatch.setattr(p, "_render", render)
    assert len(ChunkStore(tmp_path / ".out.partial", {}).chunks()) == 1
    # another max_length: the committed chunk was made with other options, so it is not reused
    summary = prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK, max_length=64)
    assert summary["resumed_records"] == 0 and summary["records_read"] == 60


def test_a_chunk_cut_off_before_its_stats_is_redone(tmp_path, smollm2_dir):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 60)
    reference = prepare(str(smollm2_dir), [data], tmp_path / "ref", chunk_records=CHUNK)
    import tiny_speculators.data.prepare as p

    commit = ChunkStore.commit
    with pytest.MonkeyPatch.context() as mp:  # stop after the second chunk's rows are written, before its stats
        def commit_then_die(self, index, rows, features, stats):
            commit(self, index, rows, features, stats)
            if index == 1:
                (self.folder / "chunk-000001.json").unlink()
                (self.folder / ".chunk-000002.arrow.abc.tmp").write_bytes(b"half")
                raise KeyboardInterrupt

        mp.setattr(p.ChunkStore, "commit", commit_then_die)
        with pytest.raises(KeyboardInterrupt):
            prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK)
    resumed = prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK)
    assert resumed["resumed_records"] == CHUNK
    assert files(tmp_path / "out") == files(tmp_path / "ref") and stable(resumed) == stable(reference)


def test_a_running_prepare_is_not_disturbed(tmp_path, smollm2_dir):
    from tiny_speculators.errors import UserError

    data = tmp_path / "chats.jsonl"
    write_chats(data, 10)
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (partial / "lock").write_text(f"{sleeper.pid}\n")
        with pytest.raises(UserError, match=f"another prepare \\(pid {sleeper.pid}\\)"):
            prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert prepare(str(smollm2_dir), [data], tmp_path / "out", chunk_records=CHUNK)["kept"] == 9  # stale lock
