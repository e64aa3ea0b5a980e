"""The EAGLE-3 proposer the evaluator drives: chain proposals (one draft forward per token after the first, the
shared :class:`~tiny_speculators.models.chain.ChainProposer`: how the draft is fed) and EAGLE-2 dynamic trees.

Tree drafting (EAGLE-2): the root is the pending token; its ``topk`` most likely children form level 1.
At each further level the ``topk`` frontier nodes with the highest cumulative log-probability are fed to
the draft together (each attends to the verified prefix and its own ancestors, positions by depth) and each
gets its ``topk`` most likely children. Finally the ``total_tokens`` best nodes by cumulative score (always
closed under ancestors) are sent to the verifier.
"""

from __future__ import annotations

import torch

from tiny_speculators.models.chain import ChainProposer
from tiny_speculators.models.eagle3.model import Eagle3Draft
from tiny_speculators.models.family import DraftTree, TreeParams

__all__ = ["Eagle3Proposer"]


class Eagle3Proposer(ChainProposer):
    """Chain proposals (:class:`~tiny_speculators.models.chain.ChainProposer`) and EAGLE-2 dynamic trees."""

    supports_tree = True

    def __init__(self, draft: Eagle3Draft):
        super().__init__(draft)
        # tree masks address cache slots, not positions: a sliding-window draft drafts chains only
        self.supports_tree = not draft.kwargs.get("sliding_window")

    def build_tree(self, root: int, params: TreeParams) -> DraftTree:
        """An EAGLE-2 dynamic tree from the current state (module docstring); the draft cache is left as found."""
        return build_tree(self, root, params)


@torch.no_grad()
def build_tree(proposer: Eagle3Proposer, root: int, params: TreeParams) -> DraftTree:
    """Expand a dynamic tree from the proposer's current state; leaves the draft cache as it found it."""
    base = proposer.cache.length  # the draft's verified prefix; the root's children are fed at position `base`
    topk = min(params.topk, proposer.draft.draft_vocab_size)
    # candidates: token, parent candidate (-1 = root), depth, score; `cache_at` for nodes fed to the draft
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    cache_at: dict[int, int] = {}
    out_hidden: dict[int, torch.Tensor] = {-1: proposer.hidden}

    def expand(parent: int, logits: torch.Tensor, parent_score: float, depth: int) -> list[int]:
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, topk)
        new = []
        for lp, d in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            tokens.append(int(proposer.target_ids[d]))
            parents.append(parent)
            depths.append(depth)
            scores.append(parent_score + lp)
            new.append(len(tokens) - 1)
        return new

    level = expand(-1, proposer.logits, 0.0, 1)
    for depth in range(2, params.depth + 1):
        frontier = sorted(level, key=lambda c: -scores[c])[:topk]
        n = len(frontier)
        start = proposer.cache.length
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        mask[:, :base] = True
        for row, c in enumerate(frontier):
            mask[row, start + row] = True
            a = parents[c]
            while a >= 0:
                mask[row, cache_at[a]] = True
                a = parents[a]
        hidden = torch.stack([out_hidden[parents[c]] for c in frontier])  # (n, H)
        pos = torch.full((n,), base + depth - 2)
        logits, hid = proposer.step(torch.tensor([tokens[c] for c in frontier]), hidden, pos, mask)
        level = []
        for row, c in enumerate(frontier):
            cache_at[c] = start + row
            out_hidden[c] = hid[row]
            level += expand(c, logits[row], scores[c], depth)
    proposer.cache.crop(base)

    # best `total_tokens` candidates by score; parents sort before children (score ties: earlier first)
    order = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))
    chosen: dict[int, int] = {-1: 0}
    tree = DraftTree(tokens=[root], parents=[-1], depths=[0])
    for c in order:
        if len(tree.tokens) > params.total_tokens:
            break
        if parents[c] in chosen:
            chosen[c] = len(tree.tokens)
            tree.tokens.append(tokens[c])
            tree.parents.append(chosen[parents[c]])
            tree.depths.append(depths[c])
    return tree
