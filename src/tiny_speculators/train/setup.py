"""Build everything a run needs from its options: the sample source (offline or online), the target head,
the draft of the chosen family (fresh, or ``init_from``), the family's objective (with the run's loss) wrapped in
DDP/FSDP2, AdamW or Muon + AdamW;
and the checkpoint glue (save / resume / best / final) on top of a :mod:`state_io` strategy.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tiny_speculators.atomic import write_json_atomic
from tiny_speculators.data.vocab import load_vocab
from tiny_speculators.errors import UserError
from tiny_speculators.models.checkpoint import save_draft
from tiny_speculators.models.family import BuildInputs, DraftFamily, DraftModel
from tiny_speculators.models.importing import import_draft
from tiny_speculators.options import options_record
from tiny_speculators.storage.reader import verify_extraction
from tiny_speculators.train import checkpoint as C
from tiny_speculators.train import distributed as D
from tiny_speculators.train.loop import TrainState
from tiny_speculators.train.options import TrainOptions
from tiny_speculators.train.producer_source import ProducerPool, ProducerSource, producer_endpoints
from tiny_speculators.train.schedule import OptimizerGroup, build_optimizer
from tiny_speculators.train.sources import OfflineSource, OnlineSource
from tiny_speculators.train.state_io import StateIO, state_io
from tiny_speculators.verifier.capture import check_layer_ids, first_aux_layer, past_deepstack
from tiny_speculators.verifier.describe import text_config, verifier_record
from tiny_speculators.verifier.head import head_from_model, load_verifier_head
from tiny_speculators.verifier.load import load_verifier
from tiny_speculators.verifier.modules import find_parts

log = logging.getLogger(__name__)


@dataclass
class Run:
    info: D.DistInfo
    opts: TrainOptions
    family: DraftFamily
    draft: nn.Module  # the family's draft (its parameters are DTensors under FSDP)
    objective: nn.Module  # the family's objective around the draft (unwrapped)
    model: nn.Module  # what the loop calls: the objective, wrapped in DDP or FSDP2
    optimizer: torch.optim.Optimizer | OptimizerGroup
    target_head: nn.Module
    source: Any
    draft_meta: dict[str, Any]
    io: StateIO

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.draft.parameters() if p.requires_grad)

    def _write_draft_dir(self, target: Path, model_sd, extra_files) -> None:
        def fill(tmp: Path) -> None:
            save_draft(tmp, self.io.cpu_draft(model_sd), self.draft_meta)
            extra_files(tmp)

        C.write_atomic_dir(target, fill)

    def _meta(self, state: TrainState, **extra) -> dict[str, Any]:
        return {**state.as_dict(), "world_size": self.info.world_size, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                time.gmtime()), "args": self.opts.record(), **extra}

    def save_checkpoint(self, state: TrainState) -> Path:
        model_sd, optim_sd = self.io.full_state(with_optimizer=True)
        rngs = D.gather_objects(C.capture_rng(), self.info)
        target = C.step_dir(self.opts.out, state.step)
        if self.info.is_main:
            meta = self._meta(state)
            self._write_draft_dir(target, model_sd, lambda tmp: C.save_training_files(
                tmp, optimizer_state=optim_sd, schedule_state={"step": state.step}, rng_states=rngs, meta=meta))
            C.prune_checkpoints(self.opts.out, self.opts.keep_last)
            log.info("checkpoint %s", target)
        D.barrier(self.info)
        return target

    def save_best(self, state: TrainState, val: dict[str, Any]) -> None:
        model_sd, _ = self.io.full_state(with_optimizer=False)
        if self.info.is_main:
            meta = self._meta(state, val=val)
            self._write_draft_dir(self.opts.out / "best", model_sd,
                                  lambda tmp: write_json_atomic(tmp / C.META_FILE, meta, sort_keys=True))
            log.info("new best (val expected acceptance length %.3f) at step %d", val["accept_len"], state.step)
        D.barrier(self.info)

    def save_final(self, state: TrainState) -> None:
        model_sd, _ = self.io.full_state(with_optimizer=False)
        if self.info.is_main:
            meta = self._meta(state)
            self._write_draft_dir(self.opts.out / "final", model_sd,
                                  lambda tmp: write_json_atomic(tmp / C.META_FILE, meta, sort_keys=True))
        D.barrier(self.info)

    def load_checkpoint(self, folder: Path) -> TrainState:
        """Restore weights, optimizer, RNG and the data position from ``folder`` (all ranks)."""
        optim_sd, _schedule, rngs, meta = C.load_training_files(folder)
        recorded = meta["args"]
        current = self.opts.record()
        if recorded.get("optimizer", "adamw") != self.opts.optimizer:
            raise UserError(f"{folder} was trained with --optimizer {recorded.get('optimizer', 'adamw')}; resume with "
                            f"it (this run says {self.opts.optimizer})")
        if (recorded.get("freeze") or None) != (self.opts.freeze or None):  # the optimizer holds the trained ones only
            raise UserError(f"{folder} was trained with --freeze {' '.join(recorded.get('freeze') or []) or '(none)'}; "
                            f"resume with the same (this run says {' '.join(self.opts.freeze or []) or '(none)'})")
        for key in (*TrainOptions.ORDER_KEYS, "algorithm", self.opts.algorithm):
            if recorded.get(key) != current.get(key):
                log.warning("resuming with %s=%s but the checkpoint used %s: the run will differ",
                            key, current.get(key), recorded.get(key))
        if meta.get("world_size") != self.info.world_size:
            log.warning("resuming on %d processes, the checkpoint was written by %s: the data order will differ",
                        self.info.world_size, meta.get("world_size"))
        self.io.load(load_file(str(folder / "model.safetensors")), optim_sd, str(folder))
        if self.info.rank < len(rngs):
            C.restore_rng(rngs[self.info.rank])
        return TrainState(step=int(meta["step"]), epoch=int(meta["epoch"]), step_in_epoch=int(meta["step_in_epoch"]),
                          tokens_seen=int(meta["tokens_seen"]), best_accept=meta.get("best_accept"),
                          elapsed=float(meta.get("elapsed", 0.0)))


def _online_aux(opts: TrainOptions, family: DraftFamily, n_layers: int, first: int = 2) -> list[int]:
    """The aux layer ids of an online run: the family's fixed ones, or --aux-layer-ids, or the family's default
    (its lowest layer moved up to ``first`` for a verifier with DeepStack layers, as extract does)."""
    if family.fixed_aux_layer_ids:
        aux = family.default_aux_layer_ids(n_layers)
        if opts.aux_layer_ids and list(opts.aux_layer_ids) != aux:
            raise UserError(f"--aux-layer-ids: a {family.name} draft always reads verifier layer(s) {aux}")
        return check_layer_ids(aux, n_layers, allow_last=True)
    return check_layer_ids(opts.aux_layer_ids or past_deepstack(family.default_aux_layer_ids(n_layers), first),
                           n_layers)


def _producer_source(opts: TrainOptions, family: DraftFamily, info: D.DistInfo, engines: contextlib.ExitStack):
    """Online from vLLM producers through Mooncake: the verifier's head is loaded here, its layers run there."""
    head = load_verifier_head(opts.verifier, trust_remote_code=opts.trust_remote_code)
    vcfg = text_config(head.config)
    n_layers = int(vcfg.num_hidden_layers)
    aux = _online_aux(opts, family, n_layers)
    layers = aux if n_layers in aux else [*aux, n_layers]  # N: the last layer's output, the target head's input
    vllm_dtype = "bfloat16" if opts.precision == "bf16" and info.device.type == "cuda" else "float32"
    urls, master = engines.enter_context(producer_endpoints(
        info, verifier=opts.verifier, layer_ids=layers, urls=opts.producer_urls, master=opts.mooncake_master,
        count=opts.producers, out=opts.out, vllm_venv=opts.vllm_venv, dtype=vllm_dtype,
        max_model_len=max(2048, opts.max_length or 0)))
    pool = ProducerPool(urls, master, n_layers=len(layers), hidden_size=int(vcfg.hidden_size),
                        timeout=opts.producer_timeout, rank=info.rank)
    engines.callback(pool.close)
    source = ProducerSource(opts.data, pool, layers, aux, n_layers, opts.max_length,
                            sample_log=opts.out / "logs" / f"samples_rank{info.rank}.jsonl")
    return source, head, aux


