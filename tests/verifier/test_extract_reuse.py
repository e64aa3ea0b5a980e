"""``extract --reuse``: the samples an earlier extraction holds are copied as stored, only the others are computed;
the result is the extraction of the new data (exact), its entries name what was reused, and a kill resumes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from extract_checks import check_exact
from prepared_data import make_prepared
from tiny_speculators.errors import UserError
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier import extract as stage
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.load import load_verifier

SMALL = dict(shard_mb=0.05, max_tokens_per_batch=40, progress=False, dtype="float32", device="cpu")


def _ids(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def two_days(tmp_path_factory, tiny_llama_dir, tiny_vocab):
    """Day one: 8 samples; day two: day one's in another order with other loss masks, plus 4 new ones."""
    root = tmp_path_factory.mktemp("reuse")
    old = _ids(tiny_vocab, [3, 17, 30, 8, 25, 12, 5, 19], seed=1)
    new = _ids(tiny_vocab, [9, 22, 4, 14], seed=2)
    day1 = make_prepared(root / "day1", str(tiny_llama_dir), tiny_vocab, [], ids=old,
                         masks=[[1] * len(x) for x in old])
    both = [new[0], *old[::-1][:4], new[1], new[2], *old[::-1][4:], new[3]]
    day2 = make_prepared(root / "day2", str(tiny_llama_dir), tiny_vocab, [], ids=both,
                         masks=[[i % 2 for i in range(len(x))] for x in both])
    return root, day1, day2, {tuple(x) for x in old}


@pytest.mark.parametrize("layout", ["full", "fp8-topk"])
def test_reused_samples_are_copied_and_the_rest_computed(tmp_path, tiny_llama_dir, two_days, layout):
    _, day1, day2, old = two_days
    opts = dict(SMALL, layout=layout, topk=8, shard_mb=0.025 if layout == "full" else 0.007)  # ~25 tokens per shard
    extract(data=day1, out=tmp_path / "day1", **opts)
    summary = extract(data=day2, out=tmp_path / "day2", reuse=tmp_path / "day1", **opts)
    assert summary["complete"] and summary["reused_samples"] == 8
    reader, earlier = HiddenStateReader(tmp_path / "day2"), HiddenStateReader(tmp_path / "day1")
    reused = {s["start"] + j for s in reader.manifest["shards"] for j in s.get("reused", [])}
    assert reused == {i for i in range(len(reader)) if tuple(reader[i]["input_ids"].tolist()) in old}
    kinds = {len(s.get("reused", [])) / (s["end"] - s["start"]) for s in reader.manifest["shards"]}
    assert 0.0 in kinds and 1.0 in kinds and kinds - {0.0, 1.0}, kinds  # computed, copied and mixed shards
    where = {tuple(earlier[i]["input_ids"].tolist()): i for i in range(len(earlier))}
    for i in sorted(reused):  # bit-equal to what day one stored (fp8 states not requantized); day two's masks
        got, was = reader[i], earlier[where[tuple(reader[i]["input_ids"].tolist())]]
        for key in got:
            if key != "loss_mask":
                assert torch.equal(got[key], was[key]), key
        assert got["loss_mask"].tolist() == [j % 2 for j in range(len(got["loss_mask"]))]
    if layout == "full":  # and the whole of it is the verifier's states of day two's data
        check_exact(reader, load_verifier(tiny_llama_dir, with_tokenizer=False)[0], day2, [2, 4, 5])
    else:
        fresh = extract(data=day2, out=tmp_path / "fresh", **opts)
        assert fresh["tokens"] == summary["tokens"] and "reused_samples" not in fresh
        with safe_open(str(tmp_path / "day2" / "shard-00000.safetensors"), "pt") as f:
            assert f.get_tensor("aux_hidden_states").dtype == torch.float8_e4m3fn


def test_a_killed_reusing_run_resumes_to_the_same_shards(tmp_path, two_days, monkeypatch):
    _, day1, day2, _ = two_days
    extract(data=day1, out=tmp_path / "day1", **SMALL)
    extract(data=day2, out=tmp_path / "whole", reuse=tmp_path / "day1", **SMALL)
    run_shard = stage._run_shard
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between shards: what is recorded stays
        return run_shard(*args, **kwargs)

    monkeypatch.setattr(stage, "_run_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        extract(data=day2, out=tmp_path / "out", reuse=tmp_path / "day1", **SMALL)
    monkeypatch.setattr(stage, "_run_shard", run_shard)
    assert not (tmp_path / "out" / "manifest.json").exists()
    extract(data=day2, out=tmp_path / "out", reuse=tmp_path / "day1", **SMALL)

    def digests(out: Path):
        return [(s["index"], s["sha256"], s.get("reused")) for s in
                json.loads((out / "manifest.json").read_text())["shards"]]

    assert digests(tmp_path / "out") == digests(tmp_path / "whole")


def test_other_settings_reuse_nothing_and_bad_folders_are_named(tmp_path, two_days, caplog):
    _, day1, day2, _ = two_days
    extract(data=day1, out=tmp_path / "day1", layers=[1, 6], **SMALL)
    summary = extract(data=day2, out=tmp_path / "day2", reuse=tmp_path / "day1", **SMALL)
    assert summary["reused_samples"] == 0 and "aux_layer_ids" in caplog.text
    with pytest.raises(UserError, match="--reuse .*missing does not exist"):
        extract(data=day2, out=tmp_path / "x", reuse=tmp_path / "missing", **SMALL)
    with pytest.raises(UserError, match="is the --out folder"):
        extract(data=day2, out=tmp_path / "day2", reuse=tmp_path / "day2", **SMALL)
