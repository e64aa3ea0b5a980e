"""README.md for an exported draft: what it is, how to serve it, how it was trained, what it measured."""

from __future__ import annotations

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
    family_card: Mapping[str, Any],
    serve: str,
    verifier_name: str,
    speculative_tokens: int,
    dtype: str,
    num_parameters: int,
    training: Mapping[str, Any] | None,
    evaluation: Mapping[str, Any] | None,
    source: str,
) -> str:
    """Markdown with a YAML header (``base_model`` = the verifier) for the hub or a model registry.

    ``family_card`` is the format's own text (``DraftFormat.card``): ``title``, ``about``, ``rows``, ``library``,
    ``tags``; ``serve`` the command that serves the folder.
    """
    draft_rows = [
        *family_card["rows"],
        ("parameters written", f"{num_parameters:,}"),
        ("dtype", dtype),
        ("speculative tokens (default)", str(speculative_tokens)),
    ]
    tags = "\n".join(f"- {t}" for t in ["speculative-decoding", *family_card["tags"], "tiny-speculators"])
    parts = [
        "---",
        f"base_model: {verifier_name}",
        f"library_name: {family_card['library']}",
        f"tags:\n{tags}",
        "---",
        "",
        f"# {family_card['title']} for {verifier_name}",
        "",
        f"{family_card['about']} that speeds up generation of `{verifier_name}` by speculative decoding "
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
