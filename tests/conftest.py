"""Shared fixtures: the embedded verifier and tiny random Llama / Qwen3 / MiMo (Qwen2 + an MTP layer) verifiers.

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


def make_tiny_mimo(path: Path, tokenizer, seed: int = 2, num_layers: int = TINY_LAYERS) -> Path:
    """A tiny random MiMo-style verifier: a Qwen2 model saved as ``MiMoForCausalLM`` with one MTP layer
    (``model.mtp_layers.0.*``, random) added to its safetensors, as vLLM's ``mimo_mtp`` loads it."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    g = torch.Generator().manual_seed(seed + 100)
    h, i, kv = 64, 128, 32
    shapes = {"token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,), "input_proj.weight": (h, 2 * h),
              "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (h, h),
              "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
              "final_layernorm.weight": (h,)}
    state = load_file(str(path / "model.safetensors"))
    for name, shape in shapes.items():
        value = (1.0 + 0.1 * torch.randn(shape, generator=g)) if name.endswith("norm.weight") else \
            0.08 * torch.randn(shape, generator=g)
        state[f"model.mtp_layers.0.{name}"] = value
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_mimo_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return make_tiny_mimo(tmp_path_factory.mktemp("tiny-mimo"), smollm2_tokenizer)
