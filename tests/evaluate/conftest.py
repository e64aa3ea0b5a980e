"""Fixtures for the evaluate tests: a small-vocab verifier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def small_vocab_verifier(tmp_path_factory) -> Path:
    """A 2-layer random Llama with a 16-token vocabulary (for distribution tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Decoding runs many tiny ops: on a shared 2-core machine one intra-op thread is several times faster
    than two (thread hand-offs stall under load). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
