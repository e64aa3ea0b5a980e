"""``pipeline``: every stage from one YAML file, each in its own folder under one run directory.

The YAML holds a top-level ``run_dir`` and ``verifier`` and one mapping per stage with that stage's
own options (the same keys as its CLI flags)::

    run_dir: runs/smollm2-135m
    verifier: smollm2-135m
    synthesize: {count: 2000}           # optional: prompts the verifier writes itself, answered by regenerate;
                                        # {ratio: 1.0}: as many as regenerate's data has records
    regenerate: {data: [builtin:train], max_new_tokens: 96}   # optional (data optional with synthesize)
    prepare: {max_length: 512}          # takes `data` itself when there is no regenerate section
    vocab: {size: 8192}
    extract: {}                         # offline mode; leave it out and set train.online: true instead
    train: {max_steps: 600}
    export: {}
    evaluate: {max_new_tokens: 64}
    benchmark: {concurrency: [1, 4]}    # optional: GuideLLM against vllm serve (needs scripts/vllm_env.sh)

The pipeline supplies the paths that connect the stages (``data``, ``out``, ``vocab``,
``hidden_states``, ``checkpoint``, ``draft``) and ``verifier``; a section may not set them. Data paths
are relative to the folder the command runs in; ``builtin:train`` is the prompt set shipped with the package.

``RUN_DIR/pipeline.json`` records, per stage, a content hash of its inputs (data files' bytes, the
verifier, upstream stages' hashes) and its options, and whether it finished. A rerun skips stages
whose hash is unchanged and that finished, resumes one that was interrupted (passing ``resume`` to
stages that have it; the others resume by themselves), and reruns a changed stage from scratch
together with everything downstream. ``--from-stage`` forces a rerun from that stage on;
``--until-stage`` stops after one.

A refresh (new data files in ``data``, e.g. a glob over a log folder) pays for the new records only where it
counts: regenerate answers only records it has not answered, and extract moves its earlier folder to
``extract.previous`` and copies the samples it holds (``extract --reuse``), running the verifier on the new ones.
With ``train.init_from: DEPLOY/current`` (promote's ``deploy``) train continues the draft in service with its own
vocabulary, and ``train.replay`` picks what of the earlier samples it sees again; on the first run, before
anything is installed, it starts a fresh draft.

    tiny-speculators pipeline --config configs/smollm2-135m.yaml
    tiny-speculators pipeline --config configs/smollm2-135m.yaml --from-stage train --until-stage export

    from tiny_speculators.pipeline import pipeline
    pipeline(Path("configs/smollm2-135m.yaml"), until_stage="vocab")
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.config import bind, load_yaml, stage_params
from tiny_speculators.data.readers import BUILTIN_PREFIX, builtin_prompts
from tiny_speculators.errors import UserError
from tiny_speculators.stages import load_stage
from tiny_speculators.verifier.fingerprint import verifier_fingerprint

# The stage modules, models/ and verifier/ load torch, and rich would add half to the start-up: the functions that
# need them import them, so that importing this module (`tiny-speculators --help` does) stays light.

log = logging.getLogger(__name__)

__all__ = ["MANIFEST", "STAGE_ORDER", "PipelinePlan", "pipeline", "plan_pipeline", "vllm_serve_command"]

STAGE_ORDER = ("synthesize", "regenerate", "prepare", "vocab", "extract", "train", "export", "evaluate", "benchmark",
               "promote")
MANIFEST = "pipeline.json"
TOP_LEVEL = ("run_dir", "verifier")
# options each stage gets from the pipeline (never from its YAML section)
WIRED: dict[str, tuple[str, ...]] = {
    "synthesize": ("verifier", "out"),
    "regenerate": ("verifier", "out"),
    "prepare": ("verifier", "out"),
    "vocab": ("data", "out"),
    "extract": ("verifier", "data", "out"),
    "train": ("verifier", "vocab", "out", "hidden_states", "data"),
    "export": ("checkpoint", "out"),
    "evaluate": ("verifier", "draft", "out"),
    "benchmark": ("verifier", "draft", "out"),
    "promote": ("verifier", "draft", "out"),
}
# stages that reuse, when their inputs change, what their folder holds that still applies (regenerate: answered
# records, by content and generation settings): their folder is kept, so new data costs only the new records
REUSES_FINISHED_WORK = ("regenerate",)
# stages that, when their inputs change, move their finished folder to NAME.previous and take from it what still
# applies through this option (extract: the samples it holds); the earlier folder goes once the new one is done
REUSES_PREVIOUS = {"extract": "reuse"}
# path options that name where a stage writes outside the run (not inputs: not hashed)
OUTSIDE_OUTPUTS: dict[str, tuple[str, ...]] = {"promote": ("deploy",)}
# options that name a built-in set or a file (one with a suffix: resolved and hashed like the Path options)
NAME_OR_FILE: dict[str, tuple[str, ...]] = {"evaluate": ("prompts",), "benchmark": ("prompts",)}


# ------------------------------------------------------------------------------------------ hashing
def _hash_path(path: Path, h: Any) -> None:
    """Feed a file's bytes, or every file of a folder (sorted, with relative names), into ``h``."""
    if path.is_file():
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    elif path.is_dir():
        for p in sorted(q for q in path.rglob("*") if q.is_file()):
            h.update(str(p.relative_to(path)).encode() + b"\0")
            _hash_path(p, h)
    else:
        raise UserError(f"input {path} does not exist")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# -------------------------------------------------------------------------------------------- plan
