"""Packing (one row, document ids) computes the same loss and metrics as right padding on the same samples."""

from __future__ import annotations

import torch

from tiny_speculators.models.eagle3.objective import TTTModule
from tiny_speculators.models.ttt import step_counts


def test_packed_equals_padded(tiny_inputs):
    from tiny_speculators.data.vocab import load_vocab
    from tiny_speculators.models.eagle3.family import build_draft, draft_kwargs_from_verifier
    from tiny_speculators.train.sources import OfflineSource
    from tiny_speculators.verifier.head import load_verifier_head

    head = load_verifier_head(str(tiny_inputs.verifier))
    d2t, t2d = load_vocab(tiny_inputs.vocab)
    torch.manual_seed(0)
    draft = build_draft(draft_kwargs_from_verifier(head.config, len(d2t)), torch.as_tensor(d2t),
                        torch.as_tensor(t2d), embed_weight=head.embed_weight)
    module = TTTModule(draft, head.target_head, steps=3, decay=0.8, attention="sdpa")
    source = OfflineSource(tiny_inputs.hidden_states)
    padded = source.batch([0, 1, 2], torch.device("cpu"), pack=False)
    packed = source.batch([0, 1, 2], torch.device("cpu"), pack=True)
    assert torch.equal(step_counts(padded, 3), step_counts(packed, 3))
    norm = step_counts(padded, 3).float()
    a, b = module(padded, norm), module(packed, norm)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    for k in ("count", "correct", "cond_correct", "cond_count"):
        assert torch.equal(a.metrics[k], b.metrics[k]), k
    ga = torch.autograd.grad(a.loss, draft.fc.weight)[0]
    gb = torch.autograd.grad(b.loss, draft.fc.weight)[0]
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)
