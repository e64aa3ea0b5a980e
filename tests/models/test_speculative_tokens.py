"""How every family chooses k (draft tokens per step) for export, evaluate and benchmark, and what each format's
config records without its weights."""

from __future__ import annotations

import pytest

from tiny_speculators.models import FAMILIES, get_family
from tiny_speculators.models.family import DEFAULT_SPECULATIVE_TOKENS


@pytest.mark.parametrize("name", list(FAMILIES))
def test_k_is_the_users_else_the_records_else_the_trainings_else_the_default(name):
    family = get_family(name)
    trained = {"trained_with": {"algorithm": name, "mode": "offline"}}  # the family's default options
    from_training = family.speculative_tokens(family.options())
    assert family.resolve_speculative_tokens({}) == DEFAULT_SPECULATIVE_TOKENS
    assert family.resolve_speculative_tokens({}, default=1) == 1
    assert family.resolve_speculative_tokens(trained) == from_training
    assert family.resolve_speculative_tokens({**trained, "speculative_tokens": 7}) == 7
    assert family.resolve_speculative_tokens({**trained, "speculative_tokens": 7}, given=2) == 2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_format_records_a_verifier_without_weights(name, tmp_path):
    for fmt in get_family(name).formats:
        record = fmt.recorded(tmp_path, {})
        assert "verifier" in record and "speculative_tokens" not in record, fmt.name
