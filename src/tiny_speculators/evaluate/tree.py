"""EAGLE-2 dynamic draft trees, verified in ONE verifier forward with a tree attention mask.

Drafting (as in EAGLE-2): the root is the pending token; its ``topk`` most likely children form level 1.
At each further level the ``topk`` frontier nodes with the highest cumulative log-probability (product of
draft probabilities along the path) are fed to the draft together (each attends to the verified prefix
and its own ancestors, positions by depth) and each gets its ``topk`` most likely children. Finally the
``total_tokens`` best nodes by cumulative score (always closed under ancestors) are sent to the verifier.

Verification: the root and the selected nodes go through the verifier at positions ``pos + depth`` with
a mask that lets each node see the cached prefix, its ancestors and itself. Walking down from the root,
the verifier picks its token at the current node (argmax, or a SAMPLE from its own distribution when
temperature > 0) and the walk continues into the child holding that token, else stops with that token
as the next one. Every emitted token is therefore exactly the verifier's own choice (lossless; with
sampling this is "target-only" verification: lossless, though it accepts less than multi-draft
rejection sampling would). Afterwards the verifier cache is compacted to the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiny_speculators.evaluate.decoding import Eagle3Proposer, TreeParams
from tiny_speculators.evaluate.sampling import SamplingParams, probs_from_logits, sample
from tiny_speculators.evaluate.target import TargetRunner

__all__ = ["DraftTree", "build_tree", "tree_mask", "tree_step"]


@dataclass
class DraftTree:
    """Node 0 is the root (the pending token); parents come before children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """bool [N, N]: node i may attend to node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


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


def tree_step(target: TargetRunner, proposer: Eagle3Proposer, pending: int, pos: int, params: TreeParams,
              sampling: SamplingParams,
              generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor, int]:
    """Build a tree, verify it in one forward, keep the accepted path in the verifier cache.

    Returns (accepted draft tokens, next token, aux [1 + accepted, n_aux*H] along the path, proposed)."""
    tree = build_tree(proposer, pending, params)
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
