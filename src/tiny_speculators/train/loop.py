"""The training loop, visible end to end: plan -> micro-batches -> the family's objective (e.g. a TTT rollout)
-> exact loss normalization -> backward (grad accumulation, DDP/FSDP sync on the last micro-batch) -> clip ->
optimizer step -> reduced metrics -> eval / checkpoint / best.

Loss normalization is global: each loss group's sum (e.g. each TTT step's summed KL) is divided by that group's
count of loss positions over the WHOLE optimizer step (all ranks, all accumulation micro-batches; one small
all-reduce before the forward passes), so grad-accum 2 x batch 1, batch 2 x accum 1 and 2 ranks x batch 1 all
compute the same gradient. Metrics are reduced as sums and counts for the same reason. The loop knows nothing
of the family: the objective gives ``loss_counts``, ``new_stats`` and ``summarize``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from tiny_speculators.errors import UserError
from tiny_speculators.train import distributed as D
from tiny_speculators.train.data import batch_tokens_of, eval_share, plan_epoch, rank_share
from tiny_speculators.train.metrics import MetricsLogger
from tiny_speculators.train.schedule import lr_at, set_lr

if TYPE_CHECKING:  # options.py imports the stage, which imports this loop
    from tiny_speculators.train.options import TrainOptions

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0
    tokens_seen: int = 0
    best_accept: float | None = None
    elapsed: float = 0.0
    history: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "tokens_seen": self.tokens_seen, "best_accept": self.best_accept, "elapsed": self.elapsed}


class StopRequested:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the next step boundary and stops."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequested:
        for s in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        log.warning("received signal %d: writing a checkpoint at the end of this step, then stopping", signum)
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def reduce_stats(stats: dict[str, torch.Tensor], info: D.DistInfo) -> dict[str, torch.Tensor]:
    """Exact sum over ranks of every statistic, in one all-reduce."""
    keys = sorted(stats)
    flat = torch.cat([stats[k].reshape(-1).double() for k in keys])
    D.all_reduce_sum(flat, info)
    out, i = {}, 0
    for k in keys:
        n = stats[k].numel()
        out[k] = flat[i:i + n].clone().view_as(stats[k])
        i += n
    return out


def with_aux_noise(batch: dict[str, Any], std: float) -> dict[str, Any]:
    """The batch with Gaussian noise of ``std`` on the verifier's aux hidden states (training only), drawn from
    torch's global RNG (seeded, and checkpointed in ``rng.pt``, so a resumed run draws the same noise)."""
    if std <= 0 or "aux_hidden_states" not in batch:
        return batch
    aux = batch["aux_hidden_states"]
    noise = torch.randn(aux.shape, device=aux.device, dtype=torch.float32)
    return {**batch, "aux_hidden_states": (aux.float() + std * noise).to(aux.dtype)}


def with_loss_positions(batch: dict[str, Any], positions: str) -> dict[str, Any]:
    """The batch whose loss mask marks ``positions``: ``answer`` keeps prepare's mask, ``all`` marks every real
    token (the attention mask, which every batch carries: padding stays out)."""
    if positions == "answer":
        return batch
    return {**batch, "loss_mask": (batch["attention_mask"] != 0).to(batch["loss_mask"].dtype)}


