"""``compare --backend vllm``: a draft's per-prompt counters as vLLM counts them while serving it.

Each prompt is rendered with the verifier's chat template (the token ids our evaluator decodes from) and sent alone
to ``/v1/completions``, greedy, as token ids; the draft's counters for that prompt are the difference of two
``/metrics`` snapshots, the second read once the server's generated-token counter has taken in the whole answer
(vLLM updates its counters after it answers). The result has the shape of an ``evaluate`` ``results.json``, so the
paired bootstrap of :mod:`.stage` reads both alike. The server is either started here (``vllm serve`` with the
draft, from the vLLM environment, stopped at the end, also on error) or one already running with the draft
(``--endpoints``): requests must then be this command's alone while it measures.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tiny_speculators.benchmark.metrics import ServerCounters, fetch_metrics, server_counters
from tiny_speculators.benchmark.stage import read_draft, request_json, served_model, serving_verifier
from tiny_speculators.errors import UserError
from tiny_speculators.evaluate.prompts import Prompt, load_prompts, render_prompt
from tiny_speculators.serving import VllmServer, default_vllm_venv, sigterm_as_exit, vllm_python

__all__ = ["served_results"]

log = logging.getLogger(__name__)


def served_results(draft: Path, name: str, out: Path, verifier: str | None, *, endpoint: str | None, prompts: str,
                   k: int | None, max_new_tokens: int, max_prompts: int | None, dtype: str,
                   vllm_venv: Path | None, timeout: float = 600.0) -> dict[str, Any]:
    """``draft``'s per-prompt counters in vLLM (``endpoint``: a server already serving it; else one started here)."""
    from tiny_speculators.verifier.load import load_tokenizer, verifier_id

    info = read_draft(draft)
    verifier_path = serving_verifier(verifier, info["verifier"])
    tokenizer = load_tokenizer(verifier_path)
    chosen = load_prompts(prompts, max_prompts)
    rendered = [render_prompt(p, tokenizer) for p in chosen]
    served_k = k or info["k"]  # a running server's own k is not ours to set: the draft's, for the record
    if endpoint is not None:
        rows = _measure(endpoint, served_model(endpoint, f"--endpoints {endpoint}"), chosen, rendered,
                        max_new_tokens, timeout)
    else:
        venv = Path(vllm_venv).expanduser() if vllm_venv is not None else default_vllm_venv()
        log_path = out / "logs" / f"{name.replace('/', '-')}-server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with sigterm_as_exit(), VllmServer(vllm_python(venv), verifier_path, log_path=log_path, dtype=dtype,
                                           speculative_config=info["spec"](served_k), enforce_eager=True,
                                           max_model_len=max(map(len, rendered)) + max_new_tokens + 16,
                                           name=f"vllm serve with {draft}") as server:
            rows = _measure(server.url, verifier_path, chosen, rendered, max_new_tokens, timeout)
    return {"per_prompt": rows, "verifier_id": verifier_id(verifier_path), "k": served_k, "backend": "vllm",
            "draft": str(draft), "endpoint": endpoint}


def _measure(url: str, model: str, prompts: list[Prompt], rendered: list[list[int]], max_new_tokens: int,
             timeout: float) -> list[dict[str, Any]]:
    rows = []
    for prompt, ids in zip(prompts, rendered, strict=True):
        before = _snapshot(url)
        answer = _complete(url, model, ids, max_new_tokens, timeout)
        generated = int(answer["usage"]["completion_tokens"])
        after = _settled(url, before, generated)
        spec = after.spec - before.spec  # type: ignore[operator]
        rows.append({"id": prompt.id, "num_drafts": spec.drafts, "num_accepted_tokens": spec.accepted,
                     "num_accepted_tokens_per_pos": list(spec.per_position), "new_tokens": generated})
    return rows


def _snapshot(url: str) -> ServerCounters:
    counters = server_counters(fetch_metrics(url))
    if counters.spec is None:
        raise UserError(f"{url} runs no speculative decoding (its /metrics has no spec_decode counters): serve the "
                        "draft there")
    return counters


def _settled(url: str, before: ServerCounters, generated: int, wait: float = 30.0) -> ServerCounters:
    """The snapshot after a request, once the generated-token counter holds its ``generated`` tokens."""
    deadline = time.monotonic() + wait
    while True:
        after = _snapshot(url)
        grown = after.generation_tokens - before.generation_tokens
        if grown == generated:
            return after
        if grown > generated:
            raise UserError(f"{url} generated {grown} tokens while one request of {generated} ran: other requests "
                            "reach this server; compare needs it to itself while it measures")
        if time.monotonic() > deadline:
            raise UserError(f"{url}/metrics did not count the request's {generated} tokens within {wait:.0f} s")
        time.sleep(0.05)


def _complete(url: str, model: str, ids: list[int], max_new_tokens: int, timeout: float) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
    return request_json(url.rstrip("/").removesuffix("/v1") + "/v1/completions", "compare", timeout=timeout,
                        body=body)
