"""DSpark (arXiv 2607.05147) as a draft family: its options, builder (a DFlash draft + heads), warm start from a
trained DFlash draft, and table entry.

    train: {algorithm: dspark, dspark: {block_size: 8, markov_rank: 256}}        # YAML
    tiny-speculators train ... --algorithm dspark --init-from runs/dflash/best --dspark-markov-rank 256
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.models.dflash import family as dflash_family
from tiny_speculators.models.dflash.model import DFlashDraft
from tiny_speculators.models.dflash.objective import default_gamma
from tiny_speculators.models.dspark import speculators
from tiny_speculators.models.dspark.model import DSparkDraft
from tiny_speculators.models.dspark.objective import DSparkObjective
from tiny_speculators.models.dspark.proposer import DSparkProposer
from tiny_speculators.models.family import BuildInputs, DraftFamily
from tiny_speculators.models.losses import LossSpec
from tiny_speculators.options import NON_NEGATIVE, check_ranges


@dataclass(frozen=True)
class DSparkOptions:
    """DSpark's own training options.

    Args:
        block_size: slots per block; with sample_from_anchor every slot drafts a token (block_size tokens served),
            else slot 0 is the bonus token (block_size - 1).
        num_layers: draft decoder layers (DFlash's, with the injected verifier context).
        anchors: random anchors (blocks) per document and training sample.
        gamma: prediction j's loss weight is exp(-j/gamma); default: DFlash's 4/5/7 for blocks 8/10/16.
        markov_rank: rank of the Markov logit bias (0: none).
        markov_head: vanilla (bias from the previous token) or gated (the bias gated by the slot's state).
        confidence_head: train the confidence head (verification length at inference).
        confidence_with_markov: feed the confidence head the Markov embedding of the previous token too.
        sample_from_anchor: the anchor slot drafts too (DSpark's layout) instead of DFlash's.
        ce_weight: the loss's weight of the cross-entropy to the verifier's token.
        tv_weight: the loss's weight of the total variation to the verifier's distribution.
        confidence_weight: the loss's weight of the BCE of the confidence to the acceptance probability.
        mask_token_id: token fed at the mask slots; default as DFlash (pad, else eos, else 0).
        causal: causal attention inside the block instead of bidirectional.
    """

    block_size: int = 8
    num_layers: int = 2
    anchors: int = 64
    gamma: float | None = None
    markov_rank: int = 256
    markov_head: Literal["vanilla", "gated"] = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    sample_from_anchor: bool = True
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    mask_token_id: int | None = None
    causal: bool = False

    def __post_init__(self) -> None:
        dflash_family.check_block_options(self)
        check_ranges(("markov_rank", self.markov_rank, NON_NEGATIVE))
        if min(self.ce_weight, self.tv_weight, self.confidence_weight) < 0:
            raise ValueError("ce_weight, tv_weight and confidence_weight must be >= 0")
        if self.confidence_head and self.confidence_with_markov and not self.markov_rank:
            raise ValueError("confidence_with_markov needs a Markov head (markov_rank > 0)")

    def head_kwargs(self) -> dict:
        return dict(markov_rank=self.markov_rank, markov_head_type=self.markov_head,
                    enable_confidence_head=self.confidence_head,
                    confidence_head_with_markov=self.confidence_head and self.confidence_with_markov,
                    sample_from_anchor=self.sample_from_anchor)


def from_dflash(dflash: nn.Module, options: DSparkOptions) -> DSparkDraft:
    """Warm start: a DSpark draft holding ``dflash``'s weights (every tensor, key for key) and fresh heads; the block
    size is this run's, the mask token and block attention the DFlash draft's."""
    if type(dflash) is not DFlashDraft:
        raise UserError(f"a DSpark draft warm-starts from a DFlash draft, not a {type(dflash).__name__}")
    device = dflash.fc.weight.device
    draft = DSparkDraft(**{**dflash.kwargs, "block_size": options.block_size}, **options.head_kwargs()).to(device)
    missing, unexpected = draft.load_state_dict(dflash.state_dict(), strict=False)
    if unexpected or any(not k.startswith(("markov_head.", "confidence_head.")) for k in missing):
        raise RuntimeError(f"DFlash -> DSpark warm start: missing {missing}, unexpected {unexpected}")
    draft.after_load(device)
    return draft


def build(inputs: BuildInputs, options: DSparkOptions) -> DSparkDraft:
    backbone = dflash_family.build(inputs, dflash_family.DFlashOptions(
        block_size=options.block_size, num_layers=options.num_layers, mask_token_id=options.mask_token_id,
        causal=options.causal))
    return from_dflash(backbone, options)


def objective(draft: nn.Module, target_head: nn.Module, options: DSparkOptions, attention: str,
              loss: LossSpec | None = None) -> DSparkObjective:
    """The run's ``loss`` choice replaces DSpark's token loss (``ce_weight`` / ``tv_weight``) when it names terms;
    the confidence BCE is always added (``confidence_weight``)."""
    if attention != "sdpa":
        raise UserError("DSpark trains with --attention sdpa (its block attention is explicit)")
    if not isinstance(draft, DSparkDraft):
        raise UserError(f"the DSpark objective trains a DSpark draft, not a {type(draft).__name__}")
    if (draft.block_size, draft.sample_from_anchor) != (options.block_size, options.sample_from_anchor):
        raise UserError(f"the draft has block_size {draft.block_size} / sample_from_anchor {draft.sample_from_anchor}, "
                        f"the options ask for {options.block_size} / {options.sample_from_anchor}")
    gamma = options.gamma if options.gamma is not None else default_gamma(draft.block_size)
    if loss is None or loss.terms is None:
        own = tuple((n, w) for n, w in (("ce", options.ce_weight), ("tv", options.tv_weight)) if w)
        if not own:
            raise UserError("dspark: ce_weight and tv_weight are both 0: no token loss")
        loss = LossSpec(terms=own, position_weights=loss.position_weights if loss else "decay",
                        dpace_alpha=loss.dpace_alpha if loss else 0.5)
    return DSparkObjective(draft, target_head, anchors=options.anchors, gamma=gamma, loss=loss,
                           confidence_weight=options.confidence_weight)


def speculative_tokens(options: DSparkOptions) -> int:
    return options.block_size if options.sample_from_anchor else options.block_size - 1


FAMILY = DraftFamily(
    name="dspark",
    summary="DSpark: DFlash's block drafter with a Markov logit bias and a confidence head that sets how many tokens "
            "are verified",
    model=DSparkDraft,
    options=DSparkOptions,
    build=build,
    default_aux_layer_ids=dflash_family.default_aux_layer_ids,
    objective=objective,
    proposer=DSparkProposer,
    formats=(speculators.FORMAT,),
    speculative_tokens=speculative_tokens,
    warm_starts={"dflash": from_dflash},
)