def _add(stats: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    for k in stats:
        stats[k] += metrics[k]


def evaluate(model: nn.Module, objective, source, val_idx: list[int], lengths: list[int], cfg: TrainOptions,
             info: D.DistInfo) -> dict[str, Any] | None:
    """Metrics on the validation split (each sample once across ranks)."""
    if not val_idx:
        return None
    shares = [eval_share(val_idx, lengths, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, rank=r,
                         world_size=info.world_size, pack=cfg.pack) for r in range(info.world_size)]
    mine = shares[info.rank]
    n_forward = max(len(s) for s in shares)  # FSDP needs every rank to run the same number of forwards
    stats = objective.new_stats(info.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(n_forward if mine else 0):
            batch = source.batch(mine[min(i, len(mine) - 1)], info.device, cfg.pack)
            with _autocast(info.device, cfg.precision):
                out = model(batch)
            if i < len(mine):
                _add(stats, out.metrics)
    model.train(was_training)
    return objective.summarize(reduce_stats(stats, info))


def train_loop(*, cfg: TrainOptions, max_steps: int, info: D.DistInfo, model: nn.Module, objective,
               optimizer: torch.optim.Optimizer, source, train_idx: list[int], val_idx: list[int], state: TrainState,
               save_checkpoint: Callable[[TrainState], Path], save_best: Callable[[TrainState, dict], None],
               logger: MetricsLogger) -> dict[str, Any]:
    """Run optimizer steps ``state.step .. max_steps``; returns the last train/val metrics.

    ``model`` is the (DDP/FSDP-wrapped) objective the forward goes through; ``objective`` the same module
    unwrapped, for its ``loss_counts`` / ``new_stats`` / ``summarize``."""
    lengths = source.lengths()
    micro_per_step = info.world_size * cfg.grad_accum
    plan = plan_epoch(train_idx, lengths, epoch=state.epoch, seed=cfg.seed, batch_size=cfg.batch_size,
                      batch_tokens=cfg.batch_tokens, micro_per_step=micro_per_step, pack=cfg.pack)
    if not plan:
        raise UserError(f"{len(train_idx)} training samples do not fill one optimizer step of {micro_per_step} "
                        f"micro-batches (world size {info.world_size} x grad_accum {cfg.grad_accum}); "
                        "lower batch_size / grad_accum or add data")
    bar = None
    if info.is_main and cfg.progress:
        bar = tqdm(total=max_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True)
    last_train: dict[str, Any] = {}
    last_val: dict[str, Any] | None = None
    last_saved: Path | None = None
    model.train()
    with StopRequested() as stop:
        while state.step < max_steps:
            if state.step_in_epoch >= len(plan):
                state.epoch += 1
                state.step_in_epoch = 0
                plan = plan_epoch(train_idx, lengths, epoch=state.epoch, seed=cfg.seed, batch_size=cfg.batch_size,
                                  batch_tokens=cfg.batch_tokens, micro_per_step=micro_per_step, pack=cfg.pack)
            t0 = time.perf_counter()
            micro = rank_share(plan[state.step_in_epoch], info.rank, info.world_size)
            batches = [with_loss_positions(source.batch(idx, info.device, cfg.pack), cfg.loss_positions)
                       for idx in micro]
            # global per-group counts of loss positions -> the normalizer of this optimizer step
            counts = torch.stack([objective.loss_counts(b) for b in batches]).sum(0).float()
            D.all_reduce_sum(counts, info)
            normalizer = counts.clamp(min=1)
            lr = lr_at(state.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=max_steps,
                       min_lr_ratio=cfg.min_lr_ratio)
            set_lr(optimizer, lr)
            stats = objective.new_stats(info.device)
            tokens = 0
            for i, batch in enumerate(batches):
                batch = with_aux_noise(batch, cfg.aux_noise_std)
                with D.no_sync(model, skip=i < len(batches) - 1), _autocast(info.device, cfg.precision):
                    out = model(batch, normalizer)
                    # DDP/FSDP average gradients over ranks; the loss is a share of a global sum: undo the average
                    (out.loss * info.world_size).backward()
                _add(stats, out.metrics)
                tokens += batch_tokens_of(batch)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad],
                cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            totals = reduce_stats(stats, info)
            tok = torch.tensor([tokens], dtype=torch.float64, device=info.device)
            D.all_reduce_sum(tok, info)
            metrics = objective.summarize(totals)
            if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                where = f"{last_saved}" if last_saved else "none was written yet in this run"
                raise UserError(f"the loss became {metrics['loss']} (grad norm {grad_norm}) at step {state.step + 1}; "
                                f"stopped without updating the weights; last good checkpoint: {where}. "
                                "Lower the learning rate or check the hidden states for inf/nan")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.step_in_epoch += 1
            state.tokens_seen += int(tok.item())
            dt = time.perf_counter() - t0
            state.elapsed += dt
            last_train = metrics
            if state.step % cfg.log_every == 0 or state.step == max_steps:
                logger.log(state.step, {**{f"train/{k}": v for k, v in metrics.items()}, "lr": lr,
                                        "grad_norm": grad_norm, "tokens_per_s": tok.item() / max(dt, 1e-9),
                                        "tokens_seen": state.tokens_seen, "epoch": state.epoch})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{(metrics.get('acc') or [math.nan])[0]:.3f}",
                                tok_s=f"{tok.item() / max(dt, 1e-9):.0f}")
            done = state.step >= max_steps
            if val_idx and (done or (cfg.eval_every > 0 and state.step % cfg.eval_every == 0)):
                last_val = evaluate(model, objective, source, val_idx, lengths, cfg, info)
                logger.log(state.step, {f"val/{k}": v for k, v in last_val.items()})
                if state.best_accept is None or last_val["accept_len"] > state.best_accept:
                    state.best_accept = last_val["accept_len"]
                    save_best(state, last_val)
            stop_now = torch.tensor([1.0 if stop.signum is not None else 0.0], device=info.device)
            D.all_reduce_max(stop_now, info)
            if (cfg.save_every > 0 and state.step % cfg.save_every == 0) or done or stop_now.item() > 0:
                last_saved = save_checkpoint(state)
            if stop_now.item() > 0:
                if bar is not None:
                    bar.close()
                log.warning("stopped by a signal after step %d; checkpoint %s; continue with --resume",
                            state.step, last_saved)
                raise KeyboardInterrupt
    if bar is not None:
        bar.close()
    return {"train": last_train, "val": last_val}
