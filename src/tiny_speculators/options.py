"""Typed values from YAML and the command line: the conversions every config goes through.

:func:`coerce` turns one value into an annotated type (bool, int, float, str, Path, Literal, list, tuple,
dict, optional and union types); :func:`parse_options` builds an options dataclass from a mapping (a draft
family's options, nested under its name in YAML); :func:`options_record` and :func:`options_from_record`
write such options into a checkpoint's record and read them back. A bad value or an unknown key is a
:class:`UserError` that names it, in one sentence. :func:`check_ranges` is the range check of an options
dataclass's ``__post_init__``.

    python -c "from tiny_speculators.options import coerce; print(coerce('3', int | None, 'k'))"
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from tiny_speculators.errors import UserError

__all__ = ["AT_LEAST_1", "FRACTION", "NON_NEGATIVE", "Range", "check_ranges", "coerce", "options_from_record",
           "options_record", "parse_options", "unwrap_optional"]


@dataclasses.dataclass(frozen=True)
class Range:
    """The values an option may take: the words that name them and the test of a value outside."""

    words: str
    outside: Callable[[Any], bool]


AT_LEAST_1 = Range("at least 1", lambda v: v < 1)
NON_NEGATIVE = Range(">= 0", lambda v: v < 0)
FRACTION = Range("in (0, 1]", lambda v: not 0 < v <= 1)


def check_ranges(*checks: tuple[str, Any, Range]) -> None:
    """``(name, value, range)`` checks in order: ``ValueError("NAME must be RANGE, got VALUE")`` for the first value
    outside its range (an options dataclass's ``__post_init__``; :func:`parse_options` makes it a UserError)."""
    for name, value, allowed in checks:
        if allowed.outside(value):
            raise ValueError(f"{name} must be {allowed.words}, got {value}")


def unwrap_optional(annotation: Any) -> tuple[bool, Any]:
    """``(True, X)`` for ``X | None`` (``X`` a union again when several types remain), else ``(False, annotation)``."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != len(get_args(annotation)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return False, annotation


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/CLI value to ``annotation`` (bool, int, float, str, Path, Literal, list, tuple)."""
    optional, inner = unwrap_optional(annotation)
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


def parse_options(options_type: type, values: Mapping[str, Any] | Any | None, where: str) -> Any:
    """A family's options dataclass from a YAML/CLI mapping; unknown keys and bad values name the key."""
    if values is None:
        return options_type()
    if isinstance(values, options_type):
        return values
    if not isinstance(values, Mapping):
        raise UserError(f"{where} must be a mapping of option names to values, not {values!r}")
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    hints = _type_hints(options_type)
    clean = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(clean) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown option(s) {', '.join(unknown)} (known: {', '.join(fields)})")
    kwargs = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in clean.items()}
    try:
        return options_type(**kwargs)
    except ValueError as e:  # __post_init__ range checks
        raise UserError(f"{where}: {e}") from None


def _type_hints(options_type: type) -> dict[str, Any]:
    return typing.get_type_hints(options_type)


def options_record(options: Any) -> dict[str, Any]:
    """A family's options as a JSON-ready dict (for checkpoints and model cards)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(options).items()}


def options_from_record(options_type: type, record: Mapping[str, Any] | None) -> Any:
    """The options a draft was trained with, from its ``trained_with`` record (other keys ignored)."""
    names = {f.name for f in dataclasses.fields(options_type)}
    return parse_options(options_type, {k: v for k, v in (record or {}).items() if k in names}, "trained_with")
