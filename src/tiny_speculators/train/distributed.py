"""One process or many under ``torchrun``: process-group setup, model wrapping (DDP / FSDP2), exact reductions.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK (and the rendezvous for multi-node runs); without them
the trainer runs as a single process and every helper here is a no-op. CPU runs use the gloo backend.

    torchrun --nproc-per-node 2 -m tiny_speculators.cli train --verifier smollm2-135m \
        --hidden-states runs/hs --vocab runs/vocab --out runs/draft
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def setup_distributed(device: str = "auto") -> DistInfo:
    """Join the ``torchrun`` process group if there is one (nccl on GPU, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if world_size > 1 else (dev.index or 0))
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


# set when this process left a gloo group: see teardown_distributed
_gloo_threads_outlive_teardown = False


def teardown_distributed() -> None:
    """Leave the process group.

    A gloo backend's worker threads outlive ``destroy_process_group`` (the DDP / FSDP objects keep the backend), and
    one that drops a finished collective (FSDP's all-gathers hold Python tensors) after the interpreter has begun to
    finalize takes the GIL there and aborts the process ("terminate called without an active exception", SIGABRT):
    under CPU load a rank that got done first failed the whole torchrun job now and then. Such a process ends
    through :func:`exit_without_finalizing` instead."""
    global _gloo_threads_outlive_teardown
    if dist.is_initialized():
        _gloo_threads_outlive_teardown |= "gloo" in str(dist.get_backend())
        dist.destroy_process_group()


def exit_without_finalizing(code: int) -> None:
    """End a process that ran a gloo group with ``code`` once logs and streams are flushed, skipping the
    interpreter's finalization that gloo's threads may crash (see :func:`teardown_distributed`); else return."""
    if not _gloo_threads_outlive_teardown:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (in place, returned). Metrics are reduced as sums and counts, so means stay exact."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` for one process."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def wrap_model(model: nn.Module, info: DistInfo, fsdp: bool) -> nn.Module:
    """DDP (default) or FSDP2 ``fully_shard`` (one group: a draft is one or a few small decoder layers); unchanged for
    one process without FSDP. Frozen parameters (the embedding) are excluded from gradient sync by DDP."""
    if fsdp:
        if not dist.is_initialized():  # FSDP2 needs a process group, even of size 1
            raise UserError("--fsdp needs a process group: launch with torchrun (it may be --nproc-per-node 1)")
        fully_shard(model)
        return model
    if info.enabled:
        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def no_sync(model: nn.Module, skip: bool):
    """Skip DDP's gradient all-reduce on all but the last micro-batch of an accumulation window."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    if skip and hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return _restore_sync(model)
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(True)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restore_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