def _source_and_head(opts: TrainOptions, family: DraftFamily, info: D.DistInfo, engines: contextlib.ExitStack):
    """The sample source, the verifier head (norm + lm_head + embeddings) and the aux layer ids of this run."""
    if opts.online and opts.producer == "vllm":
        return _producer_source(opts, family, info, engines)
    if opts.online:
        vdtype = "bfloat16" if opts.precision == "bf16" and info.device.type == "cuda" else "float32"
        verifier, _ = load_verifier(opts.verifier, dtype=vdtype, device=info.device,
                                    trust_remote_code=opts.trust_remote_code, with_tokenizer=False)
        aux = _online_aux(opts, family, find_parts(verifier).num_hidden_layers, first_aux_layer(verifier.config))
        source = OnlineSource(opts.data, verifier, aux, opts.max_length, opts.verifier, opts.trust_remote_code)
        return source, head_from_model(verifier), aux

    head = load_verifier_head(opts.verifier, trust_remote_code=opts.trust_remote_code)
    if family.fixed_aux_layer_ids:  # e.g. [N]: the last state, which the full layouts store beside the aux layers
        n_layers = int(text_config(head.config).num_hidden_layers)
        fixed = family.default_aux_layer_ids(n_layers)
        if opts.aux_layer_ids and list(opts.aux_layer_ids) != fixed:
            raise UserError(f"--aux-layer-ids: a {family.name} draft always reads verifier layer(s) {fixed}")
        source = _offline_source(opts, info)
        lacking = [i for i in fixed if i not in source.aux_layer_ids and i != n_layers]
        if lacking:
            raise UserError(f"a {family.name} draft reads verifier layer(s) {lacking}, which the extraction "
                            f"{opts.hidden_states} lacks (it has {source.aux_layer_ids})")
        aux = fixed
    else:
        source = _offline_source(opts, info, aux_layer_ids=opts.aux_layer_ids or None)
        aux = source.aux_layer_ids
    _check_manifest(source.manifest, head.config, opts)
    return source, head, aux


