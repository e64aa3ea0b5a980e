"""Does a draft fit a verifier? Hidden size, vocabulary and the verifier layers it reads, for any family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiny_speculators.errors import UserError
from tiny_speculators.verifier.describe import config_value

__all__ = ["check_against_verifier"]


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
