"""Shared fixtures: the embedded verifier and tiny random Llama / Qwen3 verifiers.

Tiny verifiers are real ``transformers`` models saved as Hugging Face folders (so every stage
loads them through the same ``from_pretrained`` path as a hub model) with the embedded verifier's
tokenizer and chat template. 8 layers put the default EAGLE-3 aux layers at 2, 4 and 5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_LAYERS = 8


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct verifier as a cached fp32 Hugging Face folder."""
    from tiny_speculators.verifier.embedded import embedded_verifier_dir

    return embedded_verifier_dir("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_tiny_verifier(path: Path, arch: str, tokenizer, seed: int = 0, num_layers: int = TINY_LAYERS) -> Path:
    """Save a tiny random ``arch`` ("llama" or "qwen3") causal LM with ``tokenizer`` into ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so that tiny models have peaked distributions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", smollm2_tokenizer, seed=1)
