"""Serving benchmark: an exported draft inside ``vllm serve``, loaded by GuideLLM, acceptance from ``/metrics``.

    tiny-speculators benchmark --draft runs/smollm2-135m/export --verifier smollm2-135m --out runs/benchmark
"""

from tiny_speculators.benchmark.metrics import ServerCounters, SpecDecodeCounters, parse_prometheus, server_counters
from tiny_speculators.serving import VllmServer

__all__ = ["ServerCounters", "SpecDecodeCounters", "VllmServer", "parse_prometheus", "server_counters"]
