"""The paired bootstrap: point values equal the pooled counters, a clear gain is called better, no gain is not,
pairing is what makes a small consistent gain visible, and a seed repeats a run."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_speculators.compare.stats import Counts, paired_bootstrap


def counts(drafts: list[int], accepted: list[int], k: int = 3) -> Counts:
    # per position: a step with a accepted tokens counts at positions 0..a-1; spread a prompt's total evenly
    per_pos = []
    for d, a in zip(drafts, accepted, strict=True):
        row, left = [0] * k, a
        for i in range(k):
            row[i] = min(d, left)
            left -= row[i]
        per_pos.append(row)
    return Counts(drafts, accepted, per_pos)


def run(cs: list[Counts], margin: float = 0.0, seed: int = 0) -> dict:
    return paired_bootstrap(cs, resamples=4000, seed=seed, confidence=0.95, margin=margin)


def test_point_values_are_the_pooled_counters():
    a, b = counts([10, 20, 30], [5, 10, 30]), counts([10, 20, 30], [8, 12, 33])
    result = run([a, b])
    assert result["drafts"][0]["tau"] == pytest.approx(1 + 45 / 60)
    assert result["drafts"][1]["tau"] == pytest.approx(1 + 53 / 60)
    assert result["differences"][0]["tau_difference"] == pytest.approx(8 / 60)
    assert result["drafts"][0]["per_position_acceptance"][0] == pytest.approx(sum(min(d, a) for d, a in
                                                                                   ((10, 5), (20, 10), (30, 30))) / 60)
    lo, hi = result["drafts"][0]["tau_interval"]
    assert lo <= result["drafts"][0]["tau"] <= hi


def test_a_clear_gain_is_better_and_no_gain_is_not():
    rng = np.random.default_rng(1)
    steps = [40] * 30
    a_acc = list(rng.integers(8, 30, size=30))
    a = counts(steps, a_acc)
    better = counts(steps, [x + 10 for x in a_acc])
    same = counts(steps, a_acc)
    result = run([a, better, same], margin=0.05)
    gain, none = result["differences"]
    assert gain["better"] and gain["not_worse"] and gain["lower_bound"] > 0.05 and gain["p_better"] > 0.99
    assert none["tau_difference"] == 0 and not none["better"]
    assert none["not_worse"]  # within the 0.05 margin: the intervals of identical counts are all zero
    assert none["interval"] == [0.0, 0.0]


def test_a_worse_draft_is_neither_better_nor_not_worse():
    steps = [40] * 20
    a = counts(steps, [30] * 10 + [10] * 10)
    worse = counts(steps, [25] * 10 + [5] * 10)
    (diff,) = run([a, worse], margin=0.01)["differences"]
    assert diff["tau_difference"] < 0 and not diff["better"] and not diff["not_worse"]


def test_pairing_sees_a_small_consistent_gain_that_prompt_variance_would_hide():
    """Prompts differ a lot (accepted 2..38 of 40); B accepts 1 more on every prompt. Paired, the gain's interval
    stays above 0; the same gain judged by each draft's own interval overlaps heavily."""
    steps = [40] * 40
    a_acc = [2 + (i * 13) % 37 for i in range(40)]
    a, b = counts(steps, a_acc), counts(steps, [x + 1 for x in a_acc])
    result = run([a, b])
    (diff,) = result["differences"]
    assert diff["better"] and diff["interval"][0] > 0
    _, a_hi = result["drafts"][0]["tau_interval"]
    b_lo, _ = result["drafts"][1]["tau_interval"]
    assert b_lo < a_hi  # unpaired intervals overlap


def test_the_same_seed_repeats_and_another_differs():
    rng = np.random.default_rng(2)
    a = counts([30] * 12, list(rng.integers(0, 30, size=12)))
    b = counts([30] * 12, list(rng.integers(0, 30, size=12)))
    assert run([a, b], seed=5) == run([a, b], seed=5)
    assert run([a, b], seed=5)["differences"][0]["interval"] != run([a, b], seed=6)["differences"][0]["interval"]
