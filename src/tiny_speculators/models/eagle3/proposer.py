"""The EAGLE-3 proposer the evaluator drives: the draft, its KV cache, the latest draft logits and pre-norm
hidden state, chain proposals (one draft forward per token after the first) and EAGLE-2 dynamic trees.

How the draft is fed (as vLLM's EAGLE proposer does it): draft position ``t`` consumes the pair
(hidden state of position ``t``, token at ``t + 1``) and predicts the token at ``t + 2``. After each
verification the draft's cache is cropped back to the last verified position and the verifier's fused
aux hidden states at the committed positions are fed with the committed tokens shifted by one (the
last one being the verifier's bonus / replacement token); the following draft steps feed the draft's
own pre-norm output as the hidden state.

Tree drafting (EAGLE-2): the root is the pending token; its ``topk`` most likely children form level 1.
At each further level the ``topk`` frontier nodes with the highest cumulative log-probability are fed to
the draft together (each attends to the verified prefix and its own ancestors, positions by depth) and each
gets its ``topk`` most likely children. Finally the ``total_tokens`` best nodes by cumulative score (always
closed under ancestors) are sent to the verifier.
"""

from __future__ import annotations

import torch

from tiny_speculators.models.eagle3.model import Eagle3Draft, KVCache, to_target_logits
from tiny_speculators.models.family import DraftTree, TreeParams
from tiny_speculators.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["Eagle3Proposer"]


class Eagle3Proposer:
    """Holds an :class:`Eagle3Draft`, its KV cache and the latest draft logits / pre-norm hidden state."""

    supports_tree = True

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.draft_forwards = 0
        self.cache = KVCache()
        dev = draft.d2t.device
        self.target_ids = draft.to_target_ids(torch.arange(draft.draft_vocab_size, device=dev))  # (Vd,)
        self.vocab_size = draft.embed_tokens.num_embeddings
        self.logits: torch.Tensor | None = None  # (Vd,) predicts the token after the pending one
        self.hidden: torch.Tensor | None = None  # (H,)

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    def reset(self) -> None:
        self.cache.reset()
        self.logits = self.hidden = None

    @torch.no_grad()
    def commit(self, tokens: list[int], aux: torch.Tensor, start: int) -> None:
        """Feed verified features: ``aux`` [T, n_aux*Ht] of positions ``start..start+T-1`` with ``tokens``
        (the token at each position + 1). Drops any speculative draft entries from ``start`` on."""
        self.cache.crop(min(start, self.cache.length))
        dev = self.device
        ids = torch.tensor(tokens, device=dev)[None]  # (1, T)
        pos = torch.arange(start, start + len(tokens), device=dev)[None]
        out = self.draft(ids, self.draft.fuse(aux.to(dev)[None]), pos, cache=self.cache, logits=False)
        self.draft_forwards += 1
        self.hidden = out.hidden_states[0, -1]  # (H,)
        self.logits = self.draft.compute_logits(self.hidden).float()  # only the last position is needed

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward of ``tokens`` [n] with ``hidden`` [n, H] at ``positions`` [n] (appends to the cache).
        ``mask``: bool [n, S] over all keys (cached + new), None = causal. Returns (logits [n, Vd], hidden [n, H])."""
        dev = self.device
        m = None if mask is None else mask.to(dev)[None, None]
        out = self.draft(tokens.to(dev)[None], hidden[None], positions.to(dev)[None], attention_mask=m,
                         cache=self.cache)
        self.draft_forwards += 1
        return out.logits[0].float(), out.hidden_states[0]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf outside the draft vocab)."""
        return to_target_logits(self.draft, logits)

    @torch.no_grad()
    def propose_chain(self, k: int, params: SamplingParams,
                      generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens (target ids) after the pending token; with sampling also their distributions q [k, V]."""
        start = self.cache.length
        logits, hidden = self.logits, self.hidden
        tokens, qs = [], []
        for i in range(k):
            if params.greedy:
                tok = int(self.target_ids[int(torch.argmax(logits))])
            else:
                q = probs_from_logits(self.to_target_logits(logits), params).cpu()
                tok = sample(q, generator)
                qs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                lg, hd = self.step(torch.tensor([tok]), hidden[None], torch.tensor([start + i]))
                logits, hidden = lg[0], hd[0]
        return tokens, (torch.stack(qs) if qs else None)

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
