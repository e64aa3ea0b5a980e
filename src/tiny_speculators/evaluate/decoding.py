"""Speculative decoding loop (chain drafts) and the EAGLE-3 draft runner; the verifier-alone baseline.

How the draft is fed (as vLLM's EAGLE proposer does it): draft position ``t`` consumes the pair
(hidden state of position ``t``, token at ``t + 1``) and predicts the token at ``t + 2``. After each
verification the draft's cache is cropped back to the last verified position and the verifier's fused
aux hidden states at the committed positions are fed with the committed tokens shifted by one (the
last one being the verifier's bonus / replacement token); the following draft steps feed the draft's
own pre-norm output as the hidden state. Both KV caches persist across steps: the verifier's is cropped
to the accepted prefix, the draft's to the last position that saw verifier features.

Acceptance statistics follow vLLM's ``SpecDecodingStats``: one "draft" per verification forward,
``acceptance_length = 1 + accepted / drafts`` (the bonus/replacement token counts), and per-position
acceptance ``accepted_at[i] / drafts``.

    python -c "from tiny_speculators.evaluate.stage import evaluate; \
evaluate('smollm2-135m', 'runs/train/final', 'runs/eval', prompts='chat', max_prompts=2, max_new_tokens=32)"
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tiny_speculators.evaluate.sampling import SamplingParams, accept_chain, probs_from_logits, sample
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.models.eagle3.model import Eagle3Draft, KVCache

__all__ = ["DecodeResult", "Eagle3Proposer", "TreeParams", "autoregressive_generate", "speculative_generate"]


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TreeParams:
    """EAGLE-2 dynamic tree: ``depth`` draft levels, ``topk`` children per expanded node and ``topk`` nodes
    expanded per level, ``total_tokens`` draft nodes (root excluded) sent to the verifier."""

    depth: int = 5
    topk: int = 4
    total_tokens: int = 24


@dataclass
class DecodeResult:
    tokens: list[int]  # emitted token ids (EOS included when hit), at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification forward
    proposed: list[int] = field(default_factory=list)  # draft tokens sent to the verifier per forward
    verifier_forwards: int = 0  # including the prefill
    seconds: float = 0.0


class Eagle3Proposer:
    """Holds an :class:`Eagle3Draft`, its KV cache and the latest draft logits / pre-norm hidden state."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
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
        return out.logits[0].float(), out.hidden_states[0]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf for ids outside the draft vocab)."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.target_ids] = logits
        return full

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


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(probs_from_logits(logits, params), generator)


def _done(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos_ids for t in tokens)


def _truncate(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chain_step(target: TargetRunner, proposer: Eagle3Proposer, pending: int, pos: int, k: int,
               params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor, int]:
    """Draft k tokens, verify ``[pending, d1..dk]`` at ``pos..pos+k`` in one forward, roll back.

    Returns (accepted draft tokens, next token, aux [1 + accepted, n_aux*H] of pending + accepted, proposed)."""
    draft, q = proposer.propose_chain(k, params, generator)
    logits, aux = target.forward(torch.tensor([pending, *draft]), torch.arange(pos, pos + k + 1))  # (k+1, V)
    if params.greedy:
        preds = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < k and draft[n] == preds[n]:
            n += 1
        nxt = preds[n]
    else:
        n, nxt = accept_chain(probs_from_logits(logits, params).cpu(), q, draft, generator)
    target.crop(pos + 1 + n)
    return draft[:n], nxt, aux[: n + 1], k


@torch.no_grad()
def speculative_generate(target: TargetRunner, proposer: Eagle3Proposer, prompt: list[int], *, k: int = 4,
                         max_new_tokens: int = 64, params: SamplingParams = GREEDY,
                         eos_ids: set[int] | frozenset[int] = frozenset(), tree: TreeParams | None = None,
                         generator: torch.Generator | None = None) -> DecodeResult:
    """Generate up to ``max_new_tokens`` after ``prompt`` with draft + verifier (chain, or tree if given)."""
    from tiny_speculators.evaluate.tree import tree_step

    eos_ids = set(eos_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    proposer.reset()
    n_prompt = len(prompt)
    logits, aux = target.forward(torch.tensor(prompt), torch.arange(n_prompt), last_logits_only=True)
    pending = _choose(logits[-1], params, generator)
    result = DecodeResult(tokens=[pending], verifier_forwards=1)
    if not _done(result.tokens, max_new_tokens, eos_ids):
        proposer.commit([*prompt[1:], pending], aux, 0)
    pos = n_prompt  # position of the pending token (not yet in the verifier's cache)
    while not _done(result.tokens, max_new_tokens, eos_ids):
        if tree is None:
            accepted, nxt, path_aux, proposed = chain_step(target, proposer, pending, pos, k, params, generator)
        else:
            accepted, nxt, path_aux, proposed = tree_step(target, proposer, pending, pos, tree, params, generator)
        result.verifier_forwards += 1
        result.accepted.append(len(accepted))
        result.proposed.append(proposed)
        result.tokens += [*accepted, nxt]
        if not _done(result.tokens, max_new_tokens, eos_ids):
            proposer.commit([*accepted, nxt], path_aux, pos)
        pos += len(accepted) + 1
        pending = nxt
    _sync(target.device)
    result.seconds = time.perf_counter() - t0
    result.tokens = _truncate(result.tokens, max_new_tokens, eos_ids)
    return result


@torch.no_grad()
def autoregressive_generate(target: TargetRunner, prompt: list[int], *, max_new_tokens: int = 64,
                            params: SamplingParams = GREEDY,
                            eos_ids: set[int] | frozenset[int] = frozenset(),
                            generator: torch.Generator | None = None) -> DecodeResult:
    """The verifier alone, one token per forward, same KV cache and sampling code (the speed-up baseline)."""
    eos_ids = set(eos_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), last_logits_only=True)
    tokens = [_choose(logits[-1], params, generator)]
    while not _done(tokens, max_new_tokens, eos_ids):
        logits, _ = target.forward(torch.tensor(tokens[-1:]), torch.tensor([len(prompt) + len(tokens) - 1]))
        tokens.append(_choose(logits[-1], params, generator))
    _sync(target.device)
    return DecodeResult(tokens=_truncate(tokens, max_new_tokens, eos_ids), verifier_forwards=len(tokens),
                        seconds=time.perf_counter() - t0)
