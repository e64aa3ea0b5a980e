"""capture_hidden_states equals Hugging Face's output_hidden_states, with padding and batching changing nothing."""

from __future__ import annotations

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.capture import capture_hidden_states, check_layer_ids, default_aux_layer_ids
from tiny_speculators.verifier.load import load_verifier
from tiny_speculators.verifier.modules import find_parts

ATOL = 1e-5


def _reference(model, ids: torch.Tensor, layer_ids: list[int]):
    """Unpadded single-sequence forward: (aux (T, n*H), logits (T, V)) from output_hidden_states."""
    out = model(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layer_ids], -1), out.logits[0]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_capture_matches_output_hidden_states_with_padding(request, fixture):
    model = load_verifier(request.getfixturevalue(fixture), with_tokenizer=False)[0]
    parts = find_parts(model)
    layer_ids = [2, 4, 5]
    torch.manual_seed(0)
    lengths = [11, 4, 7]
    seqs = [torch.randint(0, 49152, (n,)) for n in lengths]
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    aux, last = capture_hidden_states(model, ids, mask, layer_ids, parts=parts)
    assert aux.shape == (3, 11, 3 * 64) and last.shape == (3, 11, 64)
    for row, s in enumerate(seqs):
        ref_aux, ref_logits = _reference(model, s, layer_ids)
        n = len(s)
        torch.testing.assert_close(aux[row, :n], ref_aux, atol=ATOL, rtol=0)
        with torch.inference_mode():
            logits = parts.lm_head(parts.norm(last[row, :n]))
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    # aux order follows the requested order, not sorted; our hooks are removed afterwards
    hooks_before = [(len(x._forward_pre_hooks), len(x._forward_hooks)) for x in parts.layers]
    aux_rev, _ = capture_hidden_states(model, ids, mask, [5, 2], parts=parts)
    torch.testing.assert_close(aux_rev[..., :64], aux[..., 128:], atol=0, rtol=0)
    assert [(len(x._forward_pre_hooks), len(x._forward_hooks)) for x in parts.layers] == hooks_before


@pytest.mark.parametrize("style", ["new", "old", "outer-norm"])
def test_capture_on_wrapped_model(tiny_llama_dir, wrap, style):
    model = load_verifier(tiny_llama_dir, with_tokenizer=False)[0]
    ids = torch.randint(0, 49152, (1, 9))
    ref_aux, ref_logits = _reference(model, ids[0], [2, 4, 5])
    wrapped = wrap(model, style)
    aux, last = capture_hidden_states(wrapped, ids, torch.ones_like(ids), [2, 4, 5])
    parts = find_parts(wrapped)
    torch.testing.assert_close(aux[0], ref_aux, atol=ATOL, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(parts.lm_head(parts.norm(last[0])), ref_logits, atol=ATOL, rtol=0)


def test_layer_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(8) == [2, 4, 5]
    assert check_layer_ids([0, 7], 8) == [0, 7]
    with pytest.raises(UserError, match=r"out of range.*0\.\.7"):
        check_layer_ids([2, 8], 8)
    with pytest.raises(UserError, match="duplicates"):
        check_layer_ids([2, 2], 8)
    with pytest.raises(UserError, match="too shallow"):
        default_aux_layer_ids(3)
