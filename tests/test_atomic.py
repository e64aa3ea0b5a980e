"""Atomic writes leave either the old or the new file, never a half-written one or a temp file."""

from __future__ import annotations

import errno
import json

import pytest

from tiny_speculators.atomic import atomic_write, replace_dir_atomic, write_json_atomic
from tiny_speculators.errors import UserError


def test_json_write_replaces_the_file(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_json_atomic(path, {"b": 1, "a": "é"})
    write_json_atomic(path, {"b": 2, "a": 1}, sort_keys=True)
    assert path.read_text(encoding="utf-8") == '{\n  "a": 1,\n  "b": 2\n}\n'
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_a_failing_writer_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"v": 1})

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write('{"v": 2')  # half written
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_disk_full_is_one_sentence(tmp_path):
    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match=r"disk full while writing .*x\.bin"):
        atomic_write(tmp_path / "x.bin", full)
    assert list(tmp_path.iterdir()) == []


def test_replace_dir_swaps_whole_folders(tmp_path):
    target = tmp_path / "best"
    replace_dir_atomic(target, lambda d: (d / "w").write_text("1"))
    replace_dir_atomic(target, lambda d: (d / "v").write_text("2"))
    assert sorted(p.name for p in target.iterdir()) == ["v"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