@dataclass
class StagePlan:
    name: str
    kwargs: dict[str, Any]  # everything the stage function is called with
    options: dict[str, Any]  # the YAML section (what the user chose)
    upstream: list[str]
    external: list[Path]  # input files/folders outside the run directory
    out: Path


@dataclass
class PipelinePlan:
    run_dir: Path
    verifier: str
    stages: dict[str, StagePlan]


def _synthesize_ratio(section: dict[str, Any], data: list[Path], config: Path) -> None:
    """``synthesize.ratio``: synthesized prompts per record of regenerate's data, turned into the stage's ``keep``
    (and, unless given, a ``count`` of four times that to sample from: the filters drop a fifth of SmolLM2's)."""
    if "ratio" not in section:
        return
    ratio = section.pop("ratio")
    if "keep" in section:
        raise UserError(f"{config} [synthesize]: give ratio or keep, not both")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio <= 0:
        raise UserError(f"{config} [synthesize]: ratio must be a number above 0 (synthesized prompts per record "
                        f"of regenerate's data), not {ratio!r}")
    if not data:
        raise UserError(f"{config} [synthesize]: ratio counts regenerate's data, which it has none of: give count "
                        "(or keep) instead")
    from tiny_speculators.data.readers import read_records

    records = sum(r.error is None for r in read_records(data))
    section["keep"] = max(1, round(ratio * records))
    section.setdefault("count", 4 * section["keep"])
    log.info("synthesize: ratio %s of %d records: %d prompts kept, at most %d sampled", ratio, records,
             section["keep"], section["count"])


def _resolve_data(values: Any, base: Path, where: str) -> list[Path]:
    """Data paths: ``builtin:NAME``, files and folders (relative to ``base``), and glob patterns (``logs/*.jsonl``,
    sorted; a pattern that matches nothing is an error), so that new files dropped into a folder are picked up."""
    items = values if isinstance(values, list) else [values]
    paths = []
    for item in items:
        item = str(item)
        if any(c in item for c in "*?[") and not item.startswith(BUILTIN_PREFIX):
            pattern = Path(item).expanduser()
            root, rel = (Path(pattern.anchor), str(pattern.relative_to(pattern.anchor))) if pattern.is_absolute() \
                else (base, item)
            matches = sorted(root.glob(rel))
            if not matches:
                raise UserError(f"{where}: data pattern {item} matches no file")
            paths.extend(matches)
            continue
        if item.startswith(BUILTIN_PREFIX):
            try:
                paths.append(builtin_prompts(item[len(BUILTIN_PREFIX):]))
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
        else:
            p = Path(item).expanduser()
            paths.append(p if p.is_absolute() else base / p)
    return paths


