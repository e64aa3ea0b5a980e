"""The ``train`` stage's options as one typed, frozen object: built once from the stage's arguments (whose
signature is the config) and handed to the setup, the loop and the checkpoints.

``family`` holds the chosen draft family's own options (the dataclass in ``models/<family>/``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TrainOptions:
    verifier: str
    out: Path
    vocab: Path | None
    algorithm: str
    family: Any
    hidden_states: Path | None = None
    data: Path | None = None
    online: bool = False
    producer: str = "hf"
    producer_urls: list[str] | None = None
    producers: int = 1
    mooncake_master: str | None = None
    producer_timeout: float = 300.0
    vllm_venv: Path | None = None
    max_steps: int | None = None
    epochs: int = 1
    batch_size: int = 1
    batch_tokens: int | None = None
    pack: bool = False
    max_length: int | None = None
    grad_accum: int = 1
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    eval_fraction: float = 0.05
    eval_every: int = 100
    save_every: int = 200
    keep_last: int = 3
    resume: bool = False
    seed: int = 0
    precision: str = "fp32"
    attention: str = "sdpa"
    fsdp: bool = False
    device: str = "auto"
    init_from: Path | None = None
    init_lm_head: bool = True
    aux_layer_ids: list[int] | None = None
    log_every: int = 1
    progress: bool = True
    trust_remote_code: bool = False
    loss: dict[str, float] | None = None
    position_weights: str = "decay"
    dpace_alpha: float = 0.5
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    aux_noise_std: float = 0.0
    loss_positions: str = "answer"
    freeze: list[str] | None = None

    # the training recipe: what a summary reports next to the family's options
    RECIPE_KEYS = ("loss", "position_weights", "dpace_alpha", "optimizer", "muon_momentum", "muon_weight_decay",
                   "aux_noise_std", "loss_positions", "freeze")

    # what a checkpoint records and a resume compares (the data order depends on these)
    ORDER_KEYS = ("batch_size", "batch_tokens", "pack", "grad_accum", "seed")

    @property
    def mode(self) -> str:
        """offline, online, or online-vllm (hidden states from vLLM producers)."""
        if not self.online:
            return "offline"
        return "online-vllm" if self.producer == "vllm" else "online"

    def recipe(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RECIPE_KEYS}

    def loss_spec(self):
        from tiny_speculators.models.losses import LossSpec

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
