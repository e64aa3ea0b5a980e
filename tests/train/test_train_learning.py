"""Learning test on the embedded verifier: a short offline run lifts step-0 accuracy well above an untrained draft's."""

from __future__ import annotations

import json

import pytest
from train_inputs import build_inputs

from tiny_speculators.train.stage import train


@pytest.mark.slow
def test_training_raises_step0_accuracy(smollm2_dir, tmp_path):
    inputs = build_inputs(tmp_path / "in", smollm2_dir, n_chats=16, vocab_size=2048, max_length=128, long=True)
    out = tmp_path / "draft"
    summary = train(verifier=str(smollm2_dir), vocab=inputs.vocab, out=out, hidden_states=inputs.hidden_states,
                    max_steps=20, batch_size=4, lr=3e-3, warmup_steps=2, eval_fraction=0.2, eval_every=0,
                    eagle3={"ttt_steps": 2}, seed=0, progress=False, save_every=0)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    untrained = rows[0]["train/acc"][0]  # step 1's metrics are computed before the first update
    trained = summary["final_val"]["acc"][0]
    assert trained > untrained + 0.25, (untrained, trained)
    assert summary["final_val"]["accept_len"] > 1.2
    assert (out / "best" / "model.safetensors").is_file() and (out / "training.png").is_file()
