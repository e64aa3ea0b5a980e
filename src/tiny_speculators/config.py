"""Stage configs: each stage is one typed function, and its signature *is* its config.

A YAML file holds keyword arguments for one stage (or, for ``pipeline``, one mapping per stage);
:func:`bind` checks such a mapping against the function's signature -- unknown keys, missing
required values and wrong types each give one clear sentence -- and converts the values to the
annotated types, so the CLI, YAML files and Python callers all go through the same validation.

    from tiny_speculators.config import bind, load_yaml
    from tiny_speculators.data.prepare import prepare
    prepare(**bind(prepare, load_yaml("configs/prepare.yaml")))
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from tiny_speculators.errors import UserError
from tiny_speculators.options import coerce, parse_options

__all__ = ["bind", "load_yaml", "option_sections", "param_docs", "stage_params"]


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or a non-mapping gives a :class:`UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def stage_params(func: Callable[..., Any]) -> dict[str, tuple[inspect.Parameter, Any]]:
    """The parameters of ``func`` with their resolved type annotations, in order."""
    params = {}
    for name, p in inspect.signature(func, eval_str=True).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params[name] = (p, Any if p.annotation is inspect.Parameter.empty else p.annotation)
    return params


def option_sections(func: Callable[..., Any]) -> dict[str, type]:
    """Nested option sections a stage takes besides its parameters (``train``: one per draft family), each a
    frozen dataclass type; declared as ``func.option_sections`` and received through ``**kwargs``."""
    return dict(getattr(func, "option_sections", {}) or {})


def bind(func: Callable[..., Any], values: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Validate ``values`` against ``func``'s signature; return keyword arguments of the right types."""
    params = stage_params(func)
    sections = option_sections(func)
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(params) - set(sections))
    if unknown:
        known = ", ".join([*params, *sections])
        raise UserError(f"{source}: unknown option(s) {', '.join(unknown)} for '{func.__name__}' (known: {known})")
    kwargs: dict[str, Any] = {}
    for name, options_type in sections.items():
        if name in values:
            kwargs[name] = parse_options(options_type, values[name], f"{source}: option '{name}'")
    for name, (p, annotation) in params.items():
        if name in values:
            kwargs[name] = coerce(values[name], annotation, f"{source}: option '{name}'")
        elif p.default is inspect.Parameter.empty:
            raise UserError(f"{source}: '{func.__name__}' needs a value for '{name}'")
    return kwargs


_ARG_LINE = re.compile(r"^ {4}(\w+)(?: \(.*?\))?:\s*(.*)$")


def param_docs(func: Callable[..., Any]) -> dict[str, str]:
    """Per-parameter help from a Google-style ``Args:`` section of ``func``'s docstring."""
    docs: dict[str, str] = {}
    in_args, current = False, None
    for line in (inspect.getdoc(func) or "").splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and line.strip() and not line.startswith(" "):
            break  # the next section
        elif in_args and (m := _ARG_LINE.match(line)):
            current = m.group(1)
            docs[current] = m.group(2)
        elif in_args and current and line.strip():
            docs[current] += " " + line.strip()
    return docs
