"""vLLM's Prometheus ``/metrics``: the speculative-decoding counters, read before and after a load run.

vLLM counts, per engine, the drafts it proposed (``vllm:spec_decode_num_drafts``), the draft tokens in
them (``..._num_draft_tokens``), the accepted ones (``..._num_accepted_tokens``) and the accepted ones
per draft position (``..._num_accepted_tokens_per_pos{position="i"}``); ``prometheus_client`` exposes
each counter with a ``_total`` suffix. The difference of two snapshots is what one load run did:
τ = 1 + accepted / drafts (tokens per verifier step) and per-position acceptance = accepted at i / drafts.

    from tiny_speculators.benchmark.metrics import fetch_metrics, server_counters
    before = server_counters(fetch_metrics("http://127.0.0.1:8000"))
    ...  # drive some load
    run = server_counters(fetch_metrics("http://127.0.0.1:8000")) - before
    print(run.spec.acceptance_length if run.spec else "no draft")
"""

from __future__ import annotations

import logging
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from tiny_speculators.errors import UserError

__all__ = ["Sample", "ServerCounters", "SpecDecodeCounters", "fetch_metrics", "parse_prometheus",
           "server_counters"]

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
REQUESTS_FINISHED = "vllm:request_success"

# name{labels} value [timestamp]; label values may hold escaped quotes
_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    """One line of the Prometheus text format."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments and blank lines skipped)."""
    samples = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise UserError(f"line {n} of the /metrics text is not in the Prometheus format: {line[:80]!r}")
        labels = {m["key"]: m["value"].replace('\\"', '"').replace("\\\\", "\\")
                  for m in _LABEL.finditer(match["labels"] or "")}
        try:
            value = float(match["value"])
        except ValueError:
            raise UserError(f"line {n} of the /metrics text has a non-numeric value: {line[:80]!r}") from None
        samples.append(Sample(match["name"], labels, value))
    return samples


def _counter(samples: list[Sample], name: str) -> list[Sample]:
    """The samples of counter ``name`` (exposed as ``name_total`` by prometheus_client, or bare)."""
    total = [s for s in samples if s.name == f"{name}_total"]
    return total or [s for s in samples if s.name == name]


def _whole(value: float) -> int:
    return round(value) if math.isfinite(value) else 0


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, summed over engines (and over the models a server serves)."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...]  # accepted tokens at draft position 0, 1, ...

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        width = max(len(self.per_position), len(other.per_position))
        mine = list(self.per_position) + [0] * (width - len(self.per_position))
        theirs = list(other.per_position) + [0] * (width - len(other.per_position))
        return SpecDecodeCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                                  self.accepted + sign * other.accepted,
                                  tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)))

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(before, -1)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, 1)

    @property
    def acceptance_length(self) -> float | None:
        """τ: tokens per verifier step, 1 + accepted / drafts (None before the first draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position_acceptance(self) -> list[float] | None:
        """Fraction of drafts whose token at position i was accepted."""
        return [n / self.drafts for n in self.per_position] if self.drafts else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    def to_json(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
                "accepted_per_position": list(self.per_position), "acceptance_length": self.acceptance_length,
                "per_position_acceptance": self.per_position_acceptance,
                "draft_acceptance_rate": self.draft_acceptance_rate}


@dataclass(frozen=True)
class ServerCounters:
    """What one ``/metrics`` snapshot says: tokens generated, requests finished, and the draft's counters
    (``spec`` is None for a server that runs no speculative decoding)."""

    generation_tokens: int
    prompt_tokens: int
    requests_finished: int
    spec: SpecDecodeCounters | None

    def __sub__(self, before: ServerCounters) -> ServerCounters:
        spec = None
        if self.spec is not None:
            spec = self.spec - (before.spec or SpecDecodeCounters(0, 0, 0, ()))
        return ServerCounters(self.generation_tokens - before.generation_tokens,
                              self.prompt_tokens - before.prompt_tokens,
                              self.requests_finished - before.requests_finished, spec)

    def to_json(self) -> dict[str, Any]:
        return {"generation_tokens": self.generation_tokens, "prompt_tokens": self.prompt_tokens,
                "requests_finished": self.requests_finished,
                "spec_decode": self.spec.to_json() if self.spec else None}


def server_counters(text: str) -> ServerCounters:
    """The counters of one ``/metrics`` text (a server without a draft has no spec-decode counters)."""
    samples = parse_prometheus(text)

    def total(name: str) -> int:
        return _whole(sum(s.value for s in _counter(samples, name)))

    spec = None
    if _counter(samples, DRAFTS):
        positions: dict[int, float] = {}
        for s in _counter(samples, ACCEPTED_PER_POS):
            if "position" not in s.labels:
                raise UserError(f"{ACCEPTED_PER_POS} has a sample without a position label: {s.labels}")
            pos = int(s.labels["position"])
            positions[pos] = positions.get(pos, 0.0) + s.value
        per_position = tuple(_whole(positions.get(i, 0.0)) for i in range(max(positions) + 1)) if positions else ()
        spec = SpecDecodeCounters(total(DRAFTS), total(DRAFT_TOKENS), total(ACCEPTED), per_position)
    return ServerCounters(total(GENERATION_TOKENS), total(PROMPT_TOKENS), total(REQUESTS_FINISHED), spec)


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """The ``/metrics`` text of the server at ``url`` (its base URL, with or without ``/v1``)."""
    target = url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"{target} did not answer ({reason}): is a vLLM server running there?") from None
