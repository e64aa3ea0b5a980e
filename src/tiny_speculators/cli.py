"""The ``tiny-speculators`` command: one subcommand per pipeline stage.

Each subcommand's flags are generated from its stage function's signature (the signature is the
config), so ``tiny-speculators prepare --help`` always matches ``tiny_speculators.data.prepare.prepare``.
``--config FILE`` reads the same options from YAML; flags given on the command line override it.

    tiny-speculators --version
    tiny-speculators prepare --verifier smollm2-135m --data chats.jsonl --out runs/prepared
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from tiny_speculators import __version__
from tiny_speculators.config import bind, load_yaml, option_sections, param_docs, stage_params
from tiny_speculators.errors import UserError
from tiny_speculators.options import unwrap_optional
from tiny_speculators.pipeline import plan_pipeline
from tiny_speculators.stages import STAGES, StageNotBuilt, load_stage

__all__ = ["STAGES", "StageNotBuilt", "build_parser", "load_stage", "main", "parse_command"]

log = logging.getLogger("tiny_speculators")


def _add_param(parser, name: str, p: inspect.Parameter, annotation: Any, help_text: str,
               dest: str | None = None) -> None:
    _, inner = unwrap_optional(annotation)
    origin = get_origin(inner)
    help_text = help_text.replace("%", "%%")  # argparse %-formats help strings
    kwargs: dict[str, Any] = {"help": help_text or None}
    if origin in (list, tuple, dict):  # a dict is given as name=value words
        kwargs["nargs"] = "+"
    if origin is Literal:
        kwargs["choices"] = [str(c) for c in get_args(inner)]
    if p.default is not inspect.Parameter.empty and p.default is not None and inner is not bool:
        kwargs["help"] = f"{help_text} (default: {p.default})".strip()
    if p.kind is inspect.Parameter.POSITIONAL_ONLY:
        if "nargs" not in kwargs:
            kwargs["nargs"] = "?"
        parser.add_argument(name, metavar=name.upper(), default=argparse.SUPPRESS, **kwargs)
        return
    flag = "--" + name.replace("_", "-")
    if inner is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["metavar"] = name.upper() if origin is not Literal else None
    parser.add_argument(flag, dest=dest or name, default=argparse.SUPPRESS, **kwargs)


SECTION_SEP = "__"  # dest of a section flag: "<section>__<option>"


def _add_sections(parser: argparse.ArgumentParser, func) -> None:
    """``--<section>-<option>`` flags for each option section of ``func`` (``--<family>-<option>``)."""
    for section, options_type in option_sections(func).items():
        group = parser.add_argument_group(f"{section} options", getattr(options_type, "__doc__", "").split("\n")[0])
        docs = param_docs(options_type)
        hints = typing.get_type_hints(options_type)
        for field in dataclasses.fields(options_type):
            p = inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default)
            flag_name = f"{section}_{field.name}"
            _add_param(group, flag_name, p, hints[field.name], docs.get(field.name, ""),
                       dest=f"{section}{SECTION_SEP}{field.name}")


def _group_sections(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in args.items():
        if SECTION_SEP in key:
            section, option = key.split(SECTION_SEP, 1)
            out.setdefault(section, {})[option] = value
        else:
            out[key] = value
    return out


class _Version(argparse.Action):
    """``--version``: this package's version and what it runs with (torch and transformers are imported only here)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import torch
        import transformers

        from tiny_speculators.serving import vllm_env_version

        print(f"tiny-speculators {__version__}\ntorch {torch.__version__}\ntransformers {transformers.__version__}\n"
              f"vLLM environment: {vllm_env_version()}")
        parser.exit()


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiny-speculators", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                        help="the versions of this package, torch, transformers and the vLLM environment, then exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    for name, (_, description) in STAGES.items():
        sp = sub.add_parser(name, help=description, description=description)
        if name != stage:
            continue
        sp.add_argument("--config", type=Path, help="YAML file with this stage's options; flags override it")
        func = load_stage(name)
        docs = param_docs(func)
        for pname, (p, annotation) in stage_params(func).items():
            _add_param(sp, pname, p, annotation, docs.get(pname, ""))
        _add_sections(sp, func)
    return parser


def _stage_of(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg in STAGES:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def _config_values(stage: str, path: Path) -> dict[str, Any]:
    """A stage's options from ``--config``: a file of that stage's options, or a pipeline config (``run_dir`` and a
    section per stage), whose section for this stage and whose wiring (inputs and output in ``run_dir``) are taken,
    so that one file drives ``pipeline`` and a stage run on its own, e.g. ``train`` under torchrun on each node."""
    raw = load_yaml(path)
    if stage == "pipeline":  # its keys are bound (and checked) here; the path names the config in its messages
        return {**raw, "config": path}
    if "run_dir" not in raw:
        return raw

    plan = plan_pipeline(raw, str(path)).stages.get(stage)
    if plan is None:
        raise UserError(f"{path} is a pipeline config without a {stage} stage")
    # sections stay mappings, so that a flag can override one option of a section
    return {**plan.kwargs, **{k: v for k, v in plan.options.items() if isinstance(v, dict)}}


def main(argv: Sequence[str] | None = None) -> int:
    code = _run(list(sys.argv[1:] if argv is None else argv))
    # a torchrun rank on CPU ends without interpreter finalization, which gloo's threads may crash
    distributed = sys.modules.get("tiny_speculators.train.distributed")
    if distributed is not None:
        distributed.exit_without_finalizing(code)
    return code


def parse_command(argv: Sequence[str]) -> tuple[Any, list[Any], dict[str, Any]] | None:
    """The stage function and its arguments for a command line, without running it: ``(func, positional,
    kwargs)``, or None when no stage is named. Raises ``UserError`` for bad options and ``SystemExit`` for what
    argparse refuses (an unknown flag, a bad choice), as the command would."""
    argv = list(argv)
    stage = _stage_of(argv)
    args = vars(build_parser(stage).parse_args(argv))
    return _bind_stage(stage, args) if args.get("stage") else None


def _bind_stage(stage: str, args: dict[str, Any]) -> tuple[Any, list[Any], dict[str, Any]]:
    """Parsed flags, over the ``--config`` file they name, bound to the stage function's signature."""
    config_path = args.get("config")
    func = load_stage(stage)
    values = _config_values(stage, config_path) if config_path else {}
    flags = {k: v for k, v in args.items() if k not in ("verbose", "stage", "config")}
    for key, value in _group_sections(flags).items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}  # flags override single options of a YAML section
        else:
            values[key] = value
    kwargs = bind(func, values, source=str(config_path) if config_path else "command line")
    positional = [kwargs.pop(n) for n, (p, _) in stage_params(func).items()
                  if p.kind is inspect.Parameter.POSITIONAL_ONLY and n in kwargs]
    return func, positional, kwargs


def _run(argv: list[str]) -> int:
    stage = _stage_of(argv)
    try:
        parser = build_parser(stage)
    except UserError as e:
        print(f"tiny-speculators: {e}", file=sys.stderr)
        return 2
    args = vars(parser.parse_args(argv))
    if not args.get("stage"):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.DEBUG if args["verbose"] else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        func, positional, kwargs = _bind_stage(stage, args)
        func(*positional, **kwargs)
    except UserError as e:
        print(f"tiny-speculators {stage}: error: {e}", file=sys.stderr)
        return e.exit_code  # 1, or a verdict's own (compare's unmet --require: 3, monitor's alert: 4)
    except KeyboardInterrupt:
        print(f"tiny-speculators {stage}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
