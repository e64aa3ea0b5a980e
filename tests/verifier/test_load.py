"""The embedded verifier loads offline from its cache and generates as the dequantized GGUF does."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.embedded import EMBEDDED, find_gguf
from tiny_speculators.verifier.load import load_verifier, resolve_verifier, verifier_id

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(model, tokenizer, n=16):
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_embedded_cache_is_plain_hf_folder(smollm2_dir):
    source = json.loads((smollm2_dir / "source.json").read_text())
    assert source["hf_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (smollm2_dir / "model.safetensors").is_file()
    assert resolve_verifier("smollm2-135m") == str(smollm2_dir)
    assert verifier_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_embedded_matches_dequantized_gguf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_verifier("smollm2-135m")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tokenizer.chat_template
    gguf = find_gguf(EMBEDDED["smollm2-135m"])
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ours = _greedy(model, tokenizer)
    assert ours == _greedy(reference, tokenizer)
    assert tokenizer.decode(ours).strip().startswith("The capital of France is Paris")


def test_missing_local_verifier_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_verifier(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        resolve_verifier(tmp_path / "empty")


def _copy_with_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_quantized_and_unknown_verifiers_fail_in_one_line(tmp_path, tiny_llama_dir):
    quantized = _copy_with_config(tiny_llama_dir, tmp_path / "w8a8", quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized"})
    with pytest.raises(UserError, match=r"^verifier '.*w8a8' is a compressed-tensors checkpoint, .*--backend vllm"):
        load_verifier(quantized, with_tokenizer=False)
    unknown = _copy_with_config(tiny_llama_dir, tmp_path / "unknown", model_type="no-such-model",
                                architectures=["NoSuchModelForCausalLM"])
    with pytest.raises(UserError, match=r"^could not load verifier '.*unknown': .*no-such-model") as e:
        load_verifier(unknown, with_tokenizer=False)
    assert "\n" not in str(e.value)
