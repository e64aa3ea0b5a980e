"""Draft vocabulary: top-N by count with a lower-id tie-break, vLLM d2t/t2d semantics, fill, cap, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_speculators import cli
from tiny_speculators.data.prepared import load_prepared
from tiny_speculators.data.vocab import build_vocab, load_vocab, vocab
from tiny_speculators.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "chats.jsonl"


def check_round_trip(d2t, t2d, n):
    assert d2t.dtype == torch.int64 and d2t.shape == (n,) and t2d.dtype == torch.bool
    assert int(t2d.sum()) == n
    target_ids = torch.arange(n) + d2t
    assert bool(t2d[target_ids].all())  # for every draft id i, t2d[i + d2t[i]] is True
    assert bool((target_ids[1:] > target_ids[:-1]).all())  # draft ids follow target ids in ascending order
    assert torch.equal(t2d.nonzero().flatten(), target_ids)
    return target_ids


def test_top_n_with_tie_break_by_hand():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 3, 0, 9, 0], dtype=torch.int64)
    d2t, t2d, info = build_vocab(counts, 4)
    # by count: 8 (9), then 1 and 3 (5 each, lower id first), then 2 and 6 tie at 3 -> 2 wins
    assert check_round_trip(d2t, t2d, 4).tolist() == [1, 2, 3, 8]
    assert d2t.tolist() == [1, 1, 1, 5]
    assert info["filled"] == 0 and info["distinct_seen"] == 6 and info["target_vocab_size"] == 10
    assert info["coverage"] == pytest.approx((9 + 5 + 5 + 3) / 26)


def test_random_counts_match_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(20):
        vocab_size = int(rng.integers(5, 300))
        counts = rng.integers(0, 6, size=vocab_size) * (rng.random(vocab_size) < 0.6)  # many ties and zeros
        n = int(rng.integers(1, vocab_size + 1))
        d2t, t2d, info = build_vocab(torch.from_numpy(counts), n)
        seen = sorted((i for i in range(vocab_size) if counts[i] > 0), key=lambda i: (-counts[i], i))
        unseen = [i for i in range(vocab_size) if counts[i] == 0]
        expected = sorted((seen + unseen)[:n])  # seen first by (count desc, id asc), then the lowest unseen ids
        assert check_round_trip(d2t, t2d, n).tolist() == expected, trial
        assert info["filled"] == max(0, n - len(seen))


def test_fill_and_cap():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[4, 7]] = torch.tensor([2, 1])
    d2t, t2d, info = build_vocab(counts, 5)
    assert check_round_trip(d2t, t2d, 5).tolist() == [0, 1, 2, 4, 7]
    assert info["filled"] == 3 and info["distinct_seen"] == 2 and info["coverage"] == 1.0
    d2t, t2d, info = build_vocab(counts, 50)
    assert info["size"] == 10 and info["capped"] and d2t.tolist() == [0] * 10 and bool(t2d.all())
    # t2d spans the verifier's embedding rows when they outnumber the tokenizer's tokens (Qwen3: 151936 > 151669)
    d2t, t2d, info = build_vocab(counts, 3, target_vocab_size=16)
    assert t2d.shape == (16,) and check_round_trip(d2t, t2d, 3).tolist() == [0, 4, 7]
    with pytest.raises(UserError):
        build_vocab(counts, 3, target_vocab_size=5)
    with pytest.raises(UserError):
        build_vocab(counts, 0)


def test_load_vocab_errors(tmp_path):
    with pytest.raises(UserError, match="no vocab.safetensors"):
        load_vocab(tmp_path)
    with pytest.raises(UserError, match="not a prepare output"):
        vocab(tmp_path, tmp_path / "v")


@pytest.mark.slow
def test_cli_prepare_then_vocab_on_examples(tmp_path, smollm2_dir, capsys):
    prepared_dir, vocab_dir = tmp_path / "prepared", tmp_path / "vocab"
    assert cli.main(["prepare", "--verifier", str(smollm2_dir), "--data", str(EXAMPLES), "--out", str(prepared_dir),
                     "--max-length", "512"]) == 0
    prepared = load_prepared(prepared_dir)
    s = prepared.summary
    n_lines = sum(1 for line in EXAMPLES.read_text().splitlines() if line.strip())
    assert s["records_read"] == s["kept"] == len(prepared.dataset) == n_lines >= 40 and s["dropped"] == {}
    assert s["vocab_size"] == 49152 and s["model_vocab_size"] == 49152
    assert 0.2 < s["masked_fraction"] < 0.8
    for ids, mask in zip(prepared.dataset["input_ids"], prepared.dataset["loss_mask"], strict=True):
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask) and set(mask) <= {0, 1}

    assert cli.main(["vocab", "--data", str(prepared_dir), "--size", "300", "--out", str(vocab_dir)]) == 0
    d2t, t2d = load_vocab(vocab_dir)
    target_ids = check_round_trip(d2t, t2d, 300)
    counts = prepared.token_counts()
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))[:300]
    assert target_ids.tolist() == sorted(order)
    summary = json.loads((vocab_dir / "summary.json").read_text())
    assert summary["filled"] == 0 and summary["size"] == 300 and summary["distinct_seen"] > 300

    # more than were seen: filled deterministically, and said so
    assert cli.main(["vocab", "--data", str(prepared_dir), "--size", "2000", "--out", str(tmp_path / "v2")]) == 0
    summary = json.loads((tmp_path / "v2" / "summary.json").read_text())
    assert summary["filled"] == 2000 - s["distinct_masked_tokens"] > 0
    check_round_trip(*load_vocab(tmp_path / "v2"), 2000)

    # bad input through the CLI: one sentence, exit code 1
    assert cli.main(["prepare", "--verifier", str(smollm2_dir), "--data", str(tmp_path / "missing.jsonl"),
                     "--out", str(tmp_path / "x")]) == 1
    assert "missing.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_embedded_name(tmp_path):
    out = tmp_path / "p"
    assert cli.main(["prepare", "--verifier", "smollm2-135m", "--data", str(EXAMPLES), "--out", str(out),
                     "--last-turn-only"]) == 0
    summary = load_prepared(out).summary
    assert summary["verifier"] == "smollm2-135m"
    assert summary["verifier_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert summary["options"]["last_turn_only"] is True
