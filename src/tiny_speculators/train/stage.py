"""The ``train`` stage: train a draft of any family (``--algorithm``) against a frozen verifier,
offline (from ``extract``'s shards) or online (the verifier runs in this process), on one process or many
(``torchrun``). Loop options are flat; a family's own options sit in its section (``--<family>-<option> V``,
YAML ``train: {algorithm: <family>, <family>: {<option>: V}}``).

    # tiny CPU run on the embedded verifier (after prepare / vocab / extract)
    tiny-speculators train --verifier smollm2-135m --hidden-states runs/hs --vocab runs/vocab --out runs/draft \
        --max-steps 50 --batch-size 2
    # online, no disk for hidden states
    tiny-speculators train --verifier smollm2-135m --data runs/prepared --online --vocab runs/vocab --out runs/draft
    # online from vLLM producers through a Mooncake store (started here, on 127.0.0.1, and stopped afterwards)
    torchrun --nproc-per-node 2 -m tiny_speculators.cli train --verifier smollm2-135m --data runs/prepared \
        --online --producer vllm --producers 1 --vocab runs/vocab --out runs/draft
    # 8 GPUs, FSDP2, bf16
    torchrun --nproc-per-node 8 -m tiny_speculators.cli train --verifier Qwen/Qwen3-8B --hidden-states hs \
        --vocab vocab --out draft --fsdp --precision bf16 --batch-tokens 16384
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.errors import UserError
from tiny_speculators.models import DEFAULT_ALGORITHM, FAMILIES, Algorithm, get_family
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.options import parse_options
from tiny_speculators.serving import sigterm_as_exit
from tiny_speculators.tables import print_summary_table
from tiny_speculators.train import checkpoint as C
from tiny_speculators.train import distributed as D
from tiny_speculators.train.data import plan_epoch, replay_sample, split_train_val
from tiny_speculators.train.loop import TrainState, train_loop
from tiny_speculators.train.metrics import MetricsLogger, plot_metrics

if TYPE_CHECKING:  # train/options.py reads its fields from train's signature, so it imports this module
    from tiny_speculators.train.options import TrainOptions

log = logging.getLogger(__name__)


def train(
    verifier: str,
    out: Path,
    vocab: Path | None = None,
    hidden_states: Path | None = None,
    data: Path | None = None,
    online: bool = False,
    producer: Literal["hf", "vllm"] = "hf",
    producer_urls: list[str] | None = None,
    producers: int = 1,
    mooncake_master: str | None = None,
    producer_timeout: float = 300.0,
    vllm_venv: Path | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
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
    aux_layer_ids: list[int] | None = None,
    log_every: int = 1,
    progress: bool = True,
    trust_remote_code: bool = False,
    loss: dict[str, float] | None = None,
    position_weights: Literal["decay", "dpace", "aligned"] = "decay",
    dpace_alpha: float = 0.5,
    optimizer: Literal["adamw", "muon"] = "adamw",
    muon_momentum: float = 0.95,
    muon_weight_decay: float = 0.1,
    aux_noise_std: float = 0.0,
    loss_positions: Literal["answer", "all"] = "answer",
    freeze: list[str] | None = None,
    replay: float | None = None,
    **family_options: Any,
) -> dict[str, Any]:
    """Train a draft (of the default family unless --algorithm says otherwise) against a frozen verifier.

    Args:
        verifier: HF id, local folder, or an embedded name (smollm2-135m); the model the draft speculates for.
        out: output folder: step_XXXXXX/ checkpoints, best/, final/, metrics.jsonl, tb/, training.png, summary.json.
        vocab: vocab output folder (vocab.safetensors with d2t / t2d); not used (and not needed) by families that
            predict over the verifier's whole vocabulary; left out with --init-from, the draft keeps its own.
        hidden_states: extract output folder (offline training).
        data: prepare output folder (online training; needs --online).
        online: run the verifier in this process to produce hidden states on the fly (no disk).
        producer: what computes the hidden states online: hf (the verifier in this process) or vllm (vLLM
            servers that put them into a Mooncake store; the ranks fetch and delete them).
        producer_urls: running vLLM producers (http://HOST:PORT, each started with this run's layer ids and
            --mooncake-master; see tiny_speculators.producers); default: start --producers of them here.
        producers: how many vLLM producers to start on 127.0.0.1 when --producer-urls is not given.
        mooncake_master: HOST:PORT of a running Mooncake master; default: start one on 127.0.0.1.
        producer_timeout: seconds a sample may take to arrive, over all producers and retries, before the run stops;
            a producer that has not answered within a third of it is set aside and the sample asked of another.
        vllm_venv: the vLLM environment the producers run from (default: $TINY_SPECULATORS_VLLM_VENV or
            ~/.cache/tiny-speculators/vllm-venv; built by scripts/vllm_env.sh when missing).
        algorithm: the draft family to train (models/<family>/); its own options go in the section of that name.
        max_steps: optimizer steps; default: epochs x steps per epoch.
        epochs: passes over the training split when max_steps is not given.
        batch_size: samples per micro-batch (per process) when batch_tokens is not set.
        batch_tokens: token budget per micro-batch (padded tokens, or packed tokens with --pack) instead of batch_size.
        pack: pack samples into one row with document ids (no attention across samples) instead of padding.
        max_length: truncate online samples to this many tokens.
        grad_accum: micro-batches per optimizer step and process.
        lr: peak learning rate (AdamW, and Muon's with --optimizer muon).
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of lr.
        weight_decay: AdamW weight decay (not applied to norm weights).
        max_grad_norm: gradient clipping norm (0 disables clipping).
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
            draft in vLLM speculators or SGLang format; its vocabulary must equal --vocab (or leave --vocab out:
            it keeps its own), and it keeps its own shape and weights (a shape option of the family set to another
            value than the draft's, or an option that initializes a fresh draft, is an error).
        init_lm_head: initialize lm_head from the verifier's lm_head rows of the draft vocabulary.
        aux_layer_ids: verifier layers the draft reads (default: the family's own);
            offline, any subset of the stored layers (default: all of them), so one extraction serves several
            families.
        log_every: write metrics every N steps.
        progress: show a progress bar.
        trust_remote_code: allow the verifier's custom code from the hub.
        loss: loss terms and their weights (models/losses.py), e.g. {kl: 1.0} or {ce: 0.1, tv: 0.9}
            (--loss kl=1.0 / --loss ce=0.1 tv=0.9): kl, rkl, jsd, tv, ce (to the verifier's argmax), lk (LK hybrid,
            lam*KL + (1-lam)*TV with lam = exp(-3*alpha)); default: the family's own (forward KL for most).
        position_weights: decay (each family's fixed per-position decay), dpace (D-PACE: weights from the draft's
            current per-position acceptance, along each chain) or aligned (GRIFFIN's token-alignable training: the
            fixed decay, masked to 0 after a position where the draft's argmax missed the verifier's).
        dpace_alpha: D-PACE smoothing: each position's acceptance is (1 - a) * q + a.
        optimizer: adamw, or muon (torch.optim.Muon on the 2-D hidden weight matrices, AdamW on embeddings,
            lm_head, norms and biases; both at lr). Muon's Newton-Schulz runs in bf16, so DDP / FSDP2 runs (FSDP2:
            on the sharded DTensors, orthogonalizing the full matrices) agree with one process only to bf16 rounding.
        muon_momentum: Muon's momentum.
        muon_weight_decay: Muon's weight decay.
        aux_noise_std: std of Gaussian noise added to the verifier's aux hidden states in training (not in
            validation); drawn from the seeded, checkpointed RNG, so runs and resumes are reproducible.
        loss_positions: which positions the draft learns from in training: answer (the tokens prepare's loss mask
            marks, what the assistant writes) or all (every token of every sample, prompts and chat template
            included: the stored targets are the verifier's own distribution at every position). Validation
            always measures the answers.
        freeze: draft parameters kept at their initial values (no gradient, not in the optimizer), by name or name
            prefix, e.g. lm_head (the verifier's own rows when init_lm_head) or layers.0.mlp (the verifier's layer
            with the family's verifier init): fewer weights to fit the same data.
        replay: a refresh from an extraction made with `extract --reuse` (and a draft to continue, --init-from):
            train on the samples it computed anew plus this fraction (0-1) of those it took over from the earlier
            extraction, a seeded draw (so the draft keeps what it learnt without paying for all of it again);
            default: every sample. Offline only.
    """
    arguments = dict(locals())  # the signature's values: read first, before any other name is bound here
    del arguments["family_options"]
    opts = _checked(_typed(arguments, _family_options(algorithm, family_options)))
    info = D.setup_distributed(device)
    try:
        return _train(info, opts)
    finally:
        D.teardown_distributed()


# the family sections this stage takes (config.bind validates them against each family's options)
train.option_sections = {name: family.options for name, family in FAMILIES.items()}


def _family_options(algorithm: str, family_options: dict[str, Any]) -> Any:
    """The chosen family's own options (its dataclass) from its section; sections of other families are errors."""
    unknown = sorted(set(family_options) - set(FAMILIES))
    if unknown:
        raise UserError(f"unknown train option(s) {', '.join(unknown)}")
    strays = sorted(n for n, v in family_options.items() if v and n != algorithm)
    if strays:
        raise UserError(f"options for {', '.join(strays)} given, but the algorithm is {algorithm!r}: "
                        "remove them or choose that algorithm")
    return parse_options(get_family(algorithm).options, family_options.get(algorithm), f"train.{algorithm}")


def _typed(arguments: dict[str, Any], family: Any) -> TrainOptions:
    """``train``'s arguments as one frozen object (paths as ``Path``, sequences as fresh lists and dicts)."""
    from tiny_speculators.train.options import TrainOptions  # a cycle at the top (see TYPE_CHECKING above)

    a = dict(arguments)
    a["out"] = Path(a["out"])
    a["vocab"] = None if a["vocab"] is None else Path(a["vocab"])
    a["producer_urls"] = list(a["producer_urls"]) if a["producer_urls"] else None
    a["loss"] = dict(a["loss"]) if a["loss"] else None
    a["freeze"] = list(a["freeze"]) if a["freeze"] else None
    return TrainOptions(**a, family=family)


def _checked(opts: TrainOptions) -> TrainOptions:
    """``opts`` once every option agrees with the others (one-line errors naming them); a ``--vocab`` the family
    does not use is dropped."""
    family = get_family(opts.algorithm)
    if opts.vocab is None and not family.uses_verifier_vocab and opts.init_from is None:
        raise UserError(f"--vocab is required for {opts.algorithm} (the vocab stage's output folder; with "
                        "--init-from the draft's own vocabulary is kept)")
    if opts.vocab is not None and family.uses_verifier_vocab:
        log.info("%s drafts over the verifier's whole vocabulary: --vocab %s is not used", opts.algorithm, opts.vocab)
        opts = dataclasses.replace(opts, vocab=None)
    _check_sources(opts)
    _check_numbers(opts)
    _check_loss_and_attention(opts)
    return opts


def _check_sources(opts: TrainOptions) -> None:
    """Offline from shards, or online from prepared data (in this process or from vLLM producers)."""
    if opts.online == (opts.hidden_states is not None):
        raise UserError("give either --hidden-states DIR (offline) or --data PREPARED_DIR --online")
    if opts.online and opts.data is None:
        raise UserError("--online needs --data PREPARED_DIR (a prepare output folder)")
    if not opts.online and opts.data is not None:
        raise UserError("--data is for online training; add --online, or train offline with --hidden-states")
    if opts.producer == "vllm" and not opts.online:
        raise UserError("--producer vllm is a way of online training: add --online --data PREPARED_DIR")
    if opts.producer != "vllm" and (opts.producer_urls or opts.mooncake_master):
        raise UserError("--producer-urls / --mooncake-master are for --producer vllm")
    if opts.replay is not None and opts.online:
        raise UserError("--replay picks among the samples an `extract --reuse` took over: it is for offline training")
    if opts.replay is not None and not 0.0 <= opts.replay <= 1.0:
        raise UserError(f"replay must be a fraction in [0, 1], got {opts.replay}")


def _check_numbers(opts: TrainOptions) -> None:
    for name, v in (("grad_accum", opts.grad_accum), ("batch_size", opts.batch_size), ("epochs", opts.epochs),
                    ("log_every", opts.log_every)):
        if v < 1:
            raise UserError(f"{name} must be at least 1, got {v}")
    for name, v in (("aux_noise_std", opts.aux_noise_std), ("muon_weight_decay", opts.muon_weight_decay),
                    ("muon_momentum", opts.muon_momentum)):
        if not v >= 0:
            raise UserError(f"{name} must be at least 0, got {v}")


def _check_loss_and_attention(opts: TrainOptions) -> None:
    try:
        LossSpec.from_mapping(opts.loss, opts.position_weights, opts.dpace_alpha)
    except ValueError as e:
        raise UserError(f"--loss / --position-weights: {e}") from None
    if opts.attention == "flex":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            raise UserError("attention 'flex' needs torch.nn.attention.flex_attention; use --attention sdpa") from None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _train(info: D.DistInfo, opts: TrainOptions) -> dict[str, Any]:
    from tiny_speculators.train.setup import build_run  # setup.py imports train/options.py, which imports this

    out = opts.out
    resume_from = C.latest_checkpoint(out) if opts.resume else None
    if opts.resume and resume_from is None:
        log.warning("--resume: no checkpoint in %s yet; starting from scratch", out)
    if not opts.resume and C.list_checkpoints(out):
        raise UserError(f"{out} already holds checkpoints; pass --resume to continue or choose a new --out")
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    D.barrier(info)
    _seed_everything(opts.seed)
    # vLLM producers / a Mooncake master this run starts are always stopped: on errors, Ctrl-C, and SIGTERM (what
    # torchrun sends the other ranks when one fails), which otherwise ends the process without unwinding
    guard = sigterm_as_exit() if opts.producer == "vllm" else contextlib.nullcontext()
    with guard, contextlib.ExitStack() as engines:
        return _train_with(info, opts, resume_from, build_run(info, opts, get_family(opts.algorithm), engines))


def _train_with(info: D.DistInfo, opts: TrainOptions, resume_from: Path | None, run) -> dict[str, Any]:
    out = opts.out
    # answers to one prompt (and turns of one conversation) stay on one side: a validation sample's prompt unseen
    train_idx, val_idx = split_train_val(len(run.source), opts.eval_fraction, opts.seed,
                                         groups=run.source.prompt_keys() if opts.eval_fraction else None)
    replayed = None
    if opts.replay is not None:
        train_idx, replayed = replay_sample(train_idx, run.source.reused_samples(), opts.replay, opts.seed)
        log.info("replay %.2f: %d new samples + %d of the %d taken over from the earlier extraction", opts.replay,
                 replayed["new"], replayed["replayed"], replayed["reused"])
    state = TrainState()
    if resume_from is not None:
        state = run.load_checkpoint(resume_from)
        log.info("resumed from %s (step %d, epoch %d)", resume_from, state.step, state.epoch)
    micro_per_step = info.world_size * opts.grad_accum
    steps_per_epoch = len(plan_epoch(train_idx, run.source.lengths(), epoch=0, seed=opts.seed,
                                     batch_size=opts.batch_size, batch_tokens=opts.batch_tokens,
                                     micro_per_step=micro_per_step, pack=opts.pack))
    max_steps = opts.max_steps if opts.max_steps is not None else opts.epochs * steps_per_epoch
    logger = MetricsLogger(out, enabled=info.is_main, resume_step=state.step if resume_from else None)
    log.info("training %s %s: %d train / %d val samples, %d steps/epoch, %d steps, world size %d", opts.algorithm,
             opts.mode, len(train_idx), len(val_idx), steps_per_epoch, max_steps,
             info.world_size)
    t0 = time.perf_counter()
    try:
        result = train_loop(cfg=opts, max_steps=max_steps, info=info, model=run.model, objective=run.objective,
                            optimizer=run.optimizer, source=run.source, train_idx=train_idx, val_idx=val_idx,
                            state=state, save_checkpoint=run.save_checkpoint, save_best=run.save_best, logger=logger)
    finally:
        logger.close()
    run.save_final(state)
    summary = {
        "verifier": opts.verifier, "algorithm": opts.algorithm, "mode": opts.mode,
        "steps": state.step, "epochs_started": state.epoch + 1, "tokens_seen": state.tokens_seen,
        "world_size": info.world_size, "train_seconds": round(time.perf_counter() - t0, 2),
        "best_val_accept_len": state.best_accept, "final_train": result["train"], "final_val": result["val"],
        "family_options": run.draft_meta["trained_with"], "recipe": opts.recipe(),
        "draft_parameters": run.trainable_parameters,
        "out": str(out), "init_from": None if opts.init_from is None else str(opts.init_from),
        **({"replay": replayed} if replayed is not None else {}),
    }
    if info.is_main:
        plot_metrics(out)
        write_json_atomic(out / "summary.json", summary, sort_keys=True)
        _print_summary(summary)
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    ft, fv = summary["final_train"] or {}, summary["final_val"] or {}
    rows = [("mode", summary["mode"]), ("steps", summary["steps"]), ("tokens seen", summary["tokens_seen"]),
            ("train loss", f"{ft.get('loss', float('nan')):.4f}"),
            ("train acc per step", json.dumps([round(a, 3) for a in ft.get("acc", [])])),
            ("val acc per step", json.dumps([round(a, 3) for a in fv.get("acc", [])]) if fv else "-"),
            ("val accept length", f"{fv['accept_len']:.3f}" if fv else "-"),
            ("seconds", summary["train_seconds"]), ("out", summary["out"])]
    print_summary_table("train", [(k, str(v)) for k, v in rows], header=("metric", "value"))
