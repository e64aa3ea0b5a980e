"""The MTP proposer: a chain of k steps reusing the one MTP layer, as vLLM drafts with a single MTP layer.

Fed like EAGLE-3's (the shared chain proposer, ``models/chain.py``): after each verification the layer's cache is cut
back to the last verified position and the verifier's last pre-norm states at the committed positions are fed
with the committed tokens shifted by one (the last one the bonus token); each further step feeds the layer's
own output (after ``final_layernorm``, what vLLM feeds back) with the token just drafted. Chains only: vLLM runs
MTP layers as chains, so trees are not offered.

    from tiny_speculators.models.mtp.proposer import MTPProposer
    proposer = MTPProposer(draft)      # evaluate drives commit() / propose_chain(k, ...)
"""

from __future__ import annotations

from tiny_speculators.models.chain import ChainProposer
from tiny_speculators.models.mtp.model import MTPDraft

__all__ = ["MTPProposer"]


class MTPProposer(ChainProposer):
    supports_tree = False

    def __init__(self, draft: MTPDraft):
        super().__init__(draft)
