"""The ``train`` stage's options as one typed, frozen object: built once from the stage's arguments (whose
signature is the config) and handed to the setup, the loop and the checkpoints.

Its fields *are* ``train``'s parameters -- names, annotations and defaults read from the signature -- so the two
cannot drift; ``family`` adds the chosen draft family's own options (the dataclass in ``models/<family>/``).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_speculators.models.losses import LossSpec
from tiny_speculators.train.stage import train

# the fields a checkpoint's ``args`` has always listed first (then the rest in the signature's order)
_FIRST = ("verifier", "out", "vocab", "algorithm", "family")


def _fields_of(stage: Callable[..., Any]):
    """A class decorator: the class becomes a frozen, keyword-only dataclass with one field per parameter of
    ``stage`` (its resolved annotation and default) next to the fields the class declares itself."""
    def decorate(cls: type) -> type:
        params = {p.name: p for p in inspect.signature(stage).parameters.values() if p.kind is not p.VAR_KEYWORD}
        hints = typing.get_type_hints(stage)
        annotations = {**{name: hints[name] for name in params}, **typing.get_type_hints(cls)}
        order = [*_FIRST, *(name for name in annotations if name not in _FIRST)]
        cls.__annotations__ = {name: annotations[name] for name in order}
        for name, p in params.items():
            if p.default is not p.empty:
                setattr(cls, name, p.default)
        return dataclass(frozen=True, kw_only=True)(cls)
    return decorate


@_fields_of(train)
class TrainOptions:
    family: Any

    # the training recipe: what a summary reports next to the family's options
    RECIPE_KEYS = ("loss", "position_weights", "dpace_alpha", "optimizer", "muon_momentum", "muon_weight_decay",
                   "aux_noise_std", "loss_positions", "freeze")

    # what a checkpoint records and a resume compares (the data order depends on these)
    ORDER_KEYS = ("batch_size", "batch_tokens", "pack", "grad_accum", "seed", "replay")

    @property
    def mode(self) -> str:
        """offline, online, or online-vllm (hidden states from vLLM producers)."""
        if not self.online:
            return "offline"
        return "online-vllm" if self.producer == "vllm" else "online"

    def recipe(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RECIPE_KEYS}

    def loss_spec(self):
        return LossSpec.from_mapping(self.loss, self.position_weights, self.dpace_alpha)

    def record(self) -> dict[str, Any]:
        """JSON-ready run arguments for checkpoints (``meta.json``), family options nested under their name."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "family":
                out[self.algorithm] = dataclasses.asdict(value)
            elif isinstance(value, Path):
                out[f.name] = str(value)
            else:
                out[f.name] = value
        return out
