"""``extract --backend vllm`` on mixture-of-experts verifiers (the tiny Qwen3-MoE: 8 experts, top-2, as
Qwen3-30B-A3B; the tiny gpt-oss: attention sinks, sliding and full layers alternating): vLLM's states equal the HF
backend's within fp32 rounding, and the guard checked each sample against vLLM's own next token. A module of its own
so that it can run beside the embedded verifier's vLLM extraction."""

from __future__ import annotations

import pytest
import torch

from prepared_data import make_prepared
from tiny_architectures import make_tiny_architecture
from tiny_speculators.storage.reader import HiddenStateReader
from tiny_speculators.verifier.extract import extract

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RTOL_OF_MAX = 2e-4  # vLLM's kernels against HF's: fp32 rounding (measured 3.9e-7 here)
LENGTHS = (5, 30, 17)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_vllm_states_of_a_moe_verifier_equal_hf(name, vllm_venv, tmp_path, smollm2_tokenizer):
    verifier = make_tiny_architecture(tmp_path / name, name, smollm2_tokenizer)
    prepared = make_prepared(tmp_path / "prepared", str(verifier), len(smollm2_tokenizer), list(LENGTHS))
    common = dict(data=prepared, dtype="float32", device="cpu", progress=False)
    summary = extract(out=tmp_path / "vllm", backend="vllm", vllm_venv=vllm_venv, **common)
    assert summary["complete"] and summary["guard_positions"] == summary["guard_agreed"] == len(LENGTHS)
    extract(out=tmp_path / "hf", **common)
    hf, vllm = HiddenStateReader(tmp_path / "hf"), HiddenStateReader(tmp_path / "vllm")
    assert len(vllm) == len(hf) == len(LENGTHS)
    for i in range(len(hf)):
        for key in ("aux_hidden_states", "last_hidden_state"):
            ref = hf[i][key]
            torch.testing.assert_close(vllm[i][key], ref, rtol=0, atol=RTOL_OF_MAX * ref.abs().max().item())
