"""Does a draft fit a verifier? Hidden size, vocabulary and the verifier layers it reads, for any family; the
vocabulary maps that tie a draft's vocabulary to the verifier's, and the verifier's weights a fresh draft starts with.

    from tiny_speculators.models.compat import check_verifier
    check_verifier(draft.kwargs, "smollm2-135m")   # UserError when the draft does not belong to it
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.describe import config_value, verifier_config

__all__ = ["check_against_verifier", "check_verifier", "check_vocab_maps", "copy_verifier_weights"]


def check_against_verifier(draft_kwargs: Mapping[str, Any], verifier: Any, name: str) -> None:
    """UserError when the draft cannot run on this verifier (``verifier``: its text config or a recorded dict)."""
    hidden = int(config_value(verifier, "hidden_size") or 0)
    vocab = int(config_value(verifier, "vocab_size") or 0)
    layers = config_value(verifier, "num_hidden_layers")
    target_hidden = draft_kwargs.get("target_hidden_size") or draft_kwargs["hidden_size"]
    if hidden and hidden != target_hidden:
        raise UserError(f"verifier {name} has hidden size {hidden} but the draft was built for verifier hidden "
                        f"size {target_hidden}: the draft does not belong to this verifier")
    if vocab and vocab != draft_kwargs["vocab_size"]:
        raise UserError(f"verifier {name} has vocab size {vocab} but the draft's embeddings and t2d cover "
                        f"{draft_kwargs['vocab_size']} tokens: the draft does not belong to this verifier")
    aux = draft_kwargs.get("aux_layer_ids")
    if layers and aux and max(aux) > int(layers):  # id N = the last layer's output (before the final norm)
        raise UserError(f"aux layer ids {list(aux)} do not exist in verifier {name} ({layers} layers)")


def check_verifier(draft_kwargs: Mapping[str, Any], verifier: str | None) -> Any:
    """The text config of ``verifier`` (a name, folder or hub id) once the draft is checked against it; None when
    no verifier is given or its config cannot be read (nothing to check)."""
    if not verifier:
        return None
    config = verifier_config(verifier)
    if config is not None:
        check_against_verifier(draft_kwargs, config, verifier)
    return config


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """Validate ``d2t``/``t2d`` against each other; returns the draft->target id table (sorted target ids)."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise UserError(f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; the draft needs "
                        f"({draft_vocab_size},) and ({vocab_size},)")
    target_ids = torch.arange(draft_vocab_size) + d2t.long().cpu()
    if not torch.equal(target_ids, torch.nonzero(t2d.cpu().bool()).flatten()):
        raise UserError("d2t and t2d disagree: draft id i must map to the i-th selected target id")
    return target_ids


def copy_verifier_weights(draft: nn.Module, d2t: torch.Tensor, t2d: torch.Tensor,
                          embed_weight: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None) -> None:
    """Into a fresh draft: the vocabulary maps (checked), the verifier's embeddings when given, and the rows of the
    verifier's lm_head (its full ``[V, H]`` matrix, when given) that the draft vocabulary selects."""
    target_ids = check_vocab_maps(d2t, t2d, draft.draft_vocab_size, draft.embed_tokens.num_embeddings)
    if embed_weight is not None and embed_weight.shape != draft.embed_tokens.weight.shape:
        raise UserError(f"verifier embeddings have shape {tuple(embed_weight.shape)}, the draft needs "
                        f"{tuple(draft.embed_tokens.weight.shape)}")
    if lm_head_weight is not None and lm_head_weight.shape != (draft.embed_tokens.num_embeddings, draft.hidden_size):
        raise UserError(f"verifier lm_head has shape {tuple(lm_head_weight.shape)}, expected "
                        f"({draft.embed_tokens.num_embeddings}, {draft.hidden_size})")
    with torch.no_grad():
        draft.d2t.copy_(d2t.long())
        draft.t2d.copy_(t2d.bool())
        if embed_weight is not None:
            draft.embed_tokens.weight.copy_(embed_weight)
        if lm_head_weight is not None:
            draft.lm_head.weight.copy_(lm_head_weight[target_ids.to(lm_head_weight.device)])
