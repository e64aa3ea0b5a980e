"""Train speculators' EAGLE-3, P-EAGLE, DFlash or DSpark draft with its own trainer (``speculators train``), on CPU.

Runs INSIDE the peer virtual environment that ``benchmarks/peer_speculators.py`` builds (speculators 0.9.0,
torch 2.13.0 CPU); it imports nothing from tiny_speculators. It reads one JSON file of options, builds
speculators' ``TrainConfig`` from them (every field not named there keeps speculators' own default), calls
``speculators.train.cli.main`` (the function behind ``speculators train``) and then saves the trained draft in
fp32 with speculators' ``save_pretrained`` into ``<out>/draft``.

CPU patches (all outside speculators' maths):
- ``Trainer`` puts the model and each batch on ``get_local_rank()`` (0 = ``cuda:0``): the trainer module's
  ``get_local_rank`` answers ``"cpu"`` instead.
- ``draft_attn_impl`` ``sdpa`` (one of speculators' own choices; the same masks, dense) instead of its default
  ``simple_flex_attention``, which has no backward on CPU in torch 2.13.
- ``loss_implementation`` ``eager`` (speculators' reference losses, the same formulas) instead of ``fused``,
  which are Triton (GPU) kernels.
- Its step timer calls ``torch.accelerator.synchronize()``, which raises without an accelerator: a no-op here.
- ``epochs`` is chosen so that the run ends inside its last epoch at ``max_steps`` (counted with speculators' own
  packing sampler): 0.9.0's ``run_training`` does not stop the epoch loop at ``max_steps``, so every further epoch
  would run one more optimizer step.
- Its autocast device is the accelerator's, else ``"cuda"``, which is disabled on a machine without one: the
  trainer's ``device_type`` is ``"cpu"`` unless ``hidden_states_dtype`` is the driver's float32 (autocast off: the
  maths runs in fp32, as before); ``--overrides '{"hidden_states_dtype": "bfloat16"}'``
  (speculators' own default) trains under bf16 autocast with fp32 master weights, as ``--precision bf16`` does ours.

    python benchmarks/peer_speculators_driver.py OPTIONS.json   # written by benchmarks/peer_speculators.py
    python benchmarks/peer_speculators_driver.py parity DRAFT HS_FILE TOKENS OUT.safetensors

The parity forward is speculators' EAGLE-3 forward for EAGLE-3 and P-EAGLE: a P-EAGLE draft's depth-0 slots under
causal attention are exactly that (its class subclasses ``Eagle3DraftModel``); its mask hidden state is saved beside.
For DFlash and DSpark it is the training forward on fixed anchors (every ``block_size``-th position): every slot's
logits (DSpark's with its Markov bias, and its confidence logits).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path


def epochs_for(steps: int, lengths: list[int], total_seq_len: int, seed: int) -> tuple[int, list[int]]:
    """The fewest epochs whose packed batches (speculators' sampler, its per-epoch seeds) reach ``steps``."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    per_epoch: list[int] = []
    while sum(per_epoch) < steps:
        sampler.set_epoch(len(per_epoch))
        per_epoch.append(len(sampler))
    return len(per_epoch), per_epoch


def main(options_path: str) -> None:
    from importlib.metadata import version

    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    import torch
    from datasets import load_from_disk
    from speculators.train.config import TrainConfig

    opts = json.loads(Path(options_path).read_text())
    out = Path(opts["out"])
    torch.set_num_threads(int(opts.get("threads", 2)))

    spec_trainer.get_local_rank = lambda: "cpu"  # CPU patches: see the module docstring
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    trainers: list = []
    real_trainer = spec_cli.Trainer

    def keep_trainer(*args, **kwargs):
        trainer = real_trainer(*args, **kwargs)
        if not torch.accelerator.is_available() and trainer.config.hidden_states_dtype != torch.float32:
            trainer.device_type = "cpu"  # CPU patch: its autocast device falls back to "cuda" (disabled)
        trainers.append(trainer)
        return trainer

    spec_cli.Trainer = keep_trainer  # keep a handle on the trained model (main() drops its own)

    data = load_from_disk(opts["data_path"])
    n_train = int(len(data) * opts["train_data_ratio"])
    lengths = list(data.with_format(None)["seq_len"])[:n_train]
    epochs, per_epoch = epochs_for(opts["max_steps"], lengths, opts["total_seq_len"], opts["seed"])

    flat = {
        "speculator_type": opts.get("speculator_type", "eagle3"), "seed": opts["seed"],
        "verifier_name_or_path": opts["verifier"],
        "target_layer_ids": opts["target_layer_ids"], "draft_vocab_size": opts["draft_vocab_size"],
        "d2t_path": opts["d2t_path"], "t2d_path": opts["t2d_path"],
        "data_path": opts["data_path"], "hidden_states_path": opts["hidden_states_path"],
        "total_seq_len": opts["total_seq_len"], "train_data_ratio": opts["train_data_ratio"],
        "hidden_states_dtype": "float32", "num_workers": 0, "on_missing": "raise",
        "epochs": epochs, "max_steps": opts["max_steps"], "save_path": str(out / "checkpoints"),
        "no_resume_from_checkpoint": True, "log_dir": str(out / "logs"),
        "draft_attn_impl": "sdpa",  # CPU patch: flex attention has no backward on CPU
        "loss_implementation": "eager",  # CPU patch: the fused losses are Triton kernels
        "checkpoint_freq": float(epochs),  # checkpoints after the first and the last epoch only (disk)
        **opts.get("overrides", {}),  # optional recipe changes by field name, e.g. {"optimizer": "adamw"}
    }
    cfg = TrainConfig.from_flat(flat)
    resolved = cfg.flatten()
    lost = {k: (v, resolved.get(k)) for k, v in flat.items() if resolved.get(k) != v}
    if lost:  # TrainConfig ignores unknown names: every option above must have landed
        raise SystemExit(f"speculators' TrainConfig did not take these options (given, got): {lost}")
    t0 = time.perf_counter()
    spec_cli.main(cfg)
    seconds = time.perf_counter() - t0

    trainer = trainers[-1]
    model = trainer.model
    model.to(torch.float32).save_pretrained(out / "draft")  # speculators' own writer, fp32 weights
    summary = {
        "speculators_version": version("speculators"),
        "torch_version": torch.__version__,
        "train_seconds": seconds,
        "global_step": trainer.global_step,
        "epochs": epochs,
        "steps_per_epoch": per_epoch,
        "train_samples": n_train,
        "train_tokens_per_epoch": int(sum(lengths)),
        "embed_requires_grad": bool(model.embed_tokens.weight.requires_grad),
        "resolved_config": {k: v for k, v in resolved.items() if isinstance(v, (int, float, str, bool, list))
                            or v is None},
    }
    (out / "driver_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: summary[k] for k in ("speculators_version", "train_seconds", "global_step", "epochs")}))


def parity(draft: str, hs_file: str, tokens: int, out: str) -> None:
    """First-step logits of the saved draft under speculators' own forward, on one stored sample (the input of
    the harness's check that our importer runs the same function)."""
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.peagle.core import PEagleDraftModel

    kind = json.loads((Path(draft) / "config.json").read_text())["speculators_model_type"]
    model = {"eagle3": Eagle3DraftModel, "peagle": PEagleDraftModel,
             "dflash": DFlashDraftModel, "dspark": DSparkDraftModel}[kind].from_pretrained(draft).float().eval()
    sample = load_file(hs_file)
    ids = sample["token_ids"][:tokens].long()  # (T,)
    aux = sample["hidden_states"][:tokens, :-1].flatten(1).float()  # (T, n_aux*H)
    if kind in ("dflash", "dspark"):
        save_file(block_logits(model, kind, ids, aux, sample["hidden_states"][:tokens, -1].float()), out)
        return
    caught: list = []
    model.lm_head.register_forward_hook(lambda mod, args, output: caught.append(output.detach()))
    # speculators' shift_batch: token t+1 with the states of token t; positions start at 1
    input_ids, states = ids[1:][None], aux[:-1][None]  # (1, T-1), (1, T-1, n_aux*H)
    position_ids = torch.arange(1, len(ids))[None]  # (1, T-1)
    with torch.no_grad():
        Eagle3DraftModel.forward(model, hidden_states=states, input_ids=input_ids,
                                 document_ids=torch.zeros_like(input_ids), position_ids=position_ids, ttt_steps=1)
    tensors = {"logits": caught[0][0].float().contiguous(), "input_ids": input_ids[0].contiguous(),
               "aux": states[0].contiguous(), "position_ids": position_ids[0].contiguous()}
    if kind == "peagle":
        tensors["mask_hidden"] = model.mask_hidden.detach().float().reshape(-1).contiguous()
        tensors["mask_token_id"] = torch.tensor([model.mask_token_id])
    save_file(tensors, out)


class Caught(Exception):
    """Raised by the patched loss once it has the draft's outputs (the loss itself is not needed)."""


def block_logits(model, kind: str, ids, aux, last) -> dict:
    """A DFlash or DSpark draft's logits for every slot of blocks anchored at every ``block_size``-th position of one
    sample (speculators' anchor sampler replaced by that fixed choice; everything else is its training forward up
    to its loss: DSpark's logits with the Markov bias, and its confidence logits)."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    import torch

    size = model.block_size
    anchors = torch.arange(1, len(ids) - size, size)  # (A,): whole blocks inside the sample
    dflash_core.select_anchors = lambda loss_mask, n, block_size: (anchors, torch.ones(len(anchors), dtype=bool))
    caught: dict = {}

    def catch(logits, targets, confidence_logits, *args, **kwargs):
        caught.update(logits=logits, confidence=confidence_logits)
        raise Caught

    dspark_core.compute_metrics = catch
    args = (aux[None], ids[None], torch.ones_like(ids)[None], last[None], torch.zeros_like(ids)[None])
    with torch.no_grad():
        if kind == "dflash":
            _, caught["logits"], *_ = model._backbone_forward(*args, max_anchors=len(anchors))
        else:
            with contextlib.suppress(Caught):
                model(*args, max_anchors=len(anchors))
    out = {"logits": caught["logits"][0].float().contiguous(), "input_ids": ids.contiguous(),
           "aux": aux.contiguous(), "anchors": anchors.contiguous()}
    if caught.get("confidence") is not None:
        out["confidence"] = caught["confidence"][0].float().contiguous()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "parity":  # parity DRAFT HS_FILE TOKENS OUT
        parity(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main(sys.argv[1])
