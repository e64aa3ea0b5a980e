"""``export``: write a trained draft in the format a server loads as it is.

    tiny-speculators export runs/train --out runs/export                       # vLLM speculators format
    vllm serve runs/export                                                     # loads verifier + draft
    tiny-speculators export runs/train/best --out runs/other --format FORMAT             # another of the family's
    tiny-speculators export some/speculators-draft --out runs/other --format FORMAT      # convert formats

The format code lives with each family (``models/<family>/``); this stage writes the folder: weights,
``config.json``, a model card and ``summary.json`` (with the command that serves it).

Tiny CPU version (random 1-step draft of the embedded verifier)::

    python -c "from tiny_speculators.export.stage import export; export('runs/train', out='runs/export', \
verifier_name='smollm2-135m')"

The checkpoint may be one of ours (``step_*/``, ``best/``, ``final/`` or the train output folder) or a
draft in the speculators or SGLang format (converted). The verifier's name recorded in the output is
the id the draft was trained against; ``--verifier-name`` overrides it (e.g. when training used a
local copy: give the hub id, or the folder vLLM should load).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

from safetensors.torch import save_file

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.errors import UserError
from tiny_speculators.export.common import EXPORT_DTYPES, read_json
from tiny_speculators.export.model_card import render_model_card
from tiny_speculators.models import FORMAT_NAMES, get_family
from tiny_speculators.models.compat import check_against_verifier, check_verifier
from tiny_speculators.models.family import ExportInfo
from tiny_speculators.models.importing import OURS, import_draft, resolve_checkpoint
from tiny_speculators.tables import print_summary_table
from tiny_speculators.verifier.embedded import EMBEDDED
from tiny_speculators.verifier.load import verifier_id

log = logging.getLogger(__name__)


def _verifier_name(given: str | None, recorded: str | None) -> str:
    name = given or recorded
    if not name:
        raise UserError("the checkpoint does not record which verifier it was trained against: pass --verifier-name")
    if name in EMBEDDED:
        return verifier_id(name)
    path = Path(name).expanduser()
    if given and path.exists():  # a local folder: absolute, so the server finds it from any directory
        return str(path.resolve())
    return name


def _training_record(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    if isinstance(config.get("trained_with"), dict):
        record.update(config["trained_with"])
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        meta = read_json(meta_path)
        for key in ("step", "epoch", "tokens_seen", "best_accept", "time", "world_size"):
            if key in meta:
                record[key] = meta[key]
        if isinstance(meta.get("args"), dict):
            record["args"] = {k: v for k, v in meta["args"].items() if not isinstance(v, dict | list)}
        if isinstance(meta.get("val"), dict):
            record["validation"] = meta["val"]
    if config.get("source", {}).get("format") not in (None, OURS):
        record["imported_from"] = config["source"]["format"]
    return record


def _verifier(draft, config: dict[str, Any], verifier_name: str | None) -> tuple[str, list[str]]:
    """The verifier the export names and its architectures, the draft checked against what the checkpoint
    records of it and (``--verifier-name``) against that verifier's config."""
    recorded = config.get("verifier") or {}
    check_against_verifier(draft.kwargs, recorded, recorded.get("name_or_path") or "recorded in the checkpoint")
    name = _verifier_name(verifier_name, recorded.get("name_or_path"))
    architectures = list(recorded.get("architectures") or [])
    vcfg = check_verifier(draft.kwargs, verifier_name)
    if vcfg is not None:
        architectures = list(getattr(vcfg, "architectures", None) or architectures)
    return name, architectures


