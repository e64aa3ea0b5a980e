"""Build everything a run needs from the stage's arguments: the sample source (offline or online), the
target head, the draft (fresh, or ``init_from``), its DDP/FSDP wrapper and AdamW; and the checkpoint glue
(save / resume / best / final) that knows how to gather a sharded model onto rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.train import checkpoint as C
from tiny_speculators.train import distributed as D
from tiny_speculators.train.loop import TrainState
from tiny_speculators.train.rollout import TTTModule
from tiny_speculators.train.schedule import build_optimizer

log = logging.getLogger(__name__)

RUN_KEYS = ("verifier", "online", "batch_size", "batch_tokens", "pack", "grad_accum", "lr", "warmup_steps",
            "min_lr_ratio", "weight_decay", "max_grad_norm", "ttt_steps", "decay", "eval_fraction", "seed",
            "precision", "attention", "fsdp", "max_length")


@dataclass
class Run:
    info: D.DistInfo
    args: dict[str, Any]
    draft: nn.Module  # the Eagle3Draft (its parameters are DTensors under FSDP)
    model: nn.Module  # what the loop calls: TTTModule(draft), wrapped in DDP or FSDP2
    optimizer: torch.optim.Optimizer
    target_head: nn.Module
    source: Any
    draft_meta: dict[str, Any]

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.draft.parameters() if p.requires_grad)

    # -- gathering (collective under FSDP: every rank must call) -------------------------------------
    def _full_state(self, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict | None]:
        if self.args["fsdp"]:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = get_model_state_dict(self.model, options=opts)
            model_sd = {k.removeprefix("draft."): v for k, v in model_sd.items()}
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts) if with_optimizer else None
            return model_sd, optim_sd
        return self.draft.state_dict(), (self.optimizer.state_dict() if with_optimizer else None)

    def _cpu_draft(self, model_sd: dict[str, torch.Tensor]) -> nn.Module:
        if not self.args["fsdp"]:
            return self.draft
        from tiny_speculators.models.eagle3.model import Eagle3Draft

        cpu = Eagle3Draft(**self.draft.kwargs)
        cpu.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in model_sd.items()})
        return cpu

    def _write_draft_dir(self, target: Path, model_sd, extra_files) -> None:
        from tiny_speculators.models.eagle3.io import save_draft

        def fill(tmp: Path) -> None:
            save_draft(tmp, self._cpu_draft(model_sd), self.draft_meta)
            extra_files(tmp)

        C.write_atomic_dir(target, fill)

    def _meta(self, state: TrainState, **extra) -> dict[str, Any]:
        return {**state.as_dict(), "world_size": self.info.world_size, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                time.gmtime()), "args": {k: self.args[k] for k in RUN_KEYS}, **extra}

    def save_checkpoint(self, state: TrainState, keep_last: int) -> Path:
        model_sd, optim_sd = self._full_state(with_optimizer=True)
        rngs = _gather_objects(C.capture_rng(), self.info)
        target = C.step_dir(self.args["out"], state.step)
        if self.info.is_main:
            meta = self._meta(state)
            self._write_draft_dir(target, model_sd, lambda tmp: C.save_training_files(
                tmp, optimizer_state=optim_sd, schedule_state={"step": state.step}, rng_states=rngs, meta=meta))
            C.prune_checkpoints(self.args["out"], keep_last)
            log.info("checkpoint %s", target)
        D.barrier(self.info)
        return target

    def save_best(self, state: TrainState, val: dict[str, Any]) -> None:
        model_sd, _ = self._full_state(with_optimizer=False)
        if self.info.is_main:
            meta = self._meta(state, val=val)
            self._write_draft_dir(Path(self.args["out"]) / "best", model_sd,
                                  lambda tmp: C.write_json_atomic(tmp / C.META_FILE, meta))
            log.info("new best (val expected acceptance length %.3f) at step %d", val["accept_len"], state.step)
        D.barrier(self.info)

    def save_final(self, state: TrainState) -> None:
        model_sd, _ = self._full_state(with_optimizer=False)
        if self.info.is_main:
            meta = self._meta(state)
            self._write_draft_dir(Path(self.args["out"]) / "final", model_sd,
                                  lambda tmp: C.write_json_atomic(tmp / C.META_FILE, meta))
        D.barrier(self.info)

    def load_checkpoint(self, folder: Path) -> TrainState:
        """Restore weights, optimizer, RNG and the data position from ``folder`` (all ranks)."""
        from safetensors.torch import load_file

        optim_sd, _schedule, rngs, meta = C.load_training_files(folder)
        for key in ("batch_size", "batch_tokens", "pack", "grad_accum", "seed", "ttt_steps"):
            if meta["args"].get(key) != self.args[key]:
                log.warning("resuming with %s=%s but the checkpoint used %s: the data order will differ",
                            key, self.args[key], meta["args"].get(key))
        if meta.get("world_size") != self.info.world_size:
            log.warning("resuming on %d processes, the checkpoint was written by %s: the data order will differ",
                        self.info.world_size, meta.get("world_size"))
        model_sd = load_file(str(folder / "model.safetensors"))
        if self.args["fsdp"]:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, {f"draft.{k}": v for k, v in model_sd.items()}, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=optim_sd, options=opts)
        else:
            missing, unexpected = self.draft.load_state_dict(model_sd, strict=False)
            if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
                raise UserError(f"{folder}/model.safetensors does not match the draft being trained "
                                f"(missing {missing}, unexpected {unexpected})")
            self.optimizer.load_state_dict(optim_sd)
        if self.info.rank < len(rngs):
            C.restore_rng(rngs[self.info.rank])
        return TrainState(step=int(meta["step"]), epoch=int(meta["epoch"]), step_in_epoch=int(meta["step_in_epoch"]),
                          tokens_seen=int(meta["tokens_seen"]), best_accept=meta.get("best_accept"),
                          elapsed=float(meta.get("elapsed", 0.0)))


def _gather_objects(obj, info: D.DistInfo) -> list:
    if not info.enabled:
        return [obj]
    import torch.distributed as dist

    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def build_run(info: D.DistInfo, args: dict[str, Any]) -> Run:
    from tiny_speculators.data.vocab import load_vocab
    from tiny_speculators.models.eagle3.builder import build_draft, draft_kwargs_from_verifier
    from tiny_speculators.train.target import head_from_model, load_verifier_head
    from tiny_speculators.verifier.load import verifier_id

    d2t, t2d = load_vocab(args["vocab"])
    d2t, t2d = torch.as_tensor(d2t), torch.as_tensor(t2d)
    if args["online"]:
        from tiny_speculators.train.sources import OnlineSource
        from tiny_speculators.verifier.capture import check_layer_ids, default_aux_layer_ids
        from tiny_speculators.verifier.load import load_verifier
        from tiny_speculators.verifier.modules import find_parts

        vdtype = "bfloat16" if args["precision"] == "bf16" and info.device.type == "cuda" else "float32"
        verifier, _ = load_verifier(args["verifier"], dtype=vdtype, device=info.device,
                                    trust_remote_code=args["trust_remote_code"], with_tokenizer=False)
        n_layers = find_parts(verifier).num_hidden_layers
        aux = check_layer_ids(args["aux_layer_ids"] or default_aux_layer_ids(n_layers), n_layers)
        head = head_from_model(verifier)
        source = OnlineSource(args["data"], verifier, aux, args["max_length"])
    else:
        from tiny_speculators.train.sources import OfflineSource

        source = OfflineSource(args["hidden_states"])
        aux = source.aux_layer_ids
        if args["aux_layer_ids"] and list(args["aux_layer_ids"]) != aux:
            raise UserError(f"--aux-layer-ids {args['aux_layer_ids']} differ from the extraction's {aux} "
                            f"({args['hidden_states']}/manifest.json)")
        head = load_verifier_head(args["verifier"], trust_remote_code=args["trust_remote_code"])
        _check_manifest(source.manifest, head.config, args)
    config = head.config
    if args["init_from"] is not None:  # our checkpoint, or a published draft in speculators / SGLang format
        from tiny_speculators.export.importers import import_draft

        draft, dcfg = import_draft(args["init_from"], verifier=args["verifier"])
        if dcfg.get("aux_layer_ids") not in (None, aux):
            raise UserError(f"--init-from {args['init_from']} was trained on aux layers {dcfg['aux_layer_ids']}, "
                            f"this run uses {aux}")
        if not torch.equal(draft.d2t.cpu(), d2t.long()):
            raise UserError(f"--init-from {args['init_from']} has a different draft vocabulary than {args['vocab']}")
    else:
        layer_type = args["layer_type"]
        if layer_type == "auto":
            layer_type = "qwen3" if str(getattr(config, "model_type", "")).startswith("qwen3") else "llama"
        kwargs = draft_kwargs_from_verifier(config, int(d2t.shape[0]), num_aux=len(aux), layer_type=layer_type,
                                            fc_norm=args["fc_norm"], norm_before_residual=args["norm_before_residual"])
        lm_head_w = head.target_head.lm_head.weight.detach().float() if args["init_lm_head"] else None
        draft = build_draft(kwargs, d2t, t2d, embed_weight=head.embed_weight.float(), lm_head_weight=lm_head_w)
    head.target_head.to(info.device)
    draft.to(info.device)
    module = TTTModule(draft, head.target_head, args["ttt_steps"], args["decay"], args["attention"])
    model = D.wrap_model(module, info, args["fsdp"])
    optimizer = build_optimizer(model, lr=args["lr"], weight_decay=args["weight_decay"])
    vcfg = getattr(config, "text_config", None) or config
    meta = {"aux_layer_ids": aux,
            "verifier": {"name_or_path": verifier_id(args["verifier"]),
                         "architectures": list(getattr(config, "architectures", None) or []),
                         "hidden_size": int(vcfg.hidden_size), "vocab_size": int(vcfg.vocab_size)},
            "trained_with": {"ttt_steps": args["ttt_steps"], "decay": args["decay"], "mode":
                             "online" if args["online"] else "offline"}}
    return Run(info=info, args=args, draft=draft, model=model, optimizer=optimizer, target_head=head.target_head,
               source=source, draft_meta=meta)


def _check_manifest(manifest: dict[str, Any], config, args: dict[str, Any]) -> None:
    vcfg = getattr(config, "text_config", None) or config
    hs = manifest.get("hidden_size")
    if hs is not None and int(hs) != int(vcfg.hidden_size):
        raise UserError(f"{args['hidden_states']}/manifest.json has hidden_size {hs}, but verifier "
                        f"{args['verifier']!r} has {vcfg.hidden_size}: the shards come from another verifier")
    vs = manifest.get("vocab_size")
    if vs is not None and int(vs) != int(vcfg.vocab_size):
        raise UserError(f"{args['hidden_states']}/manifest.json has vocab_size {vs}, but verifier "
                        f"{args['verifier']!r} has {vcfg.vocab_size}")