def _offline_source(opts: TrainOptions, info: D.DistInfo, aux_layer_ids: list[int] | None = None):
    """The stored samples. One process checks each shard's checksum when it first reads it; the ranks of a
    distributed run (possibly on several nodes reading shared storage) split one checksum pass up front, each
    hashing ``shards[rank::world_size]``, so each byte is hashed once per run rather than once per rank."""
    if not info.enabled:
        return OfflineSource(opts.hidden_states, aux_layer_ids=aux_layer_ids)
    report = verify_extraction(opts.hidden_states, share=(info.rank, info.world_size))
    problems = [p for rank_problems in D.gather_objects(report["problems"], info) for p in rank_problems]
    if problems:
        more = f" (and {len(problems) - 1} more bad shard(s); see `tiny-speculators extract --verify`)" \
            if len(problems) > 1 else ""
        raise UserError(problems[0] + more)
    return OfflineSource(opts.hidden_states, verify=False, aux_layer_ids=aux_layer_ids)


def _initial_draft(opts: TrainOptions, family: DraftFamily, head, aux: list[int], d2t, t2d) -> DraftModel:
    if opts.init_from is None:
        lm_head_w = head.target_head.lm_head.weight.detach().float() if opts.init_lm_head else None
        inputs = BuildInputs(verifier_config=text_config(head.config), d2t=d2t, t2d=t2d, aux_layer_ids=list(aux),
                             embed_weight=head.embed_weight.float(), lm_head_weight=lm_head_w,
                             verifier_path=opts.verifier)
        return family.build(inputs, opts.family)
    # our checkpoint, or a published draft (speculators / SGLang format)
    draft, dcfg = import_draft(opts.init_from, verifier=opts.verifier)
    if dcfg["model_type"] in family.warm_starts:  # another family's draft this one starts from
        log.info("warm start: %s draft %s -> %s", dcfg["model_type"], opts.init_from, family.name)
        draft = family.warm_starts[dcfg["model_type"]](draft, opts.family)
    elif dcfg["model_type"] != family.name:
        raise UserError(f"--init-from {opts.init_from} is a {dcfg['model_type']} draft, this run trains "
                        f"{family.name} (--algorithm)")
    if dcfg.get("aux_layer_ids") not in (None, aux):
        raise UserError(f"--init-from {opts.init_from} was trained on aux layers {dcfg['aux_layer_ids']}, "
                        f"this run uses {aux}")
    if hasattr(draft, "d2t") and d2t is not None and not torch.equal(draft.d2t.cpu(), d2t.long()):
        raise UserError(f"--init-from {opts.init_from} has a different draft vocabulary than "
                        f"{opts.vocab or 'the verifier'}")
    _check_options(draft, family, opts.family, opts.init_from)
    return draft


