"""README.md for an exported draft: what it is, how to serve it, how it was trained, what it measured."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _scalar_rows(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Flatten numbers, strings, booleans and short lists of numbers into ``(key, value)`` rows."""
    rows: list[tuple[str, str]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool | str):
            rows.append((name, str(value)))
        elif isinstance(value, int | float):
            rows.append((name, f"{value:.4g}" if isinstance(value, float) else str(value)))
        elif isinstance(value, list) and value and len(value) <= 16 and all(isinstance(v, int | float) for v in value):
            rows.append((name, ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value)))
        elif isinstance(value, Mapping) and len(prefix.split(".")) < 3:
            rows.extend(_scalar_rows(value, prefix=f"{name}."))
    return rows


def _table(rows: list[tuple[str, str]]) -> str:
    if not rows:
        return "_none recorded_\n"
    lines = ["| field | value |", "| --- | --- |"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def render_model_card(
    *,
    format: str,
    verifier_name: str,
    kwargs: Mapping[str, Any],
    aux_layer_ids: list[int] | None,
    speculative_tokens: int,
    dtype: str,
    num_parameters: int,
    training: Mapping[str, Any] | None,
    evaluation: Mapping[str, Any] | None,
    source: str,
) -> str:
    """Markdown with a YAML header (``base_model`` = the verifier) for the hub or a model registry."""
    if format == "speculators":
        serve = (f"vllm serve {'<this folder>'}\n"
                 f"# or, explicitly:\nvllm serve {verifier_name} --speculative-config "
                 f"'{json.dumps({'model': '<this folder>', 'num_speculative_tokens': speculative_tokens})}'")
    else:
        serve = (f"python -m sglang.launch_server --model-path {verifier_name} --speculative-algorithm EAGLE3 \\\n"
                 f"    --speculative-draft-model-path <this folder> --speculative-num-steps {speculative_tokens} \\\n"
                 f"    --speculative-eagle-topk 1 --speculative-num-draft-tokens {speculative_tokens + 1}")
    draft_rows = [
        ("decoder layer", f"{kwargs['layer_type']} (1 layer)"),
        ("hidden size", str(kwargs["hidden_size"])),
        ("verifier hidden size", str(kwargs.get("target_hidden_size") or kwargs["hidden_size"])),
        ("attention heads / kv heads / head dim",
         f"{kwargs['num_attention_heads']} / {kwargs['num_key_value_heads']} / {kwargs['head_dim']}"),
        ("MLP width", str(kwargs["intermediate_size"])),
        ("draft vocab / verifier vocab", f"{kwargs['draft_vocab_size']} / {kwargs['vocab_size']}"),
        ("verifier layers fused (input of layer i)", ", ".join(map(str, aux_layer_ids or [])) or "default"),
        ("norm_before_residual / norm_before_fc / fc_norm",
         f"{kwargs['norm_before_residual']} / {kwargs['norm_before_fc']} / {kwargs['fc_norm']}"),
        ("parameters written", f"{num_parameters:,}"),
        ("dtype", dtype),
        ("speculative tokens (default)", str(speculative_tokens)),
    ]
    parts = [
        "---",
        f"base_model: {verifier_name}",
        "library_name: vllm" if format == "speculators" else "library_name: sglang",
        "tags:\n- speculative-decoding\n- eagle3\n- speculators\n- tiny-speculators",
        "---",
        "",
        f"# EAGLE-3 draft for {verifier_name}",
        "",
        f"A one-layer EAGLE-3 draft model that speeds up generation of `{verifier_name}` by speculative decoding "
        f"(format: {format}). Exported by tiny-speculators from `{source}`.",
        "",
        "## Serve it",
        "",
        "```bash",
        serve,
        "```",
        "",
        "## Draft",
        "",
        _table(draft_rows),
        "## Training",
        "",
        _table(_scalar_rows(training or {})),
        "## Measured acceptance",
        "",
    ]
    if evaluation:
        parts += ["From `tiny-speculators evaluate` (acceptance length counts the verifier's own token; "
                  "per-position rates are the fraction of drafts accepted up to that depth).", "",
                  _table(_scalar_rows(evaluation))]
    else:
        parts += ["Not measured yet: run `tiny-speculators evaluate` and export again with `--eval-results`.", ""]
    return "\n".join(parts)
