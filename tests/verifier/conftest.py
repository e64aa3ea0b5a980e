"""Fixtures for verifier tests: prepared-dataset folders in the prepare stage's format, made directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from prepared_data import make_prepared


@pytest.fixture(scope="session")
def tiny_vocab(smollm2_tokenizer) -> int:
    return len(smollm2_tokenizer)


@pytest.fixture(scope="session")
def prepared_llama(tmp_path_factory, tiny_llama_dir, tiny_vocab) -> Path:
    """12 samples of 3..30 tokens for the tiny Llama verifier."""
    lengths = [3, 17, 30, 8, 25, 12, 5, 29, 19, 1, 22, 14]
    return make_prepared(tmp_path_factory.mktemp("prepared-llama"), str(tiny_llama_dir), tiny_vocab, lengths)


class _VisionTower:
    """A stand-in vision tower: its own embeddings, layer list and norm, to distract the module search."""

    @staticmethod
    def build():
        from torch import nn

        tower = nn.Module()
        tower.position_embedding = nn.Embedding(16, 32)
        tower.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
        tower.post_layernorm = nn.LayerNorm(32)
        return tower


class _Wrapper(nn.Module):
    """A multimodal wrapper's text path, as the real ones run it: decoder, (outer) norm, head at the kept positions."""

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        from types import SimpleNamespace

        if hasattr(self, "language_model"):  # "old": a whole causal LM inside
            return self.language_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache,
                                       logits_to_keep=logits_to_keep)
        hidden = self.model.language_model(input_ids=input_ids, attention_mask=attention_mask,
                                           use_cache=use_cache).last_hidden_state
        if hasattr(self, "norm"):
            hidden = self.norm(hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return SimpleNamespace(logits=self.lm_head(hidden[:, keep]))


def wrap_model(causal_lm, style: str):
    """Wrap a Llama/Qwen3 causal LM the way multimodal models are laid out.

    - "new": ``model.model.language_model.layers`` with ``lm_head`` on the wrapper (Llava in transformers 5)
    - "old": ``model.language_model.model.layers`` (a whole causal LM inside the wrapper)
    - "outer-norm": like "new" but the final norm lives on the wrapper, not next to the layers
    """
    wrapper = _Wrapper()
    wrapper.config = causal_lm.config
    if style == "old":
        wrapper.vision_tower = _VisionTower.build()
        wrapper.language_model = causal_lm
        return wrapper
    wrapper.model = nn.Module()
    wrapper.model.vision_tower = _VisionTower.build()
    wrapper.model.language_model = causal_lm.model
    wrapper.lm_head = causal_lm.lm_head
    if style == "outer-norm":
        wrapper.norm = causal_lm.model.norm
        causal_lm.model.norm = nn.Identity()
    return wrapper


@pytest.fixture
def wrap():
    return wrap_model


@pytest.fixture(scope="session")
def prepared_factory():
    """``make_prepared(path, verifier, vocab_size, lengths, seed=0, summary_vocab=None)``."""
    return make_prepared
