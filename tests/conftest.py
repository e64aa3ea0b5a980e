"""Shared fixtures: the embedded verifier and tiny random Llama / Qwen3 / MiMo (Qwen2 + an MTP layer) verifiers.

Tiny verifiers are real ``transformers`` models saved as Hugging Face folders (so every stage
loads them through the same ``from_pretrained`` path as a hub model) with the embedded verifier's
tokenizer and chat template. 8 layers put the default EAGLE-3 aux layers at 2, 4 and 5.

The vLLM environment (``vllm_venv``) is the one fixture every vLLM test uses: when vLLM tests are selected its build
starts in the background once collection ends and those tests run last, so the build overlaps with the others
(``vllm_env.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tiny_architectures import save_peaked

TINY_LAYERS = 8


MAX_WORKERS = 3  # each worker may hold a vLLM server with its KV cache (2-4 GiB) beside a tiny training run


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker more than there are cores, at most :data:`MAX_WORKERS`. The vLLM
    tests spend much of their time waiting (process starts, servers answering), so a third worker on two cores
    keeps both busy: the README's test command took 18:47 with three workers against 23:00 with two (dev/LOG.md)."""
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 1) + 1))


def xdist_workers() -> int:
    """How many pytest-xdist workers share this machine (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


if xdist_workers() > 1:  # each worker (and what it starts) gets its share of the cores, not all of them each
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // xdist_workers())))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Every vLLM engine the tests start (servers, extraction, producers, the helpers' engines) gets 1 GiB of KV cache,
# not the 2-4 GiB the stages default to: three workers may each hold engines at once, and a run here once had 2.9 of
# 23.5 GiB free when test_vllm_extract's engine asked for 4 (dev/LOG.md, session 32). A 1024-token window of the
# embedded verifier takes ~47 MB (30 layers x 3 KV heads x 64 x K and V in fp32); the tiny models' far less.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


DURATIONS = Path(__file__).parent / "durations.json"  # each module's seconds on a full run here (dev/durations.py)


def pytest_collection_modifyitems(config, items):
    """vLLM tests last, so that the vLLM environment builds while the CPU tests run; within each phase the longest
    modules first (``durations.json``; a module not in it counts as short), so that no worker starts a long module
    when the other is nearly done.

    Under ``-n N --dist loadfile --no-loadscope-reorder`` (pyproject's addopts) a test module runs on one worker, as
    one piece, in this order: a module holds vLLM tests or CPU tests, never both, or its CPU tests would wait for the
    environment's build.
    """
    root = Path(__file__).parent
    kinds: dict[Path, set[bool]] = {}
    for item in items:
        kinds.setdefault(Path(str(item.path)), set()).add(item.get_closest_marker("vllm") is not None)
    mixed = sorted(str(path.relative_to(root)) for path, kind in kinds.items() if len(kind) > 1)
    if mixed:
        raise pytest.UsageError(f"{', '.join(mixed)}: vllm-marked and CPU tests in one module; move the CPU ones to a "
                                "module of their own (tests/conftest.py says why)")
    seconds = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}

    def cost(item) -> float:
        path = Path(str(item.path))
        return seconds.get(path.relative_to(root).as_posix(), 0.0) if path.is_relative_to(root) else 0.0

    items.sort(key=lambda item: (item.get_closest_marker("vllm") is not None, -cost(item)))  # stable: modules whole


def pytest_collection_finish(session):
    """When vLLM tests are selected, start the vLLM environment's build (in each xdist worker that has some: the
    script's lock makes the second wait for the first, then find it finished)."""
    import vllm_env

    if not vllm_env.skip_requested() and any(item.get_closest_marker("vllm") for item in session.items):
        vllm_env.start_build()


def pytest_sessionfinish(session, exitstatus):
    import vllm_env

    vllm_env.stop_build()


@pytest.fixture(scope="session", autouse=True)
def _shared_cache_root(tmp_path_factory) -> None:
    """``shared_cache``'s folder: one for the whole run, in the pytest root that the xdist workers' own folders are
    in, so that what one worker built the others read."""
    import shared_cache

    base = tmp_path_factory.getbasetemp()
    os.environ[shared_cache.ROOT_ENV] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")


@pytest.fixture(scope="session", autouse=True)
def _vllm_in_one_process() -> None:
    """The vLLM processes the tests start run in one process (``vllm_env.IN_ONE_PROCESS``); a test that proves none
    outlives its stop opts out with ``vllm_env.multi_process()``."""
    import vllm_env

    for key, value in vllm_env.IN_ONE_PROCESS.items():
        os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM environment of ``scripts/vllm_env.sh`` (vLLM, GuideLLM, and Mooncake where this environment imports
    it), waited for if its background build is still running; ``TINY_SPECULATORS_SKIP_VLLM=1`` skips."""
    import vllm_env

    if vllm_env.skip_requested():
        pytest.skip(f"{vllm_env.SKIP_ENV} is set: the vllm-cpu checks are skipped")
    try:
        return vllm_env.start_build().wait()
    except RuntimeError as e:
        pytest.fail(str(e))


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
    save_peaked(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, path)
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
    save_peaked(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, path)
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


def make_tiny_deepseek(path: Path, tokenizer, seed: int = 3, num_layers: int = 2) -> Path:
    """A tiny random DeepSeek-V3 verifier (MLA with head dims 32, 4 routed experts in 2 groups + 1 shared, layer 0
    dense) with one MTP layer ``model.layers.{N}.*`` (enorm, hnorm, eh_proj, an MoE decoder layer, shared_head.norm,
    shared_head.head = the verifier's lm_head, embed_tokens) added to its safetensors, as DeepSeek-V3 ships it."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    save_peaked(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, path)
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 100)
    n, h = num_layers, 64
    src = f"model.layers.{n - 1}."  # an MoE decoder layer of the verifier's shapes, re-drawn for the MTP layer
    layer = {k.removeprefix(src): v for k, v in state.items() if k.startswith(src)}
    layer.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                  "shared_head.norm.weight": (h,)})
    for name, value in layer.items():
        shape = value if isinstance(value, tuple) else tuple(value.shape)
        if name.endswith("e_score_correction_bias"):
            drawn = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("norm.weight"):
            drawn = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            drawn = 0.08 * torch.randn(shape, generator=g)
        state[f"model.layers.{n}.{name}"] = drawn
    state[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1, scoring_func="sigmoid",
               topk_method="noaux_tc", moe_layer_freq=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return make_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), smollm2_tokenizer)



@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen3_vl"])
def tiny_vl_dir(request, tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Qwen2.5-VL, then Qwen3-VL verifier with its (image-only) processor (``tiny_vl.py``)."""
    from tiny_vl import make_tiny_vl

    return make_tiny_vl(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, smollm2_tokenizer)
