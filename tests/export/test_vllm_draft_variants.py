"""Drafts beyond the embedded verifier's proofs, each decoding losslessly in vLLM with exactly our evaluator's
counters: the parallel-drafting families on a mixture-of-experts verifier (the tiny Qwen3-MoE: 8 experts, top-2, as
Qwen3-30B-A3B), as the EAGLE-3 draft does in test_vllm.py, and a sliding-window EAGLE-3 draft. A module of its own
so that it runs beside that one."""

from __future__ import annotations

import json

import pytest
from vllm_helpers import counters, our_acceptance, train_draft

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 3
NEW_TOKENS = 32
AUX = [2, 4, 5]
FAMILIES = {"peagle": {"depths": K}, "dflash": {"block_size": K + 1, "anchors": 16}}


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_counts_what_we_count_for_a_moe_verifiers_parallel_draft(family, vllm_worker, tmp_path,
                                                                       smollm2_tokenizer):
    from tiny_architectures import make_tiny_architecture
    from tiny_speculators.export import export, import_draft
    from tiny_speculators.models import get_family

    moe = make_tiny_architecture(tmp_path / "qwen3-moe", "qwen3_moe", smollm2_tokenizer)
    ckpt = train_draft(moe, tmp_path / "ckpt", algorithm=family, options=FAMILIES[family], steps=30, lr=5e-3,
                       new_tokens=24, verifier_name=str(moe), aux_layer_ids=AUX, draft_vocab=family != "dflash")
    export(ckpt, out=tmp_path / "export", verifier_name=str(moe), speculative_tokens=K)
    draft, config = import_draft(tmp_path / "export")
    ours = our_acceptance(get_family(family).proposer(draft.eval()), config["aux_layer_ids"], moe, smollm2_tokenizer,
                          K, NEW_TOKENS)
    (tmp_path / "prompts.json").write_text(json.dumps(ours["prompts"]))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(tmp_path / "prompts.json"), "--max-tokens", str(NEW_TOKENS), "--max-model-len", "512")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["architectures"]["target"] == ["Qwen3MoeForCausalLM"]
    assert spec["tokens"] == ours["hf_tokens"] == ours["spec_tokens"]
    assert counters(spec) == (ours["drafts"], ours["accepted"], ours["per_position"]), ours
    assert ours["accepted"] >= 10, "the test draft did not train: the comparison would mean nothing"


def test_vllm_counts_what_we_count_for_a_sliding_window_draft(vllm_worker, tmp_path, tiny_qwen3_dir,
                                                               smollm2_tokenizer):
    """An EAGLE-3 draft whose layer attends to the last 8 positions only (``eagle3: {sliding_window: 8}``): vLLM
    reads the window from the exported config (``layer_types``) and its counters equal ours over 48 tokens past
    prompts of ~30, where the window cuts off most of the context."""
    from tiny_speculators.export import export, import_draft
    from tiny_speculators.models.eagle3.proposer import Eagle3Proposer

    ckpt = train_draft(tiny_qwen3_dir, tmp_path / "ckpt", options={"sliding_window": 8}, steps=30, lr=5e-3,
                       new_tokens=48, verifier_name=str(tiny_qwen3_dir), aux_layer_ids=AUX)
    export(ckpt, out=tmp_path / "export", verifier_name=str(tiny_qwen3_dir), speculative_tokens=K)
    layer = json.loads((tmp_path / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 8
    draft, config = import_draft(tmp_path / "export")
    assert draft.kwargs["sliding_window"] == 8
    ours = our_acceptance(Eagle3Proposer(draft.eval()), config["aux_layer_ids"], tiny_qwen3_dir, smollm2_tokenizer,
                          K, 48)
    (tmp_path / "prompts.json").write_text(json.dumps(ours["prompts"]))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(tmp_path / "prompts.json"), "--max-tokens", "48", "--max-model-len", "512")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["tokens"] == ours["hf_tokens"] == ours["spec_tokens"]
    assert counters(spec) == (ours["drafts"], ours["accepted"], ours["per_position"]), ours
    assert ours["accepted"] >= 10, "the test draft did not train: the comparison would mean nothing"
