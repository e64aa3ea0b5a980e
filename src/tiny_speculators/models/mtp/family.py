"""MTP (fine-tune a verifier's own multi-token-prediction layer, FastMTP-style) as a draft family.

    train: {algorithm: mtp, mtp: {steps: 3, beta: 0.6}}                  # YAML
    tiny-speculators train --verifier path/to/MiMo --data runs/prepared --online \
        --algorithm mtp --mtp-steps 3 --out runs/mtp                    # then: export, vllm serve (method mtp)
    tiny-speculators train ... --algorithm mtp --init-from runs/mtp     # fine-tune further (or from its export)

The layer is read from the verifier's own safetensors (``weights.py``; MiMo or DeepSeek-V3 layout, chosen by the
verifier's config); ``--mtp-init random`` starts a fresh one for a verifier without MTP weights. The draft reads
the verifier's last hidden state (aux layer id N) and predicts over its whole vocabulary (``uses_verifier_vocab``:
train needs no ``--vocab``; the lm_head is the verifier's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.family import BuildInputs, DraftFamily
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.mtp import stitched
from tiny_speculators.models.mtp.model import MTPDraft
from tiny_speculators.models.mtp.objective import MTPObjective
from tiny_speculators.models.mtp.proposer import MTPProposer
from tiny_speculators.models.mtp.weights import mtp_layout, read_prefixed, read_shared, verifier_folder
from tiny_speculators.options import AT_LEAST_1, FRACTION, NON_NEGATIVE, check_ranges

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MTPOptions:
    """MTP's own training options.

    Args:
        steps: recursive MTP steps trained per position (K); also the default number of speculative tokens.
        beta: weight of step k's mean loss is beta**(k-1), the weights normalized to sum to 1.
        init: verifier = start from the verifier's own MTP layer (error if it has none); random = a fresh layer.
        layer: which of the verifier's MTP layers to fine-tune (``model.mtp_layers.{k}`` / ``model.layers.{N+k}``).
    """

    steps: int = 3
    beta: float = 0.6
    init: Literal["verifier", "random"] = "verifier"
    layer: int = 0

    def __post_init__(self) -> None:
        check_ranges(("steps", self.steps, AT_LEAST_1), ("beta", self.beta, FRACTION),
                     ("layer", self.layer, NON_NEGATIVE))


def _layer_weights(path: str, draft: MTPDraft, options: MTPOptions) -> dict[str, torch.Tensor]:
    folder = verifier_folder(path)
    n = int(draft.kwargs["num_hidden_layers"])
    found = mtp_layout(folder, n)
    if found is None:
        raise UserError(f"verifier {path} has no MTP weights (no model.mtp_layers.* or model.layers.{n}.eh_proj "
                        "in its safetensors): pass --mtp-init random to train a fresh MTP layer")
    layout, count = found
    if layout != draft.layout:
        hint = " (no kv_lora_rank: only DeepSeek-V3's MLA layer is implemented for it, not e.g. GLM-4.5's)" \
            if layout == "deepseek_v3" else ""
        raise UserError(f"verifier {path} has {layout}-layout MTP layers, but its config.json describes a "
                        f"{draft.layout} model{hint}")
    if options.layer >= count:
        raise UserError(f"--mtp-layer {options.layer}: verifier {path} has {count} MTP layer(s)")
    prefix = stitched.layer_prefix(draft.kwargs)
    return stitched.layer_from_tensors(draft.kwargs, read_prefixed(folder, prefix), f"{folder} ({prefix}*)")


def build(inputs: BuildInputs, options: MTPOptions) -> MTPDraft:
    cfg = inputs.verifier_config
    draft = MTPDraft(**stitched.draft_kwargs(cfg, "the verifier's config", options.layer))
    embed, lm_head = inputs.embed_weight, inputs.lm_head_weight
    layer: dict[str, torch.Tensor] = {}
    if (embed is None or lm_head is None) and inputs.verifier_path is not None:  # train passes no lm_head by default
        embed, lm_head = read_shared(verifier_folder(inputs.verifier_path),
                                     bool(getattr(cfg, "tie_word_embeddings", False)))
    if options.init == "verifier":
        if inputs.verifier_path is None:
            raise UserError("MTP init 'verifier' reads the verifier's own MTP layer, but its folder was not given "
                            "(BuildInputs.verifier_path); pass --mtp-init random for a fresh layer")
        layer = _layer_weights(inputs.verifier_path, draft, options)
    if embed is None or lm_head is None:
        raise UserError("an MTP layer shares the verifier's embedding and lm_head, and neither was given")
    state = draft.state_dict()
    values = {"embed_tokens.weight": embed, "lm_head.weight": lm_head, **layer}  # DeepSeek: the layer's own head
    for name, value in values.items():
        if tuple(value.shape) != tuple(state[name].shape):
            raise UserError(f"verifier tensor {name} has shape {tuple(value.shape)}, the MTP layer needs "
                            f"{tuple(state[name].shape)}")
    with torch.no_grad():
        for name, value in values.items():
            state[name].copy_(value.to(state[name].dtype))
    if int(inputs.t2d.sum()) != int(inputs.t2d.numel()):
        log.info("MTP drafts over the verifier's whole vocabulary: the given draft vocabulary is not used")
    return draft


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The last decoder layer's output before the final norm (aux layer id N)."""
    return [num_layers]


def objective(draft: nn.Module, target_head: nn.Module, options: MTPOptions, attention: str,
              loss: LossSpec | None = None) -> MTPObjective:
    return MTPObjective(draft, target_head, options.steps, options.beta, attention, loss=loss)


FAMILY = DraftFamily(
    name="mtp",
    summary="MTP: the verifier's own multi-token-prediction layer, fine-tuned recursively (FastMTP) on its last state",
    model=MTPDraft,
    options=MTPOptions,
    build=build,
    default_aux_layer_ids=default_aux_layer_ids,
    objective=objective,
    proposer=MTPProposer,
    formats=(stitched.FORMAT,),
    speculative_tokens=lambda options: options.steps,
    fixed_aux_layer_ids=True,
    reads_verifier_files=True,
    uses_verifier_vocab=True,
)
