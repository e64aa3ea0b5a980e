"""Every YAML in configs/ plans as a pipeline, each of its options reaching its stage with the value it wrote; a wrong
key or value in a config is one line naming it; the shipped train prompts are held out from evaluation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tiny_speculators.cli import main
from tiny_speculators.config import load_yaml, option_sections, stage_params
from tiny_speculators.options import coerce, parse_options
from tiny_speculators.pipeline import STAGE_ORDER, plan_pipeline
from tiny_speculators.stages import load_stage

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
RESOURCES = ROOT / "src" / "tiny_speculators" / "resources"


def test_the_ready_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"smollm2-135m.yaml", "qwen3-8b.yaml", "llama-3.1-8b.yaml", "qwen3-30b-a3b.yaml"} <= names


def _as_planned(name: str, key: str, value, func) -> object:
    """What the stage should be called with for ``key: value`` of its section: the value converted to the
    parameter's type (a family's options to their dataclass), a relative path taken from where the run starts."""
    sections = option_sections(func)
    if key in sections:
        return parse_options(sections[key], value, key)
    expected = coerce(value, stage_params(func)[key][1], key)
    if isinstance(expected, Path) and not expected.is_absolute():
        return Path.cwd() / expected
    if key == "prompts" and name in ("evaluate", "benchmark") and Path(str(value)).suffix:  # a prompt file
        return str(Path.cwd() / str(value))
    return expected


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_plans_and_each_option_reaches_its_stage(path):
    """The pipeline's own planning of the file (every section bound to its stage's signature, nothing run), then
    every option the file sets is in that stage's arguments with the value the file gives."""
    raw = load_yaml(path)
    plan = plan_pipeline(raw, path.name)
    run_dir = Path.cwd() / raw["run_dir"]
    for name in STAGE_ORDER:
        if name not in raw:
            continue
        stage, func = plan.stages[name], load_stage(name)
        assert stage.out == run_dir / name
        if "verifier" in stage_params(func):
            assert stage.kwargs["verifier"] == raw["verifier"], name
        for key, value in (raw[name] or {}).items():
            if key == "data":  # the user's chat files: resolved to paths (builtin:train to the packaged set)
                assert stage.kwargs["data"] and all(isinstance(p, Path) for p in stage.kwargs["data"])
                continue
            assert stage.kwargs[key] == _as_planned(name, key, value, func), f"{path.name} [{name}] {key}"


# (edit of configs/smollm2-135m-dflash.yaml (None: the section removed), how the error the user reads after
# "tiny-speculators pipeline: error: "
# starts: the config file's path, then the section)
BROKEN = [
    ({"train": {"max_step": 5}}, "{path} [train]: unknown option(s) max_step for 'train' (known: verifier, "),
    ({"train": {"max_steps": "many"}}, "{path} [train]: option 'max_steps' must be an integer, not 'many'"),
    ({"evaluate": {"k": 2.5}}, "{path} [evaluate]: option 'k' must be an integer, not 2.5"),
    ({"extract": {"layout": "fp7"}}, "{path} [extract]: option 'layout' must be one of full, fp8, topk, "
                                     "fp8-topk, not 'fp7'"),
    ({"train": {"dflash": {"block_size": "four"}}}, "{path} [train]: option 'dflash'.block_size must be an "
                                                    "integer, not 'four'"),
    ({"train": {"dflash": {"block_sizes": 4}}}, "{path} [train]: option 'dflash': unknown option(s) "
                                                "block_sizes (known: block_size, "),
    ({"vocabulary": {"size": 10}}, "{path}: unknown option(s) vocabulary for 'pipeline' (known: config, "),
    ({"evaluate": None}, "{path}: needs an 'evaluate' section (it may be empty: evaluate: {{}}), or a "
                         "'benchmark' "),
]


@pytest.mark.parametrize(("edit", "message"), BROKEN, ids=["key", "type", "float", "choice", "family-type",
                                                           "family-key", "section", "no-measure"])
def test_a_wrong_key_or_value_is_the_one_line_error_the_user_sees(tmp_path, capsys, edit, message):
    config = yaml.safe_load((ROOT / "configs" / "smollm2-135m-dflash.yaml").read_text(encoding="utf-8"))
    config["run_dir"] = str(tmp_path / "run")
    config["regenerate"]["data"] = [str(tmp_path / "missing.jsonl")]  # were the error missed: fail fast, not run
    for section, options in edit.items():
        if options is None:  # the section removed
            del config[section]
            continue
        target = config.setdefault(section, {})
        for key, value in options.items():
            if isinstance(value, dict):
                target[key] = {**target.get(key, {}), **value}
            else:
                target[key] = value
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["pipeline", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tiny-speculators pipeline: error: " + message.format(path=path)), err
    assert err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


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