def _extract_layers(verifier: str, train: dict[str, Any], where: str) -> list[int] | None:
    """The verifier layers extract stores when its section names none: what train reads (its ``aux_layer_ids``,
    else its family's default for this verifier's depth). ``None``: extract's own default is that already, or
    the family always reads the same fixed states (the last one, which extract stores anyway)."""
    from tiny_speculators.models import get_family
    from tiny_speculators.train.stage import train as train_stage
    from tiny_speculators.verifier.capture import first_aux_layer, past_deepstack
    from tiny_speculators.verifier.describe import text_config, verifier_config

    if train.get("aux_layer_ids"):
        return [int(i) for i in train["aux_layer_ids"]]
    family = get_family(train.get("algorithm", inspect.signature(train_stage).parameters["algorithm"].default))
    if family.fixed_aux_layer_ids:
        return None
    whole = verifier_config(verifier, trust_remote_code=bool(train.get("trust_remote_code", False)), whole=True)
    cfg = text_config(whole) if whole is not None else None
    if cfg is None:  # not readable now (an uncached hub id offline): extract's default; train names what it lacks
        log.warning("%s: extract stores its default layers; give extract.layers if the %s draft needs others",
                    where, family.name)
        return None
    return past_deepstack(family.default_aux_layer_ids(int(cfg.num_hidden_layers)), first_aux_layer(whole))


def plan_pipeline(raw: dict[str, Any], source: str = "pipeline config") -> PipelinePlan:
    """Work out every stage's arguments and inputs from a pipeline mapping (runs nothing)."""
    config = source
    base = Path.cwd()
    raw = {str(k).replace("-", "_"): v for k, v in raw.items()}
    verifier, run_dir = _top_level(raw, config, base)
    sections = _sections(raw, config)
    online = bool(sections["train"].get("online", False))
    if online and "extract" in sections:
        raise UserError(f"{config}: train.online is true, so there must be no 'extract' section")
    if not online:
        sections.setdefault("extract", {})
        if "layers" not in sections["extract"]:
            layers = _extract_layers(verifier, sections["train"], config)
            if layers is not None:
                sections["extract"]["layers"] = layers
    has_regen = "regenerate" in sections
    if has_regen and "data" in sections["prepare"]:
        raise UserError(f"{config}: with a 'regenerate' section, prepare reads its output: move 'data' there")
    has_synth = "synthesize" in sections
    if has_synth and not has_regen:
        raise UserError(f"{config}: a 'synthesize' section needs a 'regenerate' one (it answers the prompts)")
    data_owner = "regenerate" if has_regen else "prepare"
    if "data" not in sections[data_owner] and not has_synth:
        raise UserError(f"{config}: '{data_owner}' needs 'data' (chat files, or builtin:train)")

    stages: dict[str, StagePlan] = {}

    def add(name: str, wired: dict[str, Any], upstream: list[str], external: list[Path]) -> None:
        out = run_dir / name
        options = sections[name]
        values = {**options, **wired, "out": out}
        func = load_stage(name)
        kwargs = bind(func, values, source=f"{config} [{name}]")
        stages[name] = StagePlan(name, kwargs, options, upstream, external, out)

    if has_regen:
        given = sections["regenerate"].pop("data", [])
        data = _resolve_data(given, base, f"{config} [regenerate]") if given else []
    if has_synth:  # the verifier's own prompts, answered by regenerate with (or without) the user's data
        _synthesize_ratio(sections["synthesize"], data, config)
        add("synthesize", {"verifier": verifier}, [], [])
        from tiny_speculators.data.synthesize import OUTPUT_FILE as SYNTHESIZED
    if has_regen:
        synthesized = [run_dir / "synthesize" / SYNTHESIZED] if has_synth else []
        add("regenerate", {"verifier": verifier, "data": data + synthesized}, ["synthesize"] if has_synth else [],
            data)
        from tiny_speculators.data.regenerate import OUTPUT_FILE

        add("prepare", {"verifier": verifier, "data": [run_dir / "regenerate" / OUTPUT_FILE]}, ["regenerate"], [])
    else:
        data = _resolve_data(sections["prepare"].pop("data"), base, f"{config} [prepare]")
        add("prepare", {"verifier": verifier, "data": data}, [], data)
    add("vocab", {"data": run_dir / "prepare"}, ["prepare"], [])
    # a draft train continues (train.init_from) keeps its own vocabulary: the vocab stage's is not handed to it
    vocab_in = {} if _continues(sections, base, config) else {"vocab": run_dir / "vocab"}
    if online:
        add("train", {"verifier": verifier, **vocab_in, "data": run_dir / "prepare"},
            ["prepare", *(["vocab"] if vocab_in else [])], [])
    else:
        add("extract", {"verifier": verifier, "data": run_dir / "prepare"}, ["prepare"], [])
        add("train", {"verifier": verifier, **vocab_in, "hidden_states": run_dir / "extract"},
            [*(["vocab"] if vocab_in else []), "extract"], [])
    add("export", {"checkpoint": run_dir / "train"}, ["train"], [])
    if "evaluate" in sections:
        add("evaluate", {"verifier": verifier, "draft": run_dir / "export"}, ["export"], [])
    if "benchmark" in sections:
        add("benchmark", {"verifier": verifier, "draft": run_dir / "export"}, ["export"], [])
    if "promote" in sections:
        add("promote", {"verifier": verifier, "draft": run_dir / "export"}, ["export"], [])
    deploy = _deploy_folder(sections, base)
    for plan in stages.values():
        _add_external_options(plan, base, deploy)
    return PipelinePlan(run_dir=run_dir, verifier=verifier,
                        stages={n: stages[n] for n in STAGE_ORDER if n in stages})


