"""Fixtures for the training tests: tiny inputs built through the real stages (``train_inputs.py``).

``tiny_inputs`` is a :class:`~train_inputs.TrainInputs` with the prepared folder (online mode), the vocab folder
and the hidden-state folder (offline mode), cached for the session.
"""

from __future__ import annotations

import pytest
from train_inputs import TrainInputs, build_inputs


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory, tiny_llama_dir) -> TrainInputs:
    """8 chats (~60 tokens each) on the tiny random Llama verifier; draft vocab 256."""
    return build_inputs(tmp_path_factory.mktemp("train-inputs"), tiny_llama_dir, n_chats=8, vocab_size=256,
                        max_length=96)
