"""Every YAML in configs/ is valid for its stages, and the shipped train prompts are held out from evaluation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tiny_speculators.cli import STAGES, StageNotBuilt, load_stage
from tiny_speculators.config import bind, load_yaml
from tiny_speculators.pipeline import STAGE_ORDER, WIRED, plan_pipeline

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
RESOURCES = ROOT / "src" / "tiny_speculators" / "resources"


def test_the_ready_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"smollm2-135m.yaml", "qwen3-8b.yaml", "llama-3.1-8b.yaml", "qwen3-30b-a3b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_binds_to_its_stage_functions(path):
    raw = load_yaml(path)
    not_built = []
    for name in STAGE_ORDER:
        if name not in raw:
            continue
        try:
            func = load_stage(name)
        except StageNotBuilt:
            not_built.append(name)
            continue
        section = dict(raw[name] or {})
        # the pipeline wires these; stand-ins let bind check every other option against the signature
        stand_ins = {key: "x" if key == "verifier" else Path("x") for key in WIRED[name]}
        if name in ("regenerate", "prepare"):  # data: the user's files, or regenerate's output
            stand_ins["data"] = [Path("x")]
            section.pop("data", None)
        if name == "train":
            stand_ins.pop("hidden_states" if section.get("online") else "data")
        bind(func, {**section, **stand_ins}, source=f"{path.name} [{name}]")
    if not_built:
        pytest.skip(f"{path.name}: stages not built yet: {', '.join(not_built)}")
    plan = plan_pipeline(raw, str(path))  # the pipeline's own wiring of the same file
    assert set(plan.stages) <= set(STAGE_ORDER) and "pipeline" in STAGES


def test_configs_comment_on_disk_memory_and_mode():
    for path in CONFIGS:
        text = path.read_text(encoding="utf-8").lower()
        assert "disk" in text and "memory" in text and "online" in text and "offline" in text, path.name


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _user_text(record: dict) -> str:
    return " ".join(m["content"] for m in record["messages"] if m["role"] == "user")


def test_train_prompts_are_valid_varied_and_held_out_from_the_eval_sets():
    from tiny_speculators.data.readers import read_records

    path = RESOURCES / "prompts" / "train.jsonl"
    records = list(read_records([path]))
    assert not [r.where for r in records if r.error is not None]
    assert len(records) >= 300
    assert all(r.messages[-1]["role"] == "user" for r in records)  # prompts: regenerate writes the answers
    assert sum(r.messages[0]["role"] == "system" for r in records) >= 20
    assert sum(sum(m["role"] == "user" for m in r.messages) > 1 for r in records) >= 20
    texts = [_user_text({"messages": r.messages}) for r in records]
    assert len(set(texts)) == len(texts)

    eval_records = [json.loads(line) for f in sorted((RESOURCES / "eval_prompts").glob("*.jsonl"))
                    for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert eval_records, "the built-in eval sets are missing"
    for e in eval_records:
        ew = _words(_user_text(e))
        for t in texts:
            tw = _words(t)
            overlap = len(tw & ew) / len(tw | ew)
            assert overlap < 0.7, f"train prompt {t!r} is too close to eval prompt {_user_text(e)!r}"
