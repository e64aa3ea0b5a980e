"""The one table of pipeline stages: name -> (``module:function``, one-line description). The CLI builds a
subcommand per entry, the pipeline runs them; each function's signature is its config."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tiny_speculators.errors import UserError

STAGES: dict[str, tuple[str, str]] = {
    "prepare": ("tiny_speculators.data.prepare:prepare", "chat data -> token ids + assistant loss mask"),
    "vocab": ("tiny_speculators.data.vocab:vocab", "draft vocabulary (d2t / t2d) from token counts"),
    "synthesize": ("tiny_speculators.data.synthesize:synthesize",
                   "prompts the verifier writes itself (Magpie), filtered: data without a dataset"),
    "regenerate": ("tiny_speculators.data.regenerate:regenerate",
                   "rewrite assistant turns with the verifier's own answers"),
    "extract": ("tiny_speculators.verifier.extract:extract", "verifier hidden states -> checksummed shards"),
    "train": ("tiny_speculators.train.stage:train", "train a draft (EAGLE-3, P-EAGLE, ...) offline or online"),
    "export": ("tiny_speculators.export.stage:export", "write a checkpoint in the format a server loads"),
    "evaluate": ("tiny_speculators.evaluate.stage:evaluate", "real speculative decoding: acceptance, speed-up"),
    "benchmark": ("tiny_speculators.benchmark.stage:benchmark",
                  "GuideLLM against vllm serve with and without the draft: latency, throughput, acceptance"),
    "compare": ("tiny_speculators.compare.stage:compare",
                "drafts side by side on the same prompts: τ with paired bootstrap intervals, a verdict"),
    "promote": ("tiny_speculators.compare.promote:promote",
                "install a draft as DEPLOY/current when it beats the current one (paired bootstrap gate)"),
    "monitor": ("tiny_speculators.benchmark.monitor:monitor",
                "a running vllm serve's served τ over time against the τ its draft was validated at; alerts"),
    "pipeline": ("tiny_speculators.pipeline:pipeline", "run every stage from one YAML file"),
}

__all__ = ["STAGES", "StageNotBuilt", "load_stage"]


class StageNotBuilt(UserError):
    """The stage's module does not exist yet."""


def load_stage(name: str) -> Callable[..., Any]:
    if name not in STAGES:
        raise UserError(f"unknown stage {name!r} (known: {', '.join(STAGES)})")
    target, _ = STAGES[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise StageNotBuilt(f"the '{name}' stage is not built yet") from None
        raise
    return getattr(module, func_name)
