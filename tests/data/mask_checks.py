"""Token-by-token loss-mask checks shared by the chat, tool and reasoning tests (imported, not collected)."""

from __future__ import annotations


def runs(tokenizer, sample) -> list[tuple[str, int]]:
    """Maximal runs of equal mask value, each decoded to text (token by token, nothing skipped)."""
    out: list[tuple[list[int], int]] = []
    for token, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if out and out[-1][1] == m:
            out[-1][0].append(token)
        else:
            out.append(([token], m))
    return [(tokenizer.decode(ids, clean_up_tokenization_spaces=False), m) for ids, m in out]


def check(tokenizer, sample, pieces, masked_parts):
    """``pieces``: expected (text, mask) runs; ``masked_parts``: texts whose tokens, in order, are the masked ids."""
    assert len(sample.input_ids) == len(sample.loss_mask)
    assert set(sample.loss_mask) <= {0, 1}
    assert runs(tokenizer, sample) == pieces
    assert "".join(text for text, _ in pieces) == sample.text
    expected_ids = [i for part in masked_parts for i in tokenizer.encode(part, add_special_tokens=False)]
    assert [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == expected_ids
    assert sample.input_ids == tokenizer.encode(sample.text, add_special_tokens=False)  # one tokenization