def _deploy_folder(sections: dict[str, dict[str, Any]], base: Path) -> Path | None:
    """Where promote installs drafts (its ``deploy`` option, relative to ``base``), if the pipeline promotes."""
    deploy = sections.get("promote", {}).get("deploy")
    if deploy is None:
        return None
    path = Path(str(deploy)).expanduser()
    return path if path.is_absolute() else base / path


def _continues(sections: dict[str, dict[str, Any]], base: Path, config: str) -> bool:
    """Whether train continues a draft (``init_from``). On a refresh's first run the draft promote installs is not
    there yet (``init_from: DEPLOY/current``): train then starts a fresh one, and says so; any other missing
    ``init_from`` stays for train to name."""
    init = sections["train"].get("init_from")
    if init is None:
        return False
    path = Path(str(init)).expanduser()
    path = path if path.is_absolute() else base / path
    deploy = _deploy_folder(sections, base)
    if not os.path.lexists(path) and deploy is not None and path == deploy / "current":
        log.warning("%s: %s does not exist yet (the first refresh): train starts a fresh draft", config, init)
        del sections["train"]["init_from"]
        return False
    _drop_fresh_options(sections["train"], config)
    return True


def _drop_fresh_options(train: dict[str, Any], config: str) -> None:
    """The options that only shape a fresh draft (eagle3.init ...) leave a train that continues one: the same
    refresh config serves its first run, which starts a draft, and the later ones (train alone refuses them)."""
    from tiny_speculators.models import get_family
    from tiny_speculators.train.stage import train as train_stage

    family = get_family(train.get("algorithm", inspect.signature(train_stage).parameters["algorithm"].default))
    own = train.get(family.name)
    if not isinstance(own, dict):
        return
    dropped = sorted(str(k) for k in own if str(k).replace("-", "_") in family.fresh_options)
    if dropped:
        log.info("%s: train continues %s: %s only start a fresh draft, not used", config, train["init_from"],
                 ", ".join(f"{family.name}.{k}" for k in dropped))
        train[family.name] = {k: v for k, v in own.items() if str(k) not in dropped}


