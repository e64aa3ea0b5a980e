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
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from tiny_speculators.errors import UserError

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
    from tiny_speculators.models.family import parse_options

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


def _is_optional(annotation: Any) -> tuple[bool, Any]:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != len(get_args(annotation)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return False, annotation


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/CLI value to ``annotation`` (bool, int, float, str, Path, Literal, list, tuple)."""
    optional, inner = _is_optional(annotation)
    if value is None:
        if optional or annotation is Any:
            return None
        raise UserError(f"{where} may not be empty")
    annotation = inner
    origin = get_origin(annotation)
    if annotation is Any:
        return value
    if origin is dict:
        return _coerce_mapping(value, annotation, where)
    if origin is Literal:
        choices = get_args(annotation)
        for c in choices:
            if value == c or str(value) == str(c):
                return c
        raise UserError(f"{where} must be one of {', '.join(map(str, choices))}, not {value!r}")
    if origin in (list, tuple):
        items = value if isinstance(value, (list, tuple)) else [value]
        args = get_args(annotation)
        item_type = args[0] if args else Any
        out = [coerce(v, item_type, where) for v in items]
        return out if origin is list else tuple(out)
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            try:
                return coerce(value, arg, where)
            except UserError:
                continue
        raise UserError(f"{where} has an unsupported value {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise UserError(f"{where} must be true or false, not {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise UserError(f"{where} must be a number, not {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError):
            raise UserError(f"{where} must be {'an integer' if annotation is int else 'a number'}, "
                            f"not {value!r}") from None
        if annotation is int and isinstance(value, float) and number != value:
            raise UserError(f"{where} must be an integer, not {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{where} must be a string, not {value!r}")
        return str(value)
    if annotation is Path:
        if not isinstance(value, (str, Path)):
            raise UserError(f"{where} must be a path, not {value!r}")
        return Path(value).expanduser()
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value
    if annotation in (dict, typing.Dict) or get_origin(annotation) is dict:  # noqa: UP006
        if isinstance(value, dict):
            return value
        raise UserError(f"{where} must be a mapping, not {value!r}")
    raise UserError(f"{where} has an unsupported type {annotation!r}")


def _coerce_mapping(value: Any, annotation: Any, where: str) -> dict[Any, Any]:
    """A typed mapping from a YAML mapping, or from ``name=value`` words (command line: ``--loss ce=0.1 tv=0.9``)."""
    key_type, value_type = get_args(annotation) or (Any, Any)
    if isinstance(value, str):
        value = value.split()
    if isinstance(value, (list, tuple)):
        pairs: dict[str, str] = {}
        for item in value:
            if not isinstance(item, str) or "=" not in item:
                raise UserError(f"{where} takes name=value pairs (e.g. kl=1.0), not {item!r}")
            name, _, number = item.partition("=")
            pairs[name.strip()] = number.strip()
        value = pairs
    if not isinstance(value, Mapping):
        raise UserError(f"{where} must be a mapping, not {value!r}")
    return {coerce(k, key_type, where): coerce(v, value_type, f"{where}.{k}") for k, v in value.items()}


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
