"""Test helper: an extraction checked against the verifier's own forward (aux states = its ``hidden_states``,
last states through its final norm and head = its logits), in fp32 up to rounding."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.modules import find_parts

ATOL = 1e-5


def reference(model, ids: torch.Tensor, layer_ids: list[int]):
    with torch.inference_mode():
        out = model(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layer_ids], -1), out.logits[0]


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 equality up to rounding: |got - ref| <= 1e-5 x the tensor's largest magnitude (at least 1)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, atol=ATOL * max(1.0, ref.abs().max().item()), rtol=0)


def check_exact(reader: HiddenStateReader, model, prepared: Path, layer_ids: list[int]):
    import datasets

    ds = datasets.load_from_disk(str(prepared / "dataset"))
    parts = find_parts(model)
    assert len(reader) == len(ds)
    for i in range(len(ds)):
        got = reader[i]
        assert got["input_ids"].tolist() == ds[i]["input_ids"] and got["loss_mask"].tolist() == ds[i]["loss_mask"]
        ref_aux, ref_logits = reference(model, got["input_ids"], layer_ids)
        assert_close(got["aux_hidden_states"], ref_aux)
        with torch.inference_mode():
            logits = parts.lm_head(parts.norm(got["last_hidden_state"]))
        assert_close(logits, ref_logits)