def _top_level(raw: dict[str, Any], config: str, base: Path) -> tuple[str, Path]:
    """The verifier (a local folder made absolute) and the run directory; the sections every pipeline needs."""
    unknown = sorted(set(raw) - set(TOP_LEVEL) - set(STAGE_ORDER))
    if unknown:
        raise UserError(f"{config}: unknown top-level key(s) {', '.join(unknown)} "
                        f"(known: {', '.join(TOP_LEVEL + STAGE_ORDER)})")
    if not raw.get("verifier"):
        raise UserError(f"{config}: needs a top-level 'verifier'")
    verifier = str(raw["verifier"])
    if Path(verifier).expanduser().exists():  # a local folder: absolute, so stages and the manifest agree
        verifier = str(Path(verifier).expanduser().resolve())
    if raw.get("run_dir") is None:
        raise UserError(f"{config}: needs a top-level 'run_dir'")
    run_dir = Path(raw["run_dir"]).expanduser()
    run_dir = run_dir if run_dir.is_absolute() else base / run_dir
    for required in ("prepare", "vocab", "train", "export"):
        if required not in raw:
            raise UserError(f"{config}: needs a '{required}' section (it may be empty: {required}: {{}})")
    if "evaluate" not in raw and "benchmark" not in raw:  # a verifier only vLLM runs is measured by benchmark
        raise UserError(f"{config}: needs an 'evaluate' section (it may be empty: evaluate: {{}}), or a "
                        "'benchmark' one that measures the draft in vLLM (for a quantized verifier)")
    return verifier, run_dir


def _sections(raw: dict[str, Any], config: str) -> dict[str, dict[str, Any]]:
    """Each stage's section (option names with _), in stage order; a section may not set what is wired."""
    sections: dict[str, dict[str, Any]] = {}
    for name in STAGE_ORDER:
        if name not in raw:
            continue
        section = raw[name] or {}
        if not isinstance(section, dict):
            raise UserError(f"{config}: the '{name}' section must be a mapping of that stage's options")
        section = {str(k).replace("-", "_"): v for k, v in section.items()}
        clash = sorted(set(section) & set(WIRED[name]))
        if clash:
            raise UserError(f"{config}: '{name}' may not set {', '.join(clash)}: the pipeline sets "
                            f"{'it' if len(clash) == 1 else 'them'}")
        sections[name] = section
    return sections


def _add_external_options(plan: StagePlan, base: Path, deploy: Path | None) -> None:
    """Options that are files outside the run (chat_template, init_from, a prompts file ...): relative to ``base``,
    and inputs of the stage's hash when they exist. What promote installs is not: a draft that a refresh continues
    (``train.init_from: DEPLOY/current``) changes with every promotion, and a rerun without new data redoes
    nothing."""
    for key, value in plan.options.items():
        if isinstance(plan.kwargs.get(key), Path) and key not in ("out",):
            path = plan.kwargs[key]
            if not path.is_absolute():
                plan.kwargs[key] = path = base / path
            installed = deploy is not None and path.is_relative_to(deploy)
            if path.exists() and key not in OUTSIDE_OUTPUTS.get(plan.name, ()) and not installed:
                plan.external.append(path)
        if key in NAME_OR_FILE.get(plan.name, ()) and str(value) != "builtin" and Path(str(value)).suffix:
            path = Path(str(value)) if Path(str(value)).is_absolute() else base / str(value)
            plan.kwargs[key] = str(path)
            if path.exists():
                plan.external.append(path)


def _stage_hash(plan: StagePlan, verifier_fp: str, upstream_hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    uses_verifier = "verifier" in plan.kwargs
    h.update(json.dumps({"stage": plan.name, "options": _jsonable(plan.options),
                         "verifier": verifier_fp if uses_verifier else None,
                         "upstream": {u: upstream_hashes[u] for u in plan.upstream}}, sort_keys=True).encode())
    for path in plan.external:
        h.update(str(path.name).encode() + b"\0")
        _hash_path(path, h)
    return h.hexdigest()


# -------------------------------------------------------------------------------------------- run
def _load_manifest(path: Path) -> dict[str, Any]:
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("stages"), dict):
                return data
        except json.JSONDecodeError:
            pass
        log.warning("%s is unreadable: every stage will run again", path)
    return {"version": 1, "stages": {}}


