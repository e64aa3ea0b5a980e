"""The shape a draft takes from its verifier: the MLP width of mixture-of-experts verifiers (the width they run per
token), checked on the published configs' numbers through the real transformers config classes."""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tiny_speculators.models.eagle3.family import Eagle3Options, draft_kwargs_from_verifier
from tiny_speculators.models.shape import mlp_width, verifier_shape


@pytest.mark.parametrize(("config", "width"), [
    (LlamaConfig(intermediate_size=14336), 14336),  # dense: its own width
    (Qwen3MoeConfig(intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
     8 * 768),  # Qwen3-30B-A3B
    (GptOssConfig(intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4), 4 * 2880),  # gpt-oss-20b
    (DeepseekV3Config(intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                      num_experts_per_tok=8), 8 * 2048 + 2048),  # DeepSeek-V3, Kimi-K2
    (MixtralConfig(intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2), 2 * 14336),
    (Qwen2MoeConfig(intermediate_size=5632, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                    shared_expert_intermediate_size=5632), 4 * 1408 + 5632),  # Qwen1.5-MoE-A2.7B
])
def test_mlp_width_is_what_the_verifier_runs_per_token(config, width):
    assert mlp_width(config) == width
    assert mlp_width(config.to_dict()) == width  # a config.json read as a dict gives the same
    assert verifier_shape(config, 8)["intermediate_size"] == width


def test_the_width_can_be_set():
    config = GptOssConfig(intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    assert draft_kwargs_from_verifier(config, 8, intermediate_size=4096)["intermediate_size"] == 4096
    assert Eagle3Options(intermediate_size=4096).intermediate_size == 4096
    with pytest.raises(ValueError, match="intermediate_size must be at least 1"):
        Eagle3Options(intermediate_size=0)
