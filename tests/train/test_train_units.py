"""Unit tests of the loop's parts: schedule, data plan / collation, checkpoint files, metrics logs."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from tiny_speculators.train import checkpoint as C
from tiny_speculators.train.data import (
    collate,
    eval_share,
    group_micro_batches,
    plan_epoch,
    prompt_key,
    rank_share,
    split_train_val,
)
from tiny_speculators.train.metrics import MetricsLogger, plot_metrics, read_metrics
from tiny_speculators.train.schedule import build_optimizer, lr_at


def test_lr_schedule_warmup_then_cosine():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)


def test_optimizer_skips_frozen_and_does_not_decay_norms():
    m = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    m[0].weight.requires_grad_(False)
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    all_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(m[0].weight) not in all_params
    assert decayed == {id(m[1].weight)}


def test_plan_is_deterministic_disjoint_and_covers_each_epoch():
    lengths = [random.Random(i).randint(5, 50) for i in range(40)]
    idx = list(range(40))
    plan = plan_epoch(idx, lengths, epoch=1, seed=7, batch_size=3, batch_tokens=None, micro_per_step=4)
    assert plan == plan_epoch(idx, lengths, epoch=1, seed=7, batch_size=3, batch_tokens=None, micro_per_step=4)
    assert plan != plan_epoch(idx, lengths, epoch=2, seed=7, batch_size=3, batch_tokens=None, micro_per_step=4)
    assert len(plan) == 40 // 3 // 4
    for step in plan:
        shares = [[i for mb in rank_share(step, r, 2) for i in mb] for r in range(2)]
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == sorted(i for mb in step for i in mb)
    seen = [i for step in plan for mb in step for i in mb]
    assert len(seen) == len(set(seen))


def test_token_budget_batching():
    lengths = [10, 20, 30, 100, 5, 5]
    padded = group_micro_batches(range(6), lengths, batch_size=1, batch_tokens=60, pack=False)
    assert padded == [[0, 1], [2], [3], [4, 5]]  # padded cost n * max_len: 3 * 30 > 60; a long sample alone
    packed = group_micro_batches(range(6), lengths, batch_size=1, batch_tokens=60, pack=True)
    assert packed == [[0, 1, 2], [3], [4, 5]]


def test_eval_share_covers_validation_once():
    lengths = [8] * 11
    shares = [eval_share(range(11), lengths, batch_size=2, batch_tokens=None, rank=r, world_size=3) for r in range(3)]
    assert sorted(i for s in shares for mb in s for i in mb) == list(range(11))


def test_split_train_val():
    train, val = split_train_val(20, 0.1, seed=0)
    assert len(val) == 2 and sorted(train + val) == list(range(20))
    assert split_train_val(20, 0.1, seed=0) == (train, val)
    assert split_train_val(20, 0.0, seed=0)[1] == []


def test_split_keeps_each_prompt_on_one_side():
    groups = [i // 3 for i in range(60)]  # three answers to each of 20 prompts
    train, val = split_train_val(60, 0.1, seed=1, groups=groups)
    assert len(val) == 6 and sorted(train + val) == list(range(60))
    assert {groups[i] for i in train}.isdisjoint(groups[i] for i in val)
    assert split_train_val(60, 0.1, seed=1, groups=groups) == (train, val)
    assert split_train_val(20, 0.1, seed=0, groups=[f"p{i}" for i in range(20)]) == split_train_val(20, 0.1, seed=0)
    assert split_train_val(60, 0.0, seed=1, groups=groups)[1] == []


def test_prompt_key_is_what_comes_before_the_first_supervised_token():
    assert prompt_key([1, 2, 3, 9], [0, 0, 1, 1]) == prompt_key([1, 2, 4, 4, 4], [0, 0, 1, 1, 0])
    assert prompt_key([1, 2, 3], [0, 0, 1]) != prompt_key([1, 5, 3], [0, 0, 1])
    assert prompt_key([1, 2], [0, 0]) != prompt_key([1, 2, 3], [0, 0, 0])


def _sample(n, h=3, start=0):
    return {"input_ids": torch.arange(start, start + n), "loss_mask": torch.ones(n, dtype=torch.long),
            "aux_hidden_states": torch.randn(n, 3 * h), "last_hidden_state": torch.randn(n, h)}


def test_collate_pads_right_and_packs_with_document_ids():
    a, b = _sample(3), _sample(5, start=10)
    pad = collate([a, b])
    assert pad["input_ids"].shape == (2, 5)
    assert pad["loss_mask"][0].tolist() == [1, 1, 1, 0, 0] and pad["attention_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert torch.equal(pad["aux_hidden_states"][0, :3], a["aux_hidden_states"])
    assert (pad["last_hidden_state"][0, 3:] == 0).all()
    packed = collate([a, b], pack=True)
    assert packed["input_ids"].shape == (1, 8)
    assert packed["document_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert torch.equal(packed["last_hidden_state"][0, 3:], b["last_hidden_state"])


def test_collate_keeps_stored_positions():
    """A vision-language verifier's samples carry their positions (text after an image skips ahead): padding and
    packing keep them; padding continues a row's last position; a sample without them counts from 0."""
    a, b = _sample(3), _sample(5, start=10)
    a["position_ids"] = torch.tensor([0, 1, 3])
    pad = collate([a, b])
    assert pad["position_ids"].tolist() == [[0, 1, 3, 4, 5], [0, 1, 2, 3, 4]]
    b["position_ids"] = torch.tensor([0, 2, 2, 3, 4])
    assert collate([a, b], pack=True)["position_ids"][0].tolist() == [0, 1, 3, 0, 2, 2, 3, 4]


def test_atomic_dir_prune_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        C.write_atomic_dir(C.step_dir(tmp_path, step), lambda d: (d / C.META_FILE).write_text("{}"))
    (tmp_path / ".tmp-step_000005").mkdir()  # a half-written checkpoint from a killed run is ignored
    (tmp_path / "step_000009").mkdir()  # no meta.json: incomplete, ignored
    assert C.latest_checkpoint(tmp_path) == C.step_dir(tmp_path, 4)
    C.prune_checkpoints(tmp_path, keep_last=2)
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [3, 4]


def test_training_files_roundtrip_with_weights_only(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    rng = C.capture_rng()
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    C.save_training_files(tmp_path, optimizer_state=opt.state_dict(), schedule_state={"step": 1},
                          rng_states=[rng], meta={"step": 1})
    optim, schedule, rngs, meta = C.load_training_files(tmp_path)  # torch.load(weights_only=True) inside
    assert schedule == {"step": 1} and meta == {"step": 1}
    assert torch.equal(optim["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    C.restore_rng(rngs[0])
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_metrics_jsonl_resume_truncates_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, enabled=True)
    for s in range(1, 6):
        log.log(s, {"train/loss": 1.0 / s, "train/acc": [0.1 * s, 0.05 * s]})
    log.close()
    log = MetricsLogger(tmp_path, enabled=True, resume_step=3)
    log.log(4, {"train/loss": 0.2, "train/acc": [0.5, 0.3], "val/loss": 0.3, "val/acc": [0.4, 0.2]})
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["train/loss"] == 0.2
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert plot_metrics(tmp_path).read_bytes()[:4] == b"\x89PNG"
    assert any((tmp_path / "tb").iterdir())