def _save_manifest(path: Path, manifest: dict[str, Any]) -> None:
    write_json_atomic(path, _jsonable(manifest))


def vllm_serve_command(verifier_id: str, speculative_config: dict[str, Any]) -> str:
    """The ``vllm serve`` line that serves ``verifier_id`` with an exported draft (its format's speculative config,
    from the export's ``summary.json``)."""
    return f"vllm serve {verifier_id} --speculative-config '{json.dumps(speculative_config)}'"


def pipeline(
    config: Path | None = None,
    /,
    from_stage: str | None = None,
    until_stage: str | None = None,
    run_dir: Path | None = None,
    verifier: str | None = None,
    synthesize: dict | None = None,
    regenerate: dict | None = None,
    prepare: dict | None = None,
    vocab: dict | None = None,
    extract: dict | None = None,
    train: dict | None = None,
    export: dict | None = None,
    evaluate: dict | None = None,
    benchmark: dict | None = None,
    promote: dict | None = None,
) -> dict[str, Any]:
    """Run the stages of a pipeline YAML in order; unchanged finished stages are skipped.

    On the command line ``--config FILE`` supplies run_dir, verifier and the stage sections; from
    Python, pass the YAML path as the first argument (keyword arguments override its keys).

    Args:
        config: Pipeline YAML file (Python callers; the CLI reads it through --config).
        from_stage: Rerun from this stage on, even if nothing changed (earlier stages must have finished).
        until_stage: Stop after this stage.
        run_dir: Run directory: one folder per stage plus pipeline.json.
        verifier: The verifier: a Hugging Face id, a local folder, or smollm2-135m.
        synthesize: Options of the synthesize stage (optional section: prompts the verifier writes, which
            regenerate answers with its own data, or alone); plus ratio: synthesized prompts per record of
            regenerate's data (the stage's keep; count, unless given, four times that).
        regenerate: Options of the regenerate stage (optional section; it takes `data`).
        prepare: Options of the prepare stage (takes `data` when there is no regenerate section).
        vocab: Options of the vocab stage.
        extract: Options of the extract stage (offline training; leave out with train.online true).
        train: Options of the train stage.
        export: Options of the export stage.
        evaluate: Options of the evaluate stage.
        benchmark: Options of the benchmark stage (optional section: vllm serve + GuideLLM, needs the vLLM
            environment of scripts/vllm_env.sh).
        promote: Options of the promote stage (optional section, with `deploy`: install the export as
            DEPLOY/current when it beats the current draft).
    """
    raw: dict[str, Any] = load_yaml(config) if config is not None else {}
    given = {"run_dir": run_dir, "verifier": verifier, "synthesize": synthesize, "regenerate": regenerate,
             "prepare": prepare, "vocab": vocab, "extract": extract, "train": train, "export": export,
             "evaluate": evaluate, "benchmark": benchmark, "promote": promote}
    raw.update({k: v for k, v in given.items() if v is not None})
    source = str(config) if config is not None else "pipeline options"
    t0 = time.perf_counter()
    for value, flag in ((from_stage, "from_stage"), (until_stage, "until_stage")):
        if value is not None and value not in STAGE_ORDER:
            raise UserError(f"{flag} must be one of {', '.join(STAGE_ORDER)}, not {value!r}")
    plan = plan_pipeline(raw, source)
    names = list(plan.stages)
    start, stop = _span(names, from_stage, until_stage)

    manifest_path = plan.run_dir / MANIFEST
    manifest = _load_manifest(manifest_path)
    manifest.update(config=str(Path(config).resolve()) if config is not None else None, verifier=plan.verifier)
    records: dict[str, dict[str, Any]] = manifest["stages"]
    verifier_fp = verifier_fingerprint(plan.verifier)
    hashes: dict[str, str] = {}
    actions: dict[str, str] = {}
    for i, name in enumerate(names):
        if i > stop:
            break
        stage = plan.stages[name]
        digest = _stage_hash(stage, verifier_fp, hashes)
        hashes[name] = digest
        record = records.get(name, {})
        same = record.get("hash") == digest
        finished = same and record.get("status") == "done" and stage.out.exists()
        if i < start:
            if not finished:
                raise UserError(f"--from-stage {from_stage}: the earlier stage '{name}' has not finished with "
                                "this configuration; run without --from-stage first")
            actions[name] = "kept"
            continue
        forced = from_stage is not None
        if finished and not forced:
            log.info("pipeline: %s unchanged, skipped", name)
            actions[name] = "skipped"
            continue
        actions[name] = _run_stage(stage, digest, same, forced, names[i + 1:], manifest, manifest_path)

    result = {"run_dir": str(plan.run_dir), "manifest": str(manifest_path), "actions": actions,
              "stage_seconds": {n: records[n].get("seconds") for n in actions if n in records},
              "seconds": round(time.perf_counter() - t0, 2)}
    evaluation = records.get("evaluate", {})
    if evaluation.get("status") == "done" and isinstance(evaluation.get("summary"), dict):
        result.update(_final_numbers(plan, evaluation["summary"], records.get("export", {}).get("summary") or {}))
    promotion = records.get("promote", {})
    if "promote" in actions and promotion.get("status") == "done" and isinstance(promotion.get("summary"), dict):
        result["promotion"] = {k: promotion["summary"].get(k) for k in ("promoted", "reason", "release", "deploy")}
    _save_manifest(plan.run_dir / "summary.json", result)  # same atomic JSON write
    _print_table(result, records)
    return result


