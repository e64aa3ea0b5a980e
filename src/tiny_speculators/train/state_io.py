"""Full (unsharded) state dicts of the draft and its optimizer, whatever wraps the model: the seam between the
checkpoint files and the parallelism strategy. Plain and DDP models hold full tensors; FSDP2 gathers shards
(collective: every rank must call).

    io = state_io(model, draft, optimizer, fsdp=False)
    model_sd, optim_sd = io.full_state(with_optimizer=True)
    io.load(model_sd, optim_sd, where="step_000200")
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tiny_speculators.errors import UserError

__all__ = ["FSDPStateIO", "LocalStateIO", "StateIO", "state_io"]


class StateIO(Protocol):
    def full_state(self, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict | None]: ...

    def cpu_draft(self, model_sd: dict[str, torch.Tensor]) -> nn.Module:
        """A draft module holding ``model_sd`` on the CPU, for saving."""
        ...

    def load(self, model_sd: dict[str, torch.Tensor], optim_sd: dict, where: str) -> None: ...


class LocalStateIO:
    """One process or DDP: the draft's own tensors are complete on every rank."""

    def __init__(self, draft: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.draft, self.optimizer = draft, optimizer

    def full_state(self, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict | None]:
        return self.draft.state_dict(), (self.optimizer.state_dict() if with_optimizer else None)

    def cpu_draft(self, model_sd: dict[str, torch.Tensor]) -> nn.Module:
        return self.draft

    def load(self, model_sd: dict[str, torch.Tensor], optim_sd: dict, where: str) -> None:
        missing, unexpected = self.draft.load_state_dict(model_sd, strict=False)
        if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
            raise UserError(f"{where}/model.safetensors does not match the draft being trained "
                            f"(missing {missing}, unexpected {unexpected})")
        self.optimizer.load_state_dict(optim_sd)


class FSDPStateIO:
    """FSDP2 (``fully_shard`` on the objective module whose submodule is ``draft``): gather to / scatter from
    full state dicts on the CPU (names without the ``draft.`` prefix)."""

    def __init__(self, model: nn.Module, draft: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.draft, self.optimizer = model, draft, optimizer

    def full_state(self, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict | None]:
        from torch.distributed.checkpoint.state_dict import (  # here: 1.5 s to import, for FSDP runs only
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=opts)
        model_sd = {k.removeprefix("draft."): v for k, v in model_sd.items()}
        optimizers = getattr(self.optimizer, "optimizers", self.optimizer)  # an OptimizerGroup: its members
        optim_sd = get_optimizer_state_dict(self.model, optimizers, options=opts) if with_optimizer else None
        return model_sd, optim_sd

    def cpu_draft(self, model_sd: dict[str, torch.Tensor]) -> nn.Module:
        cpu = type(self.draft)(**self.draft.kwargs)
        cpu.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in model_sd.items()})
        return cpu

    def load(self, model_sd: dict[str, torch.Tensor], optim_sd: dict, where: str) -> None:
        from torch.distributed.checkpoint.state_dict import (  # here: 1.5 s to import, for FSDP runs only
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, {f"draft.{k}": v for k, v in model_sd.items()}, options=opts)
        optimizers = getattr(self.optimizer, "optimizers", self.optimizer)
        set_optimizer_state_dict(self.model, optimizers, optim_state_dict=optim_sd, options=opts)


def state_io(model: nn.Module, draft: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> StateIO:
    return FSDPStateIO(model, draft, optimizer) if fsdp else LocalStateIO(draft, optimizer)