def _write_folder(out: Path, fmt, name: str, cfg: dict[str, Any], tensors: dict[str, Any], card: str) -> None:
    """model.safetensors, config.json, the format's companion files and README.md (the model card)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json_atomic(out / "config.json", cfg)
    for companion in fmt.companions(name) if fmt.companions else []:  # e.g. the verifier's tokenizer
        shutil.copyfile(companion, out / companion.name)
    atomic_write(out / "README.md", lambda tmp: Path(tmp).write_text(card))


def export(
    checkpoint: Path,
    /,
    out: Path,
    format: Literal[FORMAT_NAMES] | None = None,
    verifier_name: str | None = None,
    speculative_tokens: int | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    eval_results: Path | None = None,
) -> dict[str, Any]:
    """Export a draft checkpoint in a format a server loads (default: its family's, vLLM's speculators format).

    Args:
        checkpoint: a train output folder (uses best/, then final/, then latest), one checkpoint folder,
            or a draft in a published format to convert.
        out: output folder (config.json, model.safetensors, README.md, summary.json).
        format: the output format; default the family's first (speculators: what `vllm serve <out>` loads).
            Each family lists its formats in its folder (models/<family>/), e.g. one SGLang loads.
        verifier_name: the verifier recorded in the output (hub id or a local folder); defaults to the id the
            draft was trained against. Embedded names map to their hub id.
        speculative_tokens: default number of draft tokens per step written to the config; defaults to what the
            draft was trained for (its family's steps per proposal), else 3.
        dtype: dtype of the written weights (float32 is lossless; bfloat16 halves the file).
        eval_results: results.json of `tiny-speculators evaluate` for this draft, quoted in the model card.
    """
    source = resolve_checkpoint(checkpoint)
    out = Path(out).expanduser()
    if out.resolve() == source.resolve():
        raise UserError(f"--out {out} is the checkpoint folder itself; choose another folder")
    draft, config = import_draft(source, verifier=verifier_name)
    family = get_family(config["model_type"])
    fmt = family.format(format)
    name, architectures = _verifier(draft, config, verifier_name)
    tokens = family.resolve_speculative_tokens(config, given=speculative_tokens)
    if tokens < 1:
        raise UserError(f"speculative_tokens must be at least 1, got {tokens}")
    torch_dtype = EXPORT_DTYPES[dtype]
    cfg, tensors = fmt.write(draft, ExportInfo(verifier_name=name, verifier_architectures=architectures,
                                               speculative_tokens=tokens, dtype=torch_dtype))

    evaluation = read_json(Path(eval_results)) if eval_results else None
    num_parameters = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    card = render_model_card(format=fmt.name, family_card=fmt.card(draft.kwargs),
                             serve=fmt.serve(name, "<this folder>", tokens), verifier_name=name,
                             speculative_tokens=tokens, dtype=dtype, num_parameters=num_parameters,
                             training=_training_record(source, config), evaluation=evaluation, source=str(source))

    _write_folder(out, fmt, name, cfg, tensors, card)
    summary = {
        "format": fmt.name,
        "algorithm": family.name,
        "out": str(out),
        "source": str(source),
        "source_format": config["source"]["format"],
        "verifier": name,
        "speculative_tokens": tokens,
        "dtype": dtype,
        "aux_layer_ids": draft.kwargs.get("aux_layer_ids"),
        "tensors": sorted(tensors),
        "parameters": num_parameters,
        "bytes": (out / "model.safetensors").stat().st_size,
        "serve": fmt.serve(name, str(out.resolve()), tokens),
        "vllm_speculative_config": (fmt.vllm_speculative_config(str(out.resolve()), tokens)
                                    if fmt.vllm_speculative_config else None),
        # the τ it was validated at (what `monitor` compares served τ with)
        "validated": ({k: evaluation.get(k) for k in ("acceptance_length", "k", "num_prompts", "prompts",
                                                      "verifier_id")} if evaluation else None),
    }
    write_json_atomic(out / "summary.json", summary)
    log.info("exported %s (%s %s, %d parameters) to %s", source, family.name, fmt.name, num_parameters, out)
    _print_summary(summary)
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    keys = ("algorithm", "format", "out", "source", "verifier", "speculative_tokens", "dtype", "parameters", "bytes")
    print_summary_table("export", [(key, json.dumps(summary[key]) if not isinstance(summary[key], str)
                                    else summary[key]) for key in keys])
