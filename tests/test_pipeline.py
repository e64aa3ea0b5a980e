"""``pipeline``: end to end on a tiny verifier; skip on rerun, change detection, --from/--until, README commands."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tiny_speculators.cli import main
from tiny_speculators.errors import UserError
from tiny_speculators.pipeline import STAGE_ORDER, pipeline, plan_pipeline, vllm_serve_command

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "src" / "tiny_speculators" / "resources" / "prompts" / "train.jsonl"
# every stage but the optional ones: synthesize, benchmark (needs the vLLM environment: tests/benchmark), promote
CORE = tuple(name for name in STAGE_ORDER if name not in ("synthesize", "benchmark", "promote"))

# per-stage options that make any config run in seconds on a tiny verifier
SHORT: dict[str, dict] = {
    "synthesize": {"count": 4, "batch_size": 4, "max_prompt_tokens": 6, "min_words": 0, "backend": "transformers",
                   "device": "cpu"},
    "regenerate": {"max_new_tokens": 6, "batch_size": 4, "max_records": 6},
    "prepare": {"max_length": 96},
    "vocab": {"size": 256},
    "extract": {"progress": False},
    "train": {"max_steps": 2, "epochs": 1, "save_every": 1, "eval_every": 0, "batch_tokens": None, "pack": False,
              "batch_size": 2, "progress": False, "warmup_steps": 0},
    "export": {},
    "evaluate": {"max_new_tokens": 6, "max_prompts": 1, "k": 2},
    "promote": {"max_new_tokens": 6, "max_prompts": 2, "k": 2, "resamples": 200},
}


def shorten(config: dict, verifier: Path, run_dir: Path) -> dict:
    """The same pipeline on a tiny verifier with every stage cut short."""
    out = {"run_dir": str(run_dir), "verifier": str(verifier)}
    for name in STAGE_ORDER:
        if name in config:
            section = {**(config[name] or {}), **SHORT[name]}
            out[name] = {k: v for k, v in section.items() if v is not None}
    return out


@pytest.fixture
def tiny_config(tmp_path, tiny_llama_dir) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(PROMPTS.read_text(encoding="utf-8").splitlines(keepends=True)[:6]), encoding="utf-8")
    config = shorten({name: {} for name in CORE}, tiny_llama_dir, tmp_path / "run")
    config["regenerate"]["data"] = [str(data)]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _edit(path: Path, stage: str, **options) -> None:
    config = yaml.safe_load(path.read_text())
    config[stage].update(options)
    path.write_text(yaml.safe_dump(config))


def test_pipeline_end_to_end_skip_change_and_range(tiny_config, capsys):
    first = pipeline(tiny_config)
    run = Path(first["run_dir"])
    assert first["actions"] == {name: "ran" for name in CORE}
    manifest = json.loads((run / "pipeline.json").read_text())
    assert all(manifest["stages"][n]["status"] == "done" for n in CORE)
    for name in CORE:
        assert (run / name / "summary.json").is_file(), name
    assert first["acceptance_length"] >= 1.0 and len(first["per_position_acceptance"]) == 2
    assert first["draft"] == str(run / "export")
    assert json.loads((run / "summary.json").read_text())["actions"] == first["actions"]
    assert first["serve"] == vllm_serve_command(
        str(Path(yaml.safe_load(tiny_config.read_text())["verifier"])),
        {"model": str((run / "export").resolve()), "num_speculative_tokens": 2, "method": "eagle3"})
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and '"method": "eagle3"' in printed and "τ" in printed

    # nothing changed: nothing runs
    mtimes = {n: (run / n / "summary.json").stat().st_mtime_ns for n in CORE}
    again = pipeline(tiny_config)
    assert again["actions"] == {name: "skipped" for name in CORE}
    assert {n: (run / n / "summary.json").stat().st_mtime_ns for n in CORE} == mtimes

    # a train option changed: train and everything downstream rerun, upstream is skipped
    _edit(tiny_config, "train", lr=0.001)
    changed = pipeline(tiny_config)
    assert changed["actions"] == {"regenerate": "skipped", "prepare": "skipped", "vocab": "skipped",
                                  "extract": "skipped", "train": "ran", "export": "ran", "evaluate": "ran"}

    # --from/--until: only the selected range, earlier stages must be done, later ones become stale
    ranged = pipeline(tiny_config, from_stage="export", until_stage="export")
    assert ranged["actions"] == {"regenerate": "kept", "prepare": "kept", "vocab": "kept", "extract": "kept",
                                 "train": "kept", "export": "ran"}
    assert json.loads((run / "pipeline.json").read_text())["stages"]["evaluate"]["status"] == "stale"
    assert pipeline(tiny_config)["actions"]["evaluate"] == "ran"

    # an interrupted stage resumes (train gets resume=True) instead of starting over
    manifest = json.loads((run / "pipeline.json").read_text())
    manifest["stages"]["train"]["status"] = "running"
    (run / "pipeline.json").write_text(json.dumps(manifest))
    resumed = pipeline(tiny_config, until_stage="train")
    assert resumed["actions"]["train"] == "resumed"

    # a changed input file reruns everything from the first stage that reads it; regenerate answers only what it
    # had not answered with these settings (an incremental refresh)
    data = Path(yaml.safe_load(tiny_config.read_text())["regenerate"]["data"][0])
    data.write_text(data.read_text() + json.dumps({"messages": [{"role": "user", "content": "One more?"}]}) + "\n")
    _edit(tiny_config, "regenerate", max_records=7)  # not a generation setting: the answers still apply
    assert pipeline(tiny_config, until_stage="prepare")["actions"] == {"regenerate": "ran (incremental)",
                                                                       "prepare": "ran"}
    regenerated = json.loads((run / "regenerate" / "summary.json").read_text())
    assert regenerated["resumed_records"] == 6 and regenerated["kept"] == 7 and regenerated["new_tokens"] > 0


def test_a_killed_incremental_extract_resumes_from_its_earlier_folder(tiny_config, monkeypatch):
    """New data: extract sets its earlier folder aside (extract.previous) and copies what it holds; a kill midway
    leaves both; the rerun resumes the new folder, still copying from the earlier one, then removes it."""
    from tiny_speculators.verifier import extract as extract_stage

    _edit(tiny_config, "extract", shard_mb=0.02)  # about one sample per shard: a kill can fall between shards
    run = Path(pipeline(tiny_config, until_stage="extract")["run_dir"])
    data = Path(yaml.safe_load(tiny_config.read_text())["regenerate"]["data"][0])
    data.write_text(data.read_text() + json.dumps({"messages": [{"role": "user", "content": "One more?"}]}) + "\n")
    _edit(tiny_config, "regenerate", max_records=7)
    run_shard, calls = extract_stage._run_shard, []

    def dying(*args, **kwargs):  # the new sample's shard: the copied ones before it are written
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(extract_stage, "_run_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        pipeline(tiny_config, until_stage="extract")
    assert calls == [1]
    assert (run / "extract.previous" / "manifest.json").is_file() and not (run / "extract" / "manifest.json").exists()
    monkeypatch.setattr(extract_stage, "_run_shard", run_shard)
    resumed = pipeline(tiny_config, until_stage="extract")
    assert resumed["actions"]["extract"] == "resumed" and not (run / "extract.previous").exists()
    extracted = json.loads((run / "extract" / "summary.json").read_text())
    assert extracted["total_samples"] == 7 and extracted["shards_written"] < extracted["shards_total"]
    manifest = json.loads((run / "extract" / "manifest.json").read_text())
    assert sum(len(s.get("reused", [])) for s in manifest["shards"]) == 6


def test_one_stage_runs_from_the_pipeline_config(tiny_config):
    """`train --config PIPELINE.yaml` (what each node runs under torchrun) takes the train section and the pipeline's
    wiring, a flag overrides it, and the later stages run the same way from their sections."""
    run = Path(yaml.safe_load(tiny_config.read_text())["run_dir"])
    pipeline(tiny_config, until_stage="extract")
    assert main(["train", "--config", str(tiny_config), "--max-steps", "1"]) == 0
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert summary["steps"] == 1 and (run / "train" / "final" / "model.safetensors").is_file()
    assert main(["export", "--config", str(tiny_config)]) == 0
    assert main(["evaluate", "--config", str(tiny_config)]) == 0
    evaluated = json.loads((run / "evaluate" / "summary.json").read_text())
    assert evaluated["num_prompts"] == 1 and evaluated["matches_baseline"] is True
    assert main(["pipeline", "--config", str(tiny_config), "--until-stage", "vocab"]) == 0  # pipeline reads it whole
    config = yaml.safe_load(tiny_config.read_text())
    del config["evaluate"]
    tiny_config.write_text(yaml.safe_dump(config))
    assert main(["evaluate", "--config", str(tiny_config)]) == 1  # one line: the pipeline has no evaluate stage


def test_cli_and_config_errors(tiny_config, tmp_path):
    assert main(["pipeline", "--config", str(tiny_config), "--until-stage", "prepare"]) == 0
    assert json.loads((tmp_path / "run" / "pipeline.json").read_text())["stages"]["prepare"]["status"] == "done"
    assert main(["pipeline", "--config", str(tiny_config), "--from-stage", "train"]) == 1  # vocab has not run
    bad = yaml.safe_load(tiny_config.read_text())
    bad["train"]["out"] = "elsewhere"
    with pytest.raises(UserError, match="the pipeline sets it"):
        plan_pipeline(bad)
    bad = yaml.safe_load(tiny_config.read_text())
    bad["train"]["no_such_option"] = 1
    with pytest.raises(UserError, match="unknown option"):
        plan_pipeline(bad)
    bad = yaml.safe_load(tiny_config.read_text())
    bad["train"]["online"] = True
    with pytest.raises(UserError, match="no 'extract' section"):
        plan_pipeline(bad)
    del bad["extract"]
    plan = plan_pipeline(bad)  # online: no extract stage, train reads the prepared data
    assert "extract" not in plan.stages and plan.stages["train"].kwargs["data"] == Path(bad["run_dir"]) / "prepare"


def _readme_commands(block: int) -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for part in re.split(r"&&|;|\n", blocks[block]):
        words = shlex.split(part)
        if words and words[0] == "tiny-speculators":
            commands.append(words[1:])
    return commands


@pytest.mark.slow
def test_readme_first_command_entry_points(tmp_path, tiny_llama_dir, monkeypatch):
    """The README's first command, with the same entry points on a tiny verifier and shortened configs."""
    commands = _readme_commands(0)
    assert commands, "the README's first code block runs no tiny-speculators command"
    monkeypatch.chdir(tmp_path)
    for words in commands:
        args = list(words)
        if "--verifier" in args:
            args[args.index("--verifier") + 1] = str(tiny_llama_dir)
        for i, a in enumerate(args):  # inputs are read from the repository, outputs go to tmp_path
            if a != "--config" and i > 0 and args[i - 1] in ("--data", "--prompts") and (ROOT / a).exists():
                args[i] = str(ROOT / a)
        if args[0] == "pipeline":
            i = args.index("--config") + 1
            config = yaml.safe_load((ROOT / args[i]).read_text(encoding="utf-8"))
            short = shorten(config, tiny_llama_dir, tmp_path / "run")
            short_path = tmp_path / Path(args[i]).name
            short_path.write_text(yaml.safe_dump(short), encoding="utf-8")
            args[i] = str(short_path)
        assert main(args) == 0, words


