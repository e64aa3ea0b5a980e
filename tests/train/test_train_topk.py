"""Offline training from extract's top-k layouts: the stored top-k replaces the verifier's last hidden state."""

from __future__ import annotations

import json
import math

import pytest

from tiny_speculators.train.stage import train
from tiny_speculators.verifier.extract import extract


@pytest.mark.parametrize("layout", ["topk", "fp8-topk"])
def test_topk_layout_trains_with_the_same_accuracy_metric(tiny_inputs, tmp_path, layout):
    """Before the first update the weights are equal, and the verifier's argmax is exact in any top-k, so the
    first step's per-position accuracy equals the full layout's; the KL (on top-k renormalized) differs."""
    hs = tmp_path / "hs"
    extract(verifier=str(tiny_inputs.verifier), data=tiny_inputs.prepared, out=hs, dtype="float32", device="cpu",
            layout=layout, topk=16, progress=False)
    common = dict(verifier=str(tiny_inputs.verifier), vocab=tiny_inputs.vocab, eval_fraction=0.0, lr=1e-2,
                  progress=False, seed=3, save_every=0, max_steps=2, batch_size=2, eagle3={"ttt_steps": 2})
    full = train(out=tmp_path / "full", hidden_states=tiny_inputs.hidden_states, **common)
    top = train(out=tmp_path / "top", hidden_states=hs, **common)
    first = {}
    for name, out in (("full", tmp_path / "full"), ("top", tmp_path / "top")):
        rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "train/acc" in r]
        first[name] = rows[0]
    assert first["top"]["train/positions"] == first["full"]["train/positions"] > 0
    if layout == "topk":  # fp8 aux states change the draft's input, hence its predictions
        assert first["top"]["train/acc"] == first["full"]["train/acc"]
    assert math.isfinite(top["final_train"]["loss"]) and top["final_train"]["loss"] != full["final_train"]["loss"]
    assert (tmp_path / "top" / "final" / "model.safetensors").is_file()
