"""DFlash (block diffusion, arXiv 2602.06036) as a draft family: its options, builder and table entry.

    train: {algorithm: dflash, dflash: {block_size: 8, num_layers: 2}}       # YAML
    tiny-speculators train ... --algorithm dflash --dflash-block-size 8 --dflash-loss-weighting exp
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.compat import copy_verifier_weights
from tiny_speculators.models.dflash import speculators
from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.models.dflash.objective import DFlashObjective, default_gamma
from tiny_speculators.models.dflash.proposer import DFlashProposer
from tiny_speculators.models.family import BuildInputs, DraftFamily, mask_token_of
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.shape import DraftShape


def check_block_options(options: Any) -> None:
    """The checks every block drafter's options make: ``block_size``, ``num_layers``, ``anchors`` and ``gamma``."""
    if options.block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {options.block_size}")
    if options.num_layers < 1 or options.anchors < 1:
        raise ValueError(f"num_layers and anchors must be at least 1, got {options.num_layers}, {options.anchors}")
    if options.gamma is not None and options.gamma <= 0:
        raise ValueError(f"gamma must be positive, got {options.gamma}")


@dataclass(frozen=True)
class DFlashOptions:
    """DFlash's own training options.

    Args:
        block_size: slots per block (the anchor + block_size-1 mask slots); the export serves block_size-1
            speculative tokens.
        num_layers: draft decoder layers (each gets the injected verifier context).
        anchors: random anchors (blocks) per document and training sample.
        gamma: with loss_weighting exp only (refused with dpace), slot k's loss weight is exp(-(k-1)/gamma);
            default: the paper's 4/5/7 for blocks 8/10/16.
        loss_weighting: dpace (D-PACE: weights from the draft's own confidence; speculators 0.9's DFlash default,
            +0.02 held-out tau over exp at two seeds on the embedded data, dev/LOG.md session 28) or exp (the
            paper's decay).
        dpace_alpha: D-PACE's confidence smoothing.
        mask_token_id: token fed at the mask slots (its embedding is the verifier's); default: the verifier's pad
            token, else its eos token, else 0.
        causal: causal attention inside the block instead of DFlash's bidirectional one.
    """

    block_size: int = 8
    num_layers: int = 2
    anchors: int = 64
    gamma: float | None = None
    loss_weighting: Literal["exp", "dpace"] = "dpace"
    dpace_alpha: float = 0.5
    mask_token_id: int | None = None
    causal: bool = False

    def __post_init__(self) -> None:
        check_block_options(self)
        if self.gamma is not None and self.loss_weighting != "exp":
            raise ValueError(f"gamma acts only with loss_weighting exp (here {self.loss_weighting}, whose weights come "
                             "from the draft's confidence): drop it, or set loss_weighting exp")
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Five verifier layers spread over the depth, as DFlash's reference drafts use (Qwen3-8B, 36 layers:
    [2, 10, 18, 26, 34]): the outputs of layers round(1 + i (N-4) / 4), i = 0..4, as aux ids (input of layer + 1)."""
    if num_layers < 6:
        raise UserError(f"a verifier with {num_layers} layers is too shallow for DFlash's 5 default aux layers; "
                        "give --aux-layer-ids explicitly")
    return [round(1 + i * (num_layers - 4) / 4) + 1 for i in range(5)]


def build(inputs: BuildInputs, options: DFlashOptions) -> DFlashDraft:
    cfg = inputs.verifier_config
    shape = DraftShape.from_verifier(cfg, int(inputs.d2t.shape[0]), num_aux=len(inputs.aux_layer_ids),
                                     aux_layer_ids=list(inputs.aux_layer_ids))
    draft = DFlashDraft(**shape.fields(), num_layers=options.num_layers, block_size=options.block_size,
                        mask_token_id=mask_token_of(options.mask_token_id, cfg), causal=options.causal)
    if inputs.embed_weight is None or inputs.lm_head_weight is None:
        raise UserError("DFlash uses the verifier's embeddings and lm_head (frozen): train with --init-lm-head")
    copy_verifier_weights(draft, inputs.d2t, inputs.t2d, inputs.embed_weight, inputs.lm_head_weight)
    return draft


def objective(draft: nn.Module, target_head: nn.Module, options: DFlashOptions, attention: str,
              loss: LossSpec | None = None) -> DFlashObjective:
    if attention != "sdpa":
        raise UserError("DFlash trains with --attention sdpa (its block attention is explicit)")
    gamma = options.gamma if options.gamma is not None else default_gamma(draft.block_size)
    return DFlashObjective(draft, target_head, anchors=options.anchors, weighting=options.loss_weighting,
                           gamma=gamma, dpace_alpha=options.dpace_alpha, loss=loss)


FAMILY = DraftFamily(
    name="dflash",
    summary="DFlash: block diffusion drafter, verifier context injected as keys/values, a block of tokens per forward",
    model=DFlashDraft,
    options=DFlashOptions,
    build=build,
    default_aux_layer_ids=default_aux_layer_ids,
    objective=objective,
    proposer=DFlashProposer,
    formats=(speculators.FORMAT,),
    speculative_tokens=lambda options: options.block_size - 1,
)