def _check_options(draft: DraftModel, family: DraftFamily, options: Any, source: Path) -> None:
    """A shape option the run sets (away from its default) must be what the --init-from draft has: that draft keeps
    its own architecture, and silently training another shape than the one asked for is worse than an error. An
    option that only initializes a fresh draft has nothing to act on."""
    defaults, params = family.options(), inspect.signature(family.model).parameters
    for name in family.fresh_options:
        if getattr(options, name) != getattr(defaults, name):
            raise UserError(f"--init-from {source} gives the draft's weights, so {family.name}.{name} "
                            f"{getattr(options, name)} would have no effect (leave one of the two out)")
    for name in family.shape_options:
        wanted = getattr(options, name)
        has = draft.kwargs.get(name, params[name].default)
        if wanted != getattr(defaults, name) and has != wanted:
            raise UserError(f"--init-from {source} has {name} {has}, this run sets {family.name}.{name} {wanted}: "
                            "a draft started from keeps its own shape (leave the option out, or start from a draft "
                            "of that shape)")


def freeze_parameters(draft: nn.Module, names: list[str]) -> None:
    """No gradient for the parameters named ``names`` or under them (``lm_head``, ``layers.0.mlp``); the optimizer
    then leaves them out, and a checkpoint still holds them."""
    params = dict(draft.named_parameters())
    for name in names:
        hits = [p for n, p in params.items() if n == name or n.startswith(name + ".")]
        if not hits:
            tops = sorted({n.rsplit(".", 1)[0] for n, p in params.items() if p.requires_grad})
            raise UserError(f"--freeze {name}: the draft has no parameter of that name (trainable: {', '.join(tops)})")
        for p in hits:
            p.requires_grad_(False)


def build_run(info: D.DistInfo, opts: TrainOptions, family: DraftFamily, engines: contextlib.ExitStack) -> Run:
    """``engines`` owns what the run starts (vLLM producers, a Mooncake master): closing it stops them."""
    source, head, aux = _source_and_head(opts, family, info, engines)
    if opts.vocab is None and opts.init_from is not None and not family.uses_verifier_vocab:
        d2t = t2d = None  # the draft continued keeps its own vocabulary
    elif opts.vocab is None:  # the family drafts over the verifier's whole vocabulary (uses_verifier_vocab)
        size = int(text_config(head.config).vocab_size)
        d2t, t2d = torch.zeros(size, dtype=torch.long), torch.ones(size, dtype=torch.bool)
    else:
        d2t, t2d = load_vocab(opts.vocab)
        d2t, t2d = torch.as_tensor(d2t), torch.as_tensor(t2d)
    draft = _initial_draft(opts, family, head, aux, d2t, t2d)
    freeze_parameters(draft, opts.freeze or [])
    head.target_head.to(info.device)
    draft.to(info.device)
    objective = family.objective(draft, head.target_head, opts.family, opts.attention, loss=opts.loss_spec())
    model = D.wrap_model(objective, info, opts.fsdp)
    optimizer = build_optimizer(model, lr=opts.lr, weight_decay=opts.weight_decay, kind=opts.optimizer,
                                muon_momentum=opts.muon_momentum, muon_weight_decay=opts.muon_weight_decay)
    meta = {"verifier": verifier_record(opts.verifier, head.config),
            "speculative_tokens": family.speculative_tokens(opts.family),
            "trained_with": {"algorithm": family.name, **options_record(opts.family),
                             "mode": opts.mode}}
    return Run(info=info, opts=opts, family=family, draft=draft, objective=objective, model=model,
               optimizer=optimizer, target_head=head.target_head, source=source, draft_meta=meta,
               io=state_io(model, draft, optimizer, opts.fsdp))


def _check_manifest(manifest: dict[str, Any], config, opts: TrainOptions) -> None:
    vcfg = text_config(config)
    hs = manifest.get("hidden_size")
    if hs is not None and int(hs) != int(vcfg.hidden_size):
        raise UserError(f"{opts.hidden_states}/manifest.json has hidden_size {hs}, but verifier "
                        f"{opts.verifier!r} has {vcfg.hidden_size}: the shards come from another verifier")
    vs = manifest.get("vocab_size")
    if vs is not None and int(vs) != int(vcfg.vocab_size):
        raise UserError(f"{opts.hidden_states}/manifest.json has vocab_size {vs}, but verifier "
                        f"{opts.verifier!r} has {vcfg.vocab_size}")
