"""The ``train`` stage: train an EAGLE-3 draft against a frozen verifier, offline (from ``extract``'s shards)
or online (the verifier runs in this process), on one process or many (``torchrun``).

    # tiny CPU run on the embedded verifier (after prepare / vocab / extract)
    tiny-speculators train --verifier smollm2-135m --hidden-states runs/hs --vocab runs/vocab --out runs/draft \
        --max-steps 50 --batch-size 2
    # online, no disk for hidden states
    tiny-speculators train --verifier smollm2-135m --data runs/prepared --online --vocab runs/vocab --out runs/draft
    # 8 GPUs, FSDP2, bf16
    torchrun --nproc-per-node 8 -m tiny_speculators.cli train --verifier Qwen/Qwen3-8B --hidden-states hs \
        --vocab vocab --out draft --fsdp --precision bf16 --batch-tokens 16384
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tiny_speculators.errors import UserError
from tiny_speculators.train import checkpoint as C
from tiny_speculators.train import distributed as D
from tiny_speculators.train.data import split_train_val
from tiny_speculators.train.loop import LoopConfig, TrainState, train_loop
from tiny_speculators.train.metrics import MetricsLogger, plot_metrics

log = logging.getLogger(__name__)


def train(
    verifier: str,
    vocab: Path,
    out: Path,
    hidden_states: Path | None = None,
    data: Path | None = None,
    online: bool = False,
    max_steps: int | None = None,
    epochs: int = 1,
    batch_size: int = 1,
    batch_tokens: int | None = None,
    pack: bool = False,
    max_length: int | None = None,
    grad_accum: int = 1,
    lr: float = 3e-4,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    max_grad_norm: float = 0.5,
    ttt_steps: int = 3,
    decay: float = 0.8,
    eval_fraction: float = 0.05,
    eval_every: int = 100,
    save_every: int = 200,
    keep_last: int = 3,
    resume: bool = False,
    seed: int = 0,
    precision: Literal["fp32", "bf16"] = "fp32",
    attention: Literal["sdpa", "flex"] = "sdpa",
    fsdp: bool = False,
    device: str = "auto",
    init_from: Path | None = None,
    init_lm_head: bool = True,
    layer_type: Literal["auto", "llama", "qwen3"] = "auto",
    fc_norm: bool = False,
    norm_before_residual: bool = False,
    aux_layer_ids: list[int] | None = None,
    log_every: int = 1,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Train an EAGLE-3 draft with training-time test (TTT) against a frozen verifier.

    Args:
        verifier: HF id, local folder, or an embedded name (smollm2-135m); the model the draft speculates for.
        vocab: vocab output folder (vocab.safetensors with d2t / t2d).
        out: output folder: step_XXXXXX/ checkpoints, best/, final/, metrics.jsonl, tb/, training.png, summary.json.
        hidden_states: extract output folder (offline training).
        data: prepare output folder (online training; needs --online).
        online: run the verifier in this process to produce hidden states on the fly (no disk).
        max_steps: optimizer steps; default: epochs x steps per epoch.
        epochs: passes over the training split when max_steps is not given.
        batch_size: samples per micro-batch (per process) when batch_tokens is not set.
        batch_tokens: token budget per micro-batch (padded tokens, or packed tokens with --pack) instead of batch_size.
        pack: pack samples into one row with document ids (no attention across samples) instead of padding.
        max_length: truncate online samples to this many tokens.
        grad_accum: micro-batches per optimizer step and process.
        lr: peak learning rate (AdamW).
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of lr.
        weight_decay: AdamW weight decay (not applied to norm weights).
        max_grad_norm: gradient clipping norm (0 disables clipping).
        ttt_steps: TTT rollout length K (draft steps trained per position).
        decay: weight of TTT step k's loss is decay**k.
        eval_fraction: fraction of samples held out for validation (best/ is chosen on it).
        eval_every: validate every N steps (0: only at the end).
        save_every: write a checkpoint every N steps (and always at the end).
        keep_last: keep the newest N step checkpoints (0 keeps all).
        resume: continue from the latest checkpoint in out exactly (same data order, optimizer, RNG).
        seed: seed for initialization, the data order and the validation split.
        precision: fp32, or bf16 autocast with fp32 master weights and optimizer state.
        attention: sdpa (explicit masks, everywhere) or flex (flex-attention block masks).
        fsdp: shard the draft with FSDP2 (fully_shard) instead of DDP (needs torchrun).
        device: auto (cuda if available), cpu, or cuda.
        init_from: start from this draft: one of our checkpoints (or a train output folder), or a published
            draft in vLLM speculators or SGLang EAGLE-3 format; its vocabulary must equal --vocab.
        init_lm_head: initialize lm_head from the verifier's lm_head rows of the draft vocabulary.
        layer_type: draft decoder layer: auto (qwen3 for Qwen3 verifiers, else llama), llama, or qwen3.
        fc_norm: RMSNorm each aux chunk before fc (EAGLE 3.1).
        norm_before_residual: use hidden_norm(h) as the residual (vLLM's flag).
        aux_layer_ids: verifier layers fused in online mode (default [2, N//2, N-3]); offline uses the manifest's.
        log_every: write metrics every N steps.
        progress: show a progress bar.
        trust_remote_code: allow the verifier's custom code from the hub.
    """
    from tiny_speculators.train.setup import build_run

    out = Path(out)
    if online == (hidden_states is not None):
        raise UserError("give either --hidden-states DIR (offline) or --data PREPARED_DIR --online")
    if online and data is None:
        raise UserError("--online needs --data PREPARED_DIR (a prepare output folder)")
    if not online and data is not None:
        raise UserError("--data is for online training; add --online, or train offline with --hidden-states")
    for name, v in (("grad_accum", grad_accum), ("batch_size", batch_size), ("ttt_steps", ttt_steps),
                    ("epochs", epochs), ("log_every", log_every)):
        if v < 1:
            raise UserError(f"{name} must be at least 1, got {v}")
    if attention == "flex":
        from tiny_speculators.models.eagle3.attention import flex_available

        if not flex_available():
            raise UserError("attention 'flex' needs torch.nn.attention.flex_attention; use --attention sdpa")
    info = D.setup_distributed(device)
    try:
        return _train(info, locals(), build_run)
    finally:
        D.teardown_distributed()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _train(info: D.DistInfo, args: dict[str, Any], build_run) -> dict[str, Any]:
    out: Path = args["out"]
    resume_from = C.latest_checkpoint(out) if args["resume"] else None
    if args["resume"] and resume_from is None:
        log.warning("--resume: no checkpoint in %s yet; starting from scratch", out)
    if not args["resume"] and C.list_checkpoints(out):
        raise UserError(f"{out} already holds checkpoints; pass --resume to continue or choose a new --out")
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    D.barrier(info)
    _seed_everything(args["seed"])
    run = build_run(info, args)
    train_idx, val_idx = split_train_val(len(run.source), args["eval_fraction"], args["seed"])
    state = TrainState()
    if resume_from is not None:
        state = run.load_checkpoint(resume_from)
        log.info("resumed from %s (step %d, epoch %d)", resume_from, state.step, state.epoch)
    micro_per_step = info.world_size * args["grad_accum"]
    from tiny_speculators.train.data import plan_epoch

    steps_per_epoch = len(plan_epoch(train_idx, run.source.lengths(), epoch=0, seed=args["seed"],
                                     batch_size=args["batch_size"], batch_tokens=args["batch_tokens"],
                                     micro_per_step=micro_per_step, pack=args["pack"]))
    max_steps = args["max_steps"] if args["max_steps"] is not None else args["epochs"] * steps_per_epoch
    cfg = LoopConfig(
        out=out, max_steps=max_steps, ttt_steps=args["ttt_steps"], decay=args["decay"], lr=args["lr"],
        warmup_steps=args["warmup_steps"], min_lr_ratio=args["min_lr_ratio"], max_grad_norm=args["max_grad_norm"],
        grad_accum=args["grad_accum"], batch_size=args["batch_size"], batch_tokens=args["batch_tokens"],
        pack=args["pack"], seed=args["seed"], precision=args["precision"], attention=args["attention"],
        eval_every=args["eval_every"], save_every=args["save_every"], log_every=args["log_every"],
        progress=args["progress"],
    )
    logger = MetricsLogger(out, enabled=info.is_main, resume_step=state.step if resume_from else None)
    log.info("training %s: %d train / %d val samples, %d steps/epoch, %d steps, world size %d",
             "online" if args["online"] else "offline", len(train_idx), len(val_idx), steps_per_epoch, max_steps,
             info.world_size)
    t0 = time.perf_counter()
    try:
        result = train_loop(cfg=cfg, info=info, model=run.model, optimizer=run.optimizer, source=run.source,
                            train_idx=train_idx, val_idx=val_idx,
                            state=state, save_checkpoint=lambda s: run.save_checkpoint(s, keep_last=args["keep_last"]),
                            save_best=run.save_best, logger=logger)
    finally:
        logger.close()
    run.save_final(state)
    summary = {
        "verifier": args["verifier"], "mode": "online" if args["online"] else "offline", "steps": state.step,
        "epochs_started": state.epoch + 1, "tokens_seen": state.tokens_seen, "world_size": info.world_size,
        "train_seconds": round(time.perf_counter() - t0, 2), "best_val_accept_len": state.best_accept,
        "final_train": result["train"], "final_val": result["val"], "ttt_steps": cfg.ttt_steps,
        "draft_parameters": run.trainable_parameters, "out": str(out),
    }
    if info.is_main:
        plot_metrics(out)
        C.write_json_atomic(out / "summary.json", summary)
        _print_summary(summary)
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="train")
    table.add_column("metric")
    table.add_column("value")
    ft, fv = summary["final_train"] or {}, summary["final_val"] or {}
    rows = [("mode", summary["mode"]), ("steps", summary["steps"]), ("tokens seen", summary["tokens_seen"]),
            ("train loss", f"{ft.get('loss', float('nan')):.4f}"),
            ("train acc per step", json.dumps([round(a, 3) for a in ft.get("acc", [])])),
            ("val acc per step", json.dumps([round(a, 3) for a in fv.get("acc", [])]) if fv else "-"),
            ("val accept length", f"{fv['accept_len']:.3f}" if fv else "-"),
            ("seconds", summary["train_seconds"]), ("out", summary["out"])]
    for k, v in rows:
        table.add_row(k, str(v))
    Console(stderr=True).print(table)