def _span(names: list[str], from_stage: str | None, until_stage: str | None) -> tuple[int, int]:
    """The positions in ``names`` of the first stage to (re)run and of the last one."""
    for value, flag in ((from_stage, "from_stage"), (until_stage, "until_stage")):
        if value is not None and value not in names:
            raise UserError(f"{flag} '{value}' is not part of this pipeline (its stages: {', '.join(names)})")
    start = names.index(from_stage) if from_stage else 0
    stop = names.index(until_stage) if until_stage else len(names) - 1
    if start > stop:
        raise UserError(f"from_stage '{from_stage}' comes after until_stage '{until_stage}'")
    return start, stop


def _run_stage(stage: StagePlan, digest: str, same: bool, forced: bool, later: list[str], manifest: dict[str, Any],
               manifest_path: Path) -> str:
    """Run one stage (resuming an interrupted run of the same configuration), recording it in the manifest
    before and after; later stages' records become stale. Returns what was done: resumed or ran."""
    name = stage.name
    records: dict[str, dict[str, Any]] = manifest["stages"]
    record = records.get(name, {})
    func = load_stage(name)
    kwargs = dict(stage.kwargs)
    resuming = same and record.get("status") == "running" and stage.out.exists() and not forced
    if resuming:
        if "resume" in stage_params(func):
            kwargs["resume"] = True
        log.info("pipeline: %s was interrupted: resuming", name)
        action = "resumed"
    elif name in REUSES_PREVIOUS and stage.out.exists() and not forced:
        _set_aside(stage.out)  # what it holds that still applies is taken from there
        action = "ran (incremental)"
    elif name in REUSES_FINISHED_WORK and stage.out.exists() and not forced:
        # the stage itself reuses what in its folder is still valid (regenerate: records by content and settings),
        # so new data files cost only their own records: an incremental refresh
        log.info("pipeline: %s changed: reusing what its folder holds that still applies", name)
        action = "ran (incremental)"
    else:
        if stage.out.exists():
            log.info("pipeline: %s %s: starting it again from scratch", name,
                     "forced" if forced else "changed" if record else "left over")
            shutil.rmtree(stage.out)
        action = "ran"
    previous = _previous(stage.out)
    if name in REUSES_PREVIOUS and previous.exists() and not forced:
        kwargs[REUSES_PREVIOUS[name]] = previous
    records[name] = {"hash": digest, "status": "running", "options": stage.options,
                     "external_inputs": [str(p) for p in stage.external], "upstream": stage.upstream,
                     "out": str(stage.out), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for downstream in later:  # downstream results are stale once this stage reruns
        if downstream in records:
            records[downstream]["status"] = "stale"
    _save_manifest(manifest_path, manifest)
    log.info("pipeline: running %s", name)
    s0 = time.perf_counter()
    positional = [kwargs.pop(n) for n, (p, _) in stage_params(func).items()
                  if p.kind is inspect.Parameter.POSITIONAL_ONLY and n in kwargs]
    summary = func(*positional, **kwargs)
    if name in REUSES_PREVIOUS and previous.exists():
        shutil.rmtree(previous)  # the new folder holds what of it still applies
    records[name].update(status="done", seconds=round(time.perf_counter() - s0, 2),
                         finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         summary=summary if isinstance(summary, dict) else None)
    _save_manifest(manifest_path, manifest)
    return action


def _previous(out: Path) -> Path:
    return out.with_name(out.name + ".previous")


def _set_aside(out: Path) -> None:
    """Move a stage's earlier folder to ``NAME.previous`` for the rerun to take from. A ``.previous`` already there is
    the last finished one (a rerun that used it was interrupted): it stays, and the interrupted folder goes."""
    previous = _previous(out)
    if previous.exists():
        shutil.rmtree(out)
    else:
        out.rename(previous)


def _final_numbers(plan: PipelinePlan, ev: dict[str, Any], exported: dict[str, Any]) -> dict[str, Any]:
    from tiny_speculators.verifier.load import verifier_id

    draft = plan.run_dir / "export"
    spec = dict(exported.get("vllm_speculative_config") or {})
    if spec and ev.get("k"):  # serve with the k that was evaluated
        spec["num_speculative_tokens"] = int(ev["k"])
    serve = (vllm_serve_command(verifier_id(plan.verifier), spec) if spec
             else exported.get("serve") or "this draft's format has no vLLM serve command")
    return {"acceptance_length": ev.get("acceptance_length"),
            "per_position_acceptance": ev.get("per_position_acceptance"),
            "draft_forwards_per_step": ev.get("draft_forwards_per_step"),
            "speedup": ev.get("speedup"), "matches_baseline": ev.get("matches_baseline"), "draft": str(draft),
            "algorithm": exported.get("algorithm"), "serve": serve}


def _print_table(result: dict[str, Any], records: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pipeline: {result['run_dir']}")
    table.add_column("stage")
    table.add_column("this run")
    table.add_column("seconds", justify="right")
    for name, action in result["actions"].items():
        seconds = records.get(name, {}).get("seconds")
        table.add_row(name, action, "" if seconds is None else f"{seconds:.1f}")
    console = Console()
    console.print(table)
    if "acceptance_length" in result:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        per_pos = result.get("per_position_acceptance") or []
        summary = Table(title="draft", show_header=False)
        summary.add_column("what")
        summary.add_column("value", overflow="fold")
        summary.add_row("τ (tokens per verifier step)", fmt(result["acceptance_length"]))
        summary.add_row("per-position acceptance", " ".join(f"{a:.2f}" for a in per_pos) or "n/a")
        summary.add_row("speed-up vs verifier alone", fmt(result["speedup"]))
        summary.add_row("greedy output == verifier's", str(result.get("matches_baseline")))
        summary.add_row(f"draft ({result.get('algorithm') or 'exported'})", result["draft"])
        console.print(summary)
        console.print("serve it with vLLM:", style="bold")
        console.print(result["serve"], soft_wrap=True, markup=False, highlight=False)
    if "promotion" in result:
        p = result["promotion"]
        console.print(f"{'promoted to' if p['promoted'] else 'not promoted to'} {p['deploy']}/current: {p['reason']}",
                      soft_wrap=True, markup=False, highlight=False)
