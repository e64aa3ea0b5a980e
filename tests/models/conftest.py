"""Fixtures for the draft-model tests; helpers live in draft_fixtures.py."""

import pytest
from draft_fixtures import fixed_init, tiny_kwargs

from tiny_speculators.models.eagle3.model import Eagle3Draft


@pytest.fixture
def tiny_draft():
    return fixed_init(Eagle3Draft(**tiny_kwargs()))
