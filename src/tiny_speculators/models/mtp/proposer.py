"""The MTP proposer: a chain of k steps reusing the one MTP layer, as vLLM drafts with a single MTP layer.

Fed like EAGLE-3's (``eagle3/proposer.py``, which it reuses): after each verification the layer's cache is cut
back to the last verified position and the verifier's last pre-norm states at the committed positions are fed
with the committed tokens shifted by one (the last one the bonus token); each further step feeds the layer's
own output (after ``final_layernorm``, what vLLM feeds back) with the token just drafted. Chains only: vLLM runs
MTP layers as chains, so trees are not offered.

    from tiny_speculators.models.mtp.proposer import MTPProposer
    proposer = MTPProposer(draft)      # evaluate drives commit() / propose_chain(k, ...)
"""

from __future__ import annotations

import torch

from tiny_speculators.models.eagle3.proposer import Eagle3Proposer
from tiny_speculators.models.mtp.model import MTPDraft

__all__ = ["MTPProposer"]


class MTPProposer(Eagle3Proposer):
    supports_tree = False

    def __init__(self, draft: MTPDraft):
        super().__init__(draft)

    @property
    def device(self) -> torch.device:
        return self.draft.lm_head.weight.device

    def build_tree(self, root, params):  # pragma: no cover - never called: supports_tree is False
        raise NotImplementedError("MTP drafts propose chains only (as vLLM runs them)")