VARIANTS = sorted(p.name for p in (ROOT / "configs").glob("smollm2-135m-*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_embedded_family_variants_run_end_to_end(name, tmp_path, tiny_llama_dir, monkeypatch):
    """Each family's embedded config (configs/smollm2-135m-<family>.yaml), cut short on a tiny verifier, runs every
    stage: its draft trains, exports, is evaluated losslessly, and the serve line is its family's."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / name).read_text(encoding="utf-8"))
    short = shorten(config, tiny_llama_dir, tmp_path / "run")
    short["regenerate"]["data"] = [str(PROMPTS)]
    algorithm = config["train"]["algorithm"]
    short.get("extract", {}).pop("layers", None)  # SmolLM2's layer ids; the pipeline derives the tiny one's
    path = tmp_path / name
    path.write_text(yaml.safe_dump(short), encoding="utf-8")
    result = pipeline(path)
    assert result["algorithm"] == algorithm and result["matches_baseline"] is True
    exported = json.loads((tmp_path / "run" / "export" / "summary.json").read_text())
    assert exported["algorithm"] == algorithm
    if exported["vllm_speculative_config"]:
        assert result["serve"].startswith("vllm serve") and json.dumps(exported["vllm_speculative_config"]["method"]) \
            in result["serve"]


def test_extract_stores_the_layers_the_train_family_reads(tmp_path, tiny_llama_dir):
    """Without extract.layers the pipeline asks the train section: its aux_layer_ids, else its family's default for
    the verifier's depth; extract.layers, when given, wins."""
    from tiny_speculators.models import FAMILIES

    depth = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    raw = {"run_dir": str(tmp_path / "run"), "verifier": str(tiny_llama_dir), "prepare": {"data": [str(PROMPTS)]},
           "vocab": {}, "export": {}, "evaluate": {}}
    for name, family in FAMILIES.items():
        extract = plan_pipeline({**raw, "train": {"algorithm": name}}).stages["extract"].kwargs
        if family.fixed_aux_layer_ids:
            assert extract.get("layers") is None, name  # extract's own default; the last state is stored anyway
        else:
            assert extract["layers"] == family.default_aux_layer_ids(depth), name
    assert len({tuple(f.default_aux_layer_ids(depth)) for f in FAMILIES.values()}) > 1  # not vacuous
    chosen = plan_pipeline({**raw, "train": {"aux_layer_ids": [1, 3]}}).stages["extract"].kwargs
    assert chosen["layers"] == [1, 3]
    given = plan_pipeline({**raw, "train": {"aux_layer_ids": [1, 3]}, "extract": {"layers": [0, 1, 3]}})
    assert given.stages["extract"].kwargs["layers"] == [0, 1, 3]


def test_benchmark_section_is_optional_and_measures_the_export(tmp_path):
    raw = {"run_dir": str(tmp_path / "run"), "verifier": "smollm2-135m", "prepare": {"data": [str(PROMPTS)]},
           "vocab": {}, "train": {}, "export": {}, "evaluate": {}}
    assert "benchmark" not in plan_pipeline(dict(raw)).stages
    plan = plan_pipeline({**raw, "benchmark": {"concurrency": [1, 4], "requests": 8}})
    bench = plan.stages["benchmark"]
    assert list(plan.stages)[-1] == "benchmark" and bench.upstream == ["export"]
    assert bench.kwargs["draft"] == tmp_path / "run" / "export" and bench.kwargs["verifier"] == "smollm2-135m"
    assert bench.kwargs["concurrency"] == (1, 4) and bench.out == tmp_path / "run" / "benchmark"
    with pytest.raises(UserError, match="'benchmark' may not set draft"):
        plan_pipeline({**raw, "benchmark": {"draft": "elsewhere"}})


def test_regenerate_backend_is_a_config_option(tmp_path):
    raw = {"run_dir": str(tmp_path / "run"), "verifier": "smollm2-135m", "prepare": {}, "vocab": {}, "train": {},
           "export": {}, "evaluate": {}}
    plan = plan_pipeline({**raw, "regenerate": {"data": ["builtin:train"], "backend": "vllm", "batch_size": 64}})
    regen = plan.stages["regenerate"]
    assert regen.kwargs["backend"] == "vllm" and regen.kwargs["batch_size"] == 64
    assert plan.stages["prepare"].upstream == ["regenerate"]
    default = plan_pipeline({**raw, "regenerate": {"data": ["builtin:train"]}}).stages["regenerate"]
    assert "backend" not in default.kwargs  # the stage's own default: in-process
    with pytest.raises(UserError, match="backend"):
        plan_pipeline({**raw, "regenerate": {"data": ["builtin:train"], "backend": "sglang"}})


def test_extract_backend_is_a_config_option_and_part_of_the_stage_hash(tmp_path):
    from tiny_speculators.pipeline import _stage_hash

    raw = {"run_dir": str(tmp_path / "run"), "verifier": "smollm2-135m", "prepare": {"data": [str(PROMPTS)]},
           "vocab": {}, "train": {}, "export": {}, "evaluate": {}}
    stages = {}
    for backend in (None, "hf", "vllm"):
        section = {} if backend is None else {"backend": backend, "allow_untested_vllm": False}
        stages[backend] = plan_pipeline({**raw, "extract": section}).stages["extract"]
    assert "backend" not in stages[None].kwargs and stages["vllm"].kwargs["backend"] == "vllm"
    hashes = {b: _stage_hash(s, "smollm2-135m", {u: "up" for u in s.upstream}) for b, s in stages.items()}
    assert len(set(hashes.values())) == 3  # the output is meant to be equal, but a run records how it was made
    with pytest.raises(UserError, match="backend"):
        plan_pipeline({**raw, "extract": {"backend": "sglang"}})


@pytest.mark.slow
def test_two_refreshes_promote_the_second_draft_only_when_the_gate_says_so(tiny_config, tmp_path):
    """A pipeline with a promote section: the first run installs its export as DEPLOY/current; a second run with a
    changed train stage compares its export with the current one and moves the pointer only on the gate's word; a
    third, unchanged run skips promote (the deploy folder is where it writes, not an input)."""
    deploy = tmp_path / "deploy"
    config = yaml.safe_load(tiny_config.read_text())
    config["promote"] = {**SHORT["promote"], "deploy": str(deploy), "require": "better"}
    tiny_config.write_text(yaml.safe_dump(config))
    first = pipeline(tiny_config)
    assert first["promotion"]["promoted"] is True and first["promotion"]["reason"] == "there was no current draft"
    release = (deploy / "current").resolve()
    _edit(tiny_config, "train", max_steps=3)
    second = pipeline(tiny_config)
    assert second["actions"]["promote"] == "ran"
    verdict = json.loads((tmp_path / "run" / "promote" / "compare" / "summary.json").read_text())
    promoted = verdict["differences"][0]["better"]
    assert second["promotion"]["promoted"] is promoted
    assert ((deploy / "current").resolve() != release) is promoted
    assert (deploy / "previous").exists() is promoted
    third = pipeline(tiny_config)
    assert third["actions"]["promote"] == "skipped"


@pytest.mark.slow
def test_the_nightly_example_refreshes_twice(tmp_path, tiny_llama_dir, monkeypatch):
    """examples/nightly/nightly.yaml, cut short, on a tiny verifier: the first refresh trains a fresh draft and
    installs it; a new log file arrives; the second refresh answers and extracts only the new records, continues the
    installed draft on them plus a replay draw of the earlier ones, and promotes only on the gate's word; a third
    run without new data does nothing."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "examples" / "nightly" / "nightly.yaml").read_text(encoding="utf-8"))
    short = shorten(config, tiny_llama_dir, tmp_path / "run")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "2026-12-01.jsonl").write_bytes((ROOT / "examples" / "nightly" / "logs" / "2026-12-01.jsonl").read_bytes())
    short["regenerate"].update(data=[str(logs / "*.jsonl")], backend="transformers")
    assert short["promote"]["deploy"] == "deploy/smollm2"  # relative to tmp_path, where it runs
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(short), encoding="utf-8")

    first = pipeline(path)
    assert first["promotion"]["promoted"] is True
    trained = json.loads((tmp_path / "run" / "train" / "summary.json").read_text())
    assert trained["init_from"] is None and trained["replay"] == {"new": trained["replay"]["new"], "replayed": 0,
                                                                  "reused": 0}
    installed = (tmp_path / "deploy" / "smollm2" / "current").resolve()
    regenerated = json.loads((tmp_path / "run" / "regenerate" / "summary.json").read_text())
    assert regenerated["kept"] == 6  # each record answered greedily and once sampled (extra_answers: 1)
    prepared = json.loads((tmp_path / "run" / "prepare" / "summary.json").read_text())
    assert prepared["redacted"] == 2  # the address, in the prompt of both answers

    new = [{"request": {"messages": [{"role": "user", "content": f"Question {i} of the second day?"}]},
            "response": "An answer."} for i in range(2)]
    (logs / "2026-12-02.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))
    second = pipeline(path)
    assert second["actions"]["regenerate"] == "ran (incremental)" and second["actions"]["promote"] == "ran"
    regenerated = json.loads((tmp_path / "run" / "regenerate" / "summary.json").read_text())
    assert regenerated["resumed_records"] == 6 and regenerated["kept"] == 10
    assert second["actions"]["extract"] == "ran (incremental)" and not (tmp_path / "run" / "extract.previous").exists()
    extracted = json.loads((tmp_path / "run" / "extract" / "summary.json").read_text())
    assert extracted["reused_samples"] == 6 and extracted["samples"] == 10
    trained = json.loads((tmp_path / "run" / "train" / "summary.json").read_text())
    assert Path(trained["init_from"]).resolve() == installed
    replay = trained["replay"]
    assert replay["new"] >= 1 and replay["replayed"] == round(0.5 * replay["reused"]) and replay["reused"] >= 4
    verdict = json.loads((tmp_path / "run" / "promote" / "compare" / "summary.json").read_text())
    assert second["promotion"]["promoted"] is verdict["differences"][0]["better"]
    third = pipeline(path)
    assert set(third["actions"].values()) == {"skipped"}


def test_the_nightly_script_parses():
    import subprocess

    script = ROOT / "examples" / "nightly" / "nightly.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "tiny-speculators pipeline --config \"$here/nightly.yaml\"" in script.read_text()


@pytest.mark.slow
def test_synthesized_prompts_feed_regenerate_with_or_without_user_data(tiny_config):
    """A synthesize section: its prompts are answered by regenerate next to the user's data, or alone (on the
    embedded verifier: a random one never ends its user turn, so all its prompts are dropped as truncated)."""
    _edit(tiny_config, "regenerate", max_records=None)
    config = yaml.safe_load(tiny_config.read_text())
    config["verifier"] = "smollm2-135m"
    options = {k: v for k, v in SHORT["synthesize"].items() if k != "count"}
    config["synthesize"] = {**options, "max_prompt_tokens": 40, "seed": 1, "ratio": 0.3}  # of 6 records: keep 2
    tiny_config.write_text(yaml.safe_dump(config))
    run = Path(pipeline(tiny_config, until_stage="regenerate")["run_dir"])
    summary = json.loads((run / "synthesize" / "summary.json").read_text())
    assert summary["keep"] == summary["kept"] == 2 and summary["count"] == 8
    answered = json.loads((run / "regenerate" / "summary.json").read_text())
    assert answered["kept"] == 6 + 2
    del config["regenerate"]["data"]
    tiny_config.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match=r"\[synthesize\]: ratio counts regenerate's data, which it has none of"):
        pipeline(tiny_config, until_stage="regenerate")
    config["synthesize"] = {**options, "max_prompt_tokens": 40, "seed": 1, "keep": 2, "count": 8}  # what ratio set
    tiny_config.write_text(yaml.safe_dump(config))
    alone = pipeline(tiny_config, until_stage="regenerate")
    assert alone["actions"] == {"synthesize": "skipped", "regenerate": "ran (incremental)"}
    assert json.loads((run / "regenerate" / "summary.json").read_text())["kept"] == 2
    del config["synthesize"]
    tiny_config.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match="'regenerate' needs 'data'"):
        pipeline(tiny_config)
