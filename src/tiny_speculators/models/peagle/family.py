"""P-EAGLE (parallel drafting, arXiv 2602.01469) as a draft family: its options, builder and table entry.

    train: {algorithm: peagle, peagle: {num_layers: 2, depths: 4}}       # YAML
    tiny-speculators train ... --algorithm peagle --peagle-depths 4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.compat import copy_verifier_weights
from tiny_speculators.models.family import BuildInputs, DraftFamily, mask_token_of, resolve_layer_type
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.models.peagle import speculators
from tiny_speculators.models.peagle.model import PEagleDraft
from tiny_speculators.models.peagle.objective import PEagleObjective
from tiny_speculators.models.peagle.proposer import PEagleProposer
from tiny_speculators.models.shape import DraftShape
from tiny_speculators.models.verifier_init import start_from_verifier
from tiny_speculators.options import AT_LEAST_1, FRACTION, check_ranges
from tiny_speculators.verifier.capture import default_aux_layer_ids


@dataclass(frozen=True)
class PEagleOptions:
    """P-EAGLE's own training options.

    Args:
        depths: positions trained per anchor (depth 0 = the bonus slot, 1.. = mask slots); also the default
            number of speculative tokens the export writes.
        num_layers: decoder layers of the draft (layer 0 is the EAGLE-3 layer).
        ratio: COD sampling: depth d keeps a share ratio**d of the anchors (each chain a prefix of depths).
        ratio_min: COD sampling floor: every depth keeps at least this share.
        decay: weight of depth d's mean loss is decay**d. 0.7, the COD ratio, weighs each depth by its share of
            the sampled elements, as speculators' P-EAGLE does (one mean over all elements).
        mask_token_id: token id fed at the mask slots (its embedding is the verifier's); default: the
            verifier's pad token, else its eos token, else 0.
        layer_type: draft decoder layers: auto (qwen3 for Qwen3 verifiers, else llama), llama, or qwen3.
        norm_before_residual: use hidden_norm(h) as layer 0's residual (vLLM's flag; speculators' P-EAGLE has it on).
            With decay 0.7, the default since it closed the gap to speculators' P-EAGLE at equal steps (dev/LOG.md,
            session 28: held-out tau 1.325 -> 1.389; each alone +0.02).
        norm_before_fc: one RMSNorm over the concatenated aux states (and the mask hidden state) before fc
            (vLLM's flag; speculators 0.9 turns it on for EAGLE-3 only).
        init: random, or verifier: the decoder layers start as the verifier's layers ``init_layer``,
            ``init_layer + 1``, ... (an early exit of the verifier at the depth-0 slots; ``models/verifier_init.py``).
        init_layer: the first verifier layer ``init: verifier`` copies (default: the last aux layer).
        train_embeddings: train the token embeddings (the mask token's among them) instead of keeping the
            verifier's frozen; the export then carries them (speculators' P-EAGLE trains them by default). A fresh
            draft's: one given by --init-from keeps its own setting.
    """

    depths: int = 4
    num_layers: int = 2
    ratio: float = 0.7
    ratio_min: float = 0.2
    decay: float = 0.7
    mask_token_id: int | None = None
    layer_type: Literal["auto", "llama", "qwen3"] = "auto"
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    init: Literal["random", "verifier"] = "random"
    init_layer: int | None = None
    train_embeddings: bool = False

    def __post_init__(self) -> None:
        check_ranges(("depths", self.depths, AT_LEAST_1), ("num_layers", self.num_layers, AT_LEAST_1))
        if not 0 < self.ratio <= 1 or not 0 <= self.ratio_min <= 1:
            raise ValueError(f"ratio must be in (0, 1] and ratio_min in [0, 1], got {self.ratio}, {self.ratio_min}")
        check_ranges(("decay", self.decay, FRACTION))


def build(inputs: BuildInputs, options: PEagleOptions) -> PEagleDraft:
    cfg = inputs.verifier_config
    shape = DraftShape.from_verifier(cfg, int(inputs.d2t.shape[0]), num_aux=len(inputs.aux_layer_ids),
                                     aux_layer_ids=list(inputs.aux_layer_ids),
                                     train_embeddings=options.train_embeddings)
    draft = PEagleDraft(**shape.fields(), layer_type=resolve_layer_type(options.layer_type, cfg),
                        norm_before_residual=options.norm_before_residual, norm_before_fc=options.norm_before_fc,
                        num_layers=options.num_layers,
                        num_depths=options.depths, mask_token_id=mask_token_of(options.mask_token_id, cfg))
    copy_verifier_weights(draft, inputs.d2t, inputs.t2d, inputs.embed_weight, inputs.lm_head_weight)
    if options.init == "verifier":
        start_from_verifier(draft, inputs, "peagle", options.init_layer)
    return draft


def objective(draft: nn.Module, target_head: nn.Module, options: PEagleOptions, attention: str,
              loss: LossSpec | None = None) -> PEagleObjective:
    if attention != "sdpa":
        raise UserError("P-EAGLE trains with --attention sdpa (its depth masks are explicit)")
    return PEagleObjective(draft, target_head, options.depths, options.ratio, options.ratio_min, options.decay,
                           loss=loss)


FAMILY = DraftFamily(
    name="peagle",
    summary="P-EAGLE: EAGLE-3 inputs, several layers, all draft tokens of a step from one forward (parallel drafting)",
    model=PEagleDraft,
    options=PEagleOptions,
    build=build,
    default_aux_layer_ids=default_aux_layer_ids,
    objective=objective,
    proposer=PEagleProposer,
    formats=(speculators.FORMAT,),
    speculative_tokens=lambda options: options.depths,
    shape_options=("num_layers", "norm_before_residual", "norm_before_fc"),
    fresh_options=("init", "init_layer", "train_embeddings"),
)
