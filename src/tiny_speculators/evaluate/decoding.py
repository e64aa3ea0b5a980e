"""Speculative decoding loop (chain drafts, or trees where the family supports them) and the verifier-alone
baseline. The draft side is a family's :class:`~tiny_speculators.models.family.Proposer`: after each
verification the loop commits the verified tokens with the verifier's aux hidden states at their positions
(the proposer drops its speculative state from there), then asks for the next ``k`` tokens. The verifier's KV
cache persists across steps, cropped to the accepted prefix.

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

from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.target import TargetRunner
from tiny_speculators.evaluate.tree import tree_step
from tiny_speculators.models.family import ConfidenceProposer, Proposer, TreeParams
from tiny_speculators.sampling import SamplingParams, accept_chain, probs_from_logits, sample

__all__ = ["DecodeResult", "TreeParams", "autoregressive_generate", "speculative_generate"]


GREEDY = SamplingParams()


@dataclass
class DecodeResult:
    tokens: list[int]  # emitted token ids (EOS included when hit), at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification forward
    proposed: list[int] = field(default_factory=list)  # draft tokens sent to the verifier per forward
    confidences: list[list[float]] = field(default_factory=list)  # per forward, the sent tokens' predicted acceptance
    verifier_forwards: int = 0  # including the prefill
    draft_forwards: int = 0  # draft forward passes (prompt commit included)
    draft_seconds: float = 0.0  # wall time inside the proposer (commit + proposals)
    seconds: float = 0.0


class _TimedProposer:
    """The proposer with the time spent in it measured (device-synchronized around each call)."""

    def __init__(self, proposer: Proposer, device: torch.device) -> None:
        self.inner, self.device, self.seconds = proposer, device, 0.0
        self.supports_tree = proposer.supports_tree
        self.reports_confidence = isinstance(proposer, ConfidenceProposer) and proposer.has_confidence

    @property
    def draft_forwards(self) -> int:
        return self.inner.draft_forwards

    def _timed(self, fn, *args):
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        return out

    def reset(self) -> None:
        self.inner.reset()

    def set_positions(self, positions: torch.Tensor) -> None:
        self.inner.set_positions(positions)

    def commit(self, tokens, aux, start) -> None:
        self._timed(self.inner.commit, tokens, aux, start)

    def propose_chain(self, k, params, generator):
        return self._timed(self.inner.propose_chain, k, params, generator)

    def build_tree(self, root, params):
        return self._timed(self.inner.build_tree, root, params)


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


def chain_step(target: TargetRunner, proposer: Proposer, pending: int, pos: int, k: int,
               params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor, int]:
    """Draft up to k tokens, verify ``[pending, d1..dm]`` at ``pos..pos+m`` in one forward, roll back (``m <= k``:
    a proposer may cut its chain short, e.g. where its confidence drops).

    Returns (accepted draft tokens, next token, aux [1 + accepted, n_aux*H] of pending + accepted, proposed = m)."""
    draft, q = proposer.propose_chain(k, params, generator)
    m = len(draft)
    if m > k:
        raise RuntimeError(f"the proposer returned {m} tokens for k={k}")
    logits, aux = target.forward(torch.tensor([pending, *draft]), torch.arange(pos, pos + m + 1))  # (m+1, V)
    if params.greedy:
        preds = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < m and draft[n] == preds[n]:
            n += 1
        nxt = preds[n]
    else:
        n, nxt = accept_chain(probs_from_logits(logits, params).cpu(), q, draft, generator)
    target.crop(pos + 1 + n)
    return draft[:n], nxt, aux[: n + 1], m


@torch.no_grad()
def speculative_generate(target: TargetRunner, proposer: Proposer, prompt: list[int], *, k: int = 4,
                         max_new_tokens: int = 64, params: SamplingParams = GREEDY,
                         eos_ids: set[int] | frozenset[int] = frozenset(), tree: TreeParams | None = None,
                         generator: torch.Generator | None = None,
                         images: dict[str, torch.Tensor] | None = None) -> DecodeResult:
    """Generate up to ``max_new_tokens`` after ``prompt`` with draft + verifier (chain, or tree if given);
    ``images``: a vision-language verifier's image inputs of the prompt and its M-RoPE ``position_ids`` [3, T]
    (chains only: the draft runs at their temporal row, as vLLM runs a text-only draft)."""
    if images is not None and (tree is not None or not hasattr(proposer, "set_positions")):
        raise UserError("a prompt with images is decoded with a chain draft that takes positions "
                        "(EAGLE-3), not a tree")
    eos_ids = set(eos_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    proposer = _TimedProposer(proposer, target.device)
    proposer.reset()
    forwards0 = proposer.draft_forwards
    n_prompt = len(prompt)
    logits, aux = target.forward(torch.tensor(prompt), torch.arange(n_prompt), last_logits_only=True, images=images)
    if images is not None:
        proposer.set_positions(images["position_ids"][0])
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
        if tree is None and proposer.reports_confidence:
            result.confidences.append(list(proposer.inner.last_confidences))
        result.tokens += [*accepted, nxt]
        if not _done(result.tokens, max_new_tokens, eos_ids):
            proposer.commit([*accepted, nxt], path_aux, pos)
        pos += len(accepted) + 1
        pending = nxt
    _sync(target.device)
    result.seconds = time.perf_counter() - t0
    result.draft_forwards = proposer.draft_forwards - forwards0
    result.draft_seconds = proposer.seconds
    result.tokens = _truncate(result.tokens, max_new_tokens, eos_ids)
    return result


@torch.no_grad()
def autoregressive_generate(target: TargetRunner, prompt: list[int], *, max_new_tokens: int = 64,
                            params: SamplingParams = GREEDY,
                            eos_ids: set[int] | frozenset[int] = frozenset(),
                            generator: torch.Generator | None = None,
                            images: dict[str, torch.Tensor] | None = None) -> DecodeResult:
    """The verifier alone, one token per forward, same KV cache and sampling code (the speed-up baseline)."""
    eos_ids = set(eos_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), last_logits_only=True, images=images)
    tokens = [_choose(logits[-1], params, generator)]
    while not _done(tokens, max_new_tokens, eos_ids):
        logits, _ = target.forward(torch.tensor(tokens[-1:]), torch.tensor([len(prompt) + len(tokens) - 1]))
        tokens.append(_choose(logits[-1], params, generator))
    _sync(target.device)
    return DecodeResult(tokens=_truncate(tokens, max_new_tokens, eos_ids), verifier_forwards=len(tokens),
                        seconds=time.perf_counter() - t0)
