"""Draft trees verified in ONE verifier forward with a tree attention mask.

The tree comes from the proposer (``proposer.build_tree(root, params)``, for families that support trees,
e.g. EAGLE-2 dynamic trees from an EAGLE-3 draft).

Verification: the root and the selected nodes go through the verifier at positions ``pos + depth`` with
a mask that lets each node see the cached prefix, its ancestors and itself. Walking down from the root,
the verifier picks its token at the current node (argmax, or a SAMPLE from its own distribution when
temperature > 0) and the walk continues into the child holding that token, else stops with that token
as the next one. Every emitted token is therefore exactly the verifier's own choice (lossless; with
sampling this is "target-only" verification: lossless, though it accepts less than multi-draft
rejection sampling would). Afterwards the verifier cache is compacted to the accepted path.
"""

from __future__ import annotations

import torch

from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.family import Proposer, TreeParams
from tiny_speculators.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["tree_mask", "tree_step"]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """bool [N, N]: node i may attend to node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_step(target: TargetRunner, proposer: Proposer, pending: int, pos: int, params: TreeParams,
              sampling: SamplingParams,
              generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor, int]:
    """Build a tree, verify it in one forward, keep the accepted path in the verifier cache.

    Returns (accepted draft tokens, next token, aux [1 + accepted, n_aux*H] along the path, proposed)."""
    tree = proposer.build_tree(pending, params)
    positions = pos + torch.tensor(tree.depths)
    logits, aux = target.forward(torch.tensor(tree.tokens), positions, tree_mask(tree.parents))  # (N+1, V)
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens,
                                                                                     strict=True)) if p >= 0}
    node, path = 0, [0]
    while True:
        if sampling.greedy:
            tok = int(torch.argmax(logits[node]))
        else:
            tok = sample(probs_from_logits(logits[node], sampling).cpu(), generator)
        child = children.get((node, tok))
        if child is None:
            break
        node = child
        path.append(child)
    idx = torch.tensor(path)
    target.keep(torch.cat([torch.arange(pos), pos + idx]))
    accepted = [tree.tokens[i] for i in path[1:]]
    return accepted, tok, aux[idx.to(aux.device)], len(tree.tokens) - 1
