"""The ``tiny-speculators`` command: one subcommand per pipeline stage.

Each subcommand's flags are generated from its stage function's signature (the signature is the
config), so ``tiny-speculators prepare --help`` always matches ``tiny_speculators.data.prepare.prepare``.
``--config FILE`` reads the same options from YAML; flags given on the command line override it.

    tiny-speculators --version
    tiny-speculators prepare --verifier smollm2-135m --data chats.jsonl --out runs/prepared
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from tiny_speculators import __version__
from tiny_speculators.config import _is_optional, bind, load_yaml, param_docs, stage_params
from tiny_speculators.errors import UserError

# name -> ("module:function", one-line description). Library code never imports this module.
STAGES: dict[str, tuple[str, str]] = {
    "prepare": ("tiny_speculators.data.prepare:prepare", "chat data -> token ids + assistant loss mask"),
    "vocab": ("tiny_speculators.data.vocab:vocab", "draft vocabulary (d2t / t2d) from token counts"),
    "regenerate": ("tiny_speculators.data.regenerate:regenerate",
                   "rewrite assistant turns with the verifier's own answers"),
    "extract": ("tiny_speculators.verifier.extract:extract", "verifier hidden states -> checksummed shards"),
    "train": ("tiny_speculators.train.stage:train", "train an EAGLE-3 draft (offline or online)"),
    "export": ("tiny_speculators.export.stage:export", "write a checkpoint in vLLM speculators format"),
    "evaluate": ("tiny_speculators.evaluate.stage:evaluate", "real speculative decoding: acceptance, speed-up"),
    "benchmark": ("tiny_speculators.benchmark.stage:benchmark",
                  "GuideLLM against vllm serve with and without the draft: latency, throughput, acceptance"),
    "pipeline": ("tiny_speculators.pipeline:pipeline", "run every stage from one YAML file"),
}

log = logging.getLogger("tiny_speculators")


class StageNotBuilt(UserError):
    """The stage's module does not exist yet."""


def load_stage(name: str) -> Callable[..., Any]:
    target, _ = STAGES[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise StageNotBuilt(f"the '{name}' stage is not built yet") from None
        raise
    return getattr(module, func_name)


def _add_param(parser: argparse.ArgumentParser, name: str, p: inspect.Parameter, annotation: Any,
               help_text: str) -> None:
    _, inner = _is_optional(annotation)
    origin = get_origin(inner)
    help_text = help_text.replace("%", "%%")  # argparse %-formats help strings
    kwargs: dict[str, Any] = {"help": help_text or None}
    if origin in (list, tuple):
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
    parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kwargs)


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiny-speculators", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tiny-speculators {__version__}")
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
    return parser


def _stage_of(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg in STAGES:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    logging.basicConfig(level=logging.DEBUG if args.pop("verbose") else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args.pop("stage")
    config_path = args.pop("config", None)
    try:
        func = load_stage(stage)
        values = load_yaml(config_path) if config_path else {}
        values.update(args)
        kwargs = bind(func, values, source=str(config_path) if config_path else "command line")
        positional = [kwargs.pop(n) for n, (p, _) in stage_params(func).items()
                      if p.kind is inspect.Parameter.POSITIONAL_ONLY and n in kwargs]
        func(*positional, **kwargs)
    except UserError as e:
        print(f"tiny-speculators {stage}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tiny-speculators {stage}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
