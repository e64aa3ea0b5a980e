"""Online training from a pool of vLLM producers: hidden states arrive through the Mooncake store, not this process.

For each sample of a micro-batch the rank asks one producer (``POST /v1/completions`` with the token ids and one new
token); the producer's forward pass puts the sample's hidden states into the Mooncake store and its answer's
``kv_transfer_params`` say where; the rank fetches them (``get_into`` over TCP or RDMA) and deletes them. The batch
equals :class:`~tiny_speculators.train.sources.OnlineSource`'s (aux = the inputs of the aux layers, last = the
last layer's output before the final norm), so the loop cannot tell the sources apart.

Requests are spread round-robin over the producers (each rank starts at its own); a producer that fails (refused,
reset, an error answer, a sample lost in the store) or is slow (no answer within a third of ``timeout``) is set
aside for a growing pause and the sample is asked of the next one. (A slow producer may still finish the abandoned
request: its sample then waits in the store until Mooncake's eviction reclaims it.) The data plan stays the
trainer's own, so every planned sample is trained on exactly once per epoch whichever producer answers, however
often it is retried. A sample that no producer delivers within ``timeout`` seconds stops the run with a one-line
error. Each delivered sample is logged (``samples_rank*.jsonl``).

    torchrun --nproc-per-node 2 -m tiny_speculators.cli train --verifier smollm2-135m --data runs/prepared \
        --online --producer vllm --producers 1 --vocab runs/vocab --out runs/draft
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiny_speculators.errors import UserError
from tiny_speculators.producers import (
    TRAINER_BUFFER_BYTES,
    MooncakeMaster,
    check_master,
    import_mooncake_store,
    local_hostname,
    producer_server,
    store_config,
)
from tiny_speculators.serving import build_vllm_env, enter_on_ports
from tiny_speculators.train import distributed as D
from tiny_speculators.train.data import collate
from tiny_speculators.train.sources import PreparedTokens, to_device

log = logging.getLogger(__name__)

MAX_PAUSE = 10.0  # seconds a failing producer is set aside at most before it is asked again
ATTEMPTS = 3  # a request may take a third of --producer-timeout before the sample is asked of another producer


@dataclass(frozen=True)
class Delivery:
    """One sample's hidden states ``(T, n_layers, H)`` and how they came."""

    hidden_states: torch.Tensor
    producer: str
    attempts: int
    failed: tuple[str, ...]  # the producers asked before, in order
    errors: tuple[str, ...]  # what each of them did wrong
    seconds: float  # from the first request to the sample in hand
    store_seconds: float  # of which the transfer out of the Mooncake store (wait, get, delete)


class ProducerPool:
    """The producers' HTTP endpoints and this rank's Mooncake store client."""

    def __init__(self, urls: list[str], master: str, *, n_layers: int, hidden_size: int, timeout: float,
                 rank: int = 0, threads: int = 4) -> None:
        if not urls:
            raise UserError("--producer vllm needs at least one producer (--producer-urls or --producers)")
        if not timeout > 0:
            raise UserError(f"--producer-timeout must be above 0 seconds, got {timeout}")
        import_mooncake_store()
        check_master(master)
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

        # this rank lends no store memory: a sample waits in a producer's segment (the master picks which) until fetched
        config = store_config(master, local_hostname(), 0, TRAINER_BUFFER_BYTES)
        self.store = MooncakeHiddenStatesStore(MooncakeStoreConfig(**config))
        try:
            self.store.setup()
        except RuntimeError as e:
            raise UserError(f"cannot join the Mooncake store of the master at {master} ({e})") from None
        self.urls = [u.rstrip("/") for u in urls]
        self.master = master
        self.n_layers, self.hidden_size, self.timeout = n_layers, hidden_size, timeout
        self._next = rank % len(self.urls)
        self._failures = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="producer-fetch")

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def fetch(self, samples: list[list[int]]) -> list[Delivery]:
        """The hidden states of each token-id list, in order (fetched concurrently)."""
        return list(self._threads.map(self.fetch_one, samples))

    def _pick(self) -> tuple[str, float]:
        """The next producer in rotation that is not set aside, or the one back soonest and its wait."""
        with self._lock:
            now = time.monotonic()
            for k in range(len(self.urls)):
                url = self.urls[(self._next + k) % len(self.urls)]
                if self._down_until[url] <= now:
                    self._next = (self._next + k + 1) % len(self.urls)
                    return url, 0.0
            url = min(self.urls, key=self._down_until.__getitem__)
            return url, self._down_until[url] - now

    def _mark(self, url: str, ok: bool) -> None:
        with self._lock:
            self._failures[url] = 0 if ok else self._failures[url] + 1
            if not ok:
                pause = min(MAX_PAUSE, 0.5 * 2 ** (self._failures[url] - 1))
                self._down_until[url] = time.monotonic() + pause

    def fetch_one(self, ids: list[int]) -> Delivery:
        start = time.monotonic()
        failed: list[str] = []
        errors: list[str] = []
        while True:
            remaining = self.timeout - (time.monotonic() - start)
            if remaining <= 0:
                raise UserError(f"no vLLM producer delivered a sample of {len(ids)} tokens within {self.timeout:g} s "
                                f"(--producer-timeout); producers {', '.join(self.urls)}, master {self.master}; "
                                f"last error: {(errors or ['no answer'])[-1]}")
            url, wait = self._pick()
            if wait > 0:
                time.sleep(min(wait, remaining))
                continue
            try:  # a third of the budget per try: a slow producer leaves time to ask others
                hidden, store_seconds = self._ask(url, ids, min(remaining, self.timeout / ATTEMPTS))
            except (OSError, http.client.HTTPException, RuntimeError, ValueError, KeyError) as e:
                # refused, reset, timed out, cut off mid-answer (IncompleteRead, BadStatusLine), lost, 5xx
                errors.append(f"{url}: {_reason(e)}")
                log.warning("producer %s failed (%s); asking another", url, _reason(e))
                failed.append(url)
                self._mark(url, ok=False)
                continue
            self._mark(url, ok=True)
            return Delivery(hidden, url, len(failed) + 1, tuple(failed), tuple(errors), time.monotonic() - start,
                            store_seconds)

    def _ask(self, url: str, ids: list[int], timeout: float) -> tuple[torch.Tensor, float]:
        """The sample's hidden states from ``url`` and the seconds their transfer out of the store took."""
        body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0.0}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            if 400 <= e.code < 500:  # the request itself is wrong (too long for the producer, ...): no retry helps
                raise UserError(f"producer {url} rejected a sample of {len(ids)} tokens (HTTP {e.code}: "
                                f"{_message(detail)})") from None
            raise RuntimeError(f"HTTP {e.code}: {_message(detail)}") from None
        manifest = answer.get("kv_transfer_params")
        if not manifest or "handle" not in manifest:
            raise UserError(f"producer {url} answered without hidden states (no kv_transfer_params): start it with "
                            "the extract_hidden_states method and the Mooncake connector (see tiny_speculators."
                            "producers.producer_server)")
        t0 = time.monotonic()
        try:
            sample = self.store.get_sample(manifest, timeout=min(timeout, 60.0))
        finally:
            with contextlib.suppress(Exception):  # a sample lost with its producer is gone already
                self.store.delete_sample(manifest["handle"])
        hidden = sample["hidden_states"]  # (T, n_layers, H)
        if sample["token_ids"].tolist() != list(ids):
            raise UserError(f"producer {url} returned the hidden states of other tokens than it was sent")
        if tuple(hidden.shape[1:]) != (self.n_layers, self.hidden_size):
            raise UserError(f"producer {url} extracts {hidden.shape[1]} layers of size {hidden.shape[2]}, this run "
                            f"needs {self.n_layers} of size {self.hidden_size}: start it with this run's layer ids "
                            "and verifier")
        return hidden, time.monotonic() - t0


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _message(detail: str) -> str:
    try:
        return str(json.loads(detail).get("error", {}).get("message", detail))
    except (ValueError, AttributeError):
        return detail


class ProducerSource(PreparedTokens):
    """Token ids from a prepared dataset; vLLM producers compute the hidden states, the Mooncake store brings them.

    ``layer_ids`` are the layers the producers extract (in their order); ``aux_layer_ids`` those the draft reads,
    ``last_layer_id`` (N) the last layer's output (the target head's input)."""

    def __init__(self, prepared: Path, pool: ProducerPool, layer_ids: list[int], aux_layer_ids: list[int],
                 last_layer_id: int, max_length: int | None, sample_log: Path | None = None) -> None:
        super().__init__(prepared, max_length)
        self.pool = pool
        self.aux_layer_ids = list(aux_layer_ids)
        self._aux_slots = [layer_ids.index(i) for i in aux_layer_ids]
        self._last_slot = layer_ids.index(last_layer_id)
        self.sample_log = sample_log
        if sample_log is not None:
            sample_log.parent.mkdir(parents=True, exist_ok=True)

    def batch(self, indices: list[int], device: torch.device, pack: bool) -> dict[str, Any]:
        samples = self.token_samples(indices)
        deliveries = self.pool.fetch([s["input_ids"].tolist() for s in samples])
        for s, d in zip(samples, deliveries, strict=True):
            hs = d.hidden_states  # (T, n_layers, H)
            s["aux_hidden_states"] = hs[:, self._aux_slots].reshape(hs.shape[0], -1)  # (T, n_aux*H)
            s["last_hidden_state"] = hs[:, self._last_slot].contiguous()  # (T, H)
        self._log(indices, deliveries)
        return to_device(collate(samples, pack=pack), device)

    def _log(self, indices: list[int], deliveries: list[Delivery]) -> None:
        if self.sample_log is None:
            return
        with self.sample_log.open("a", encoding="utf-8") as f:
            for i, d in zip(indices, deliveries, strict=True):
                f.write(json.dumps({"sample": int(i), "tokens": int(d.hidden_states.shape[0]), "producer": d.producer,
                                    "attempts": d.attempts, "failed": list(d.failed), "errors": list(d.errors),
                                    "bytes": d.hidden_states.numel() * d.hidden_states.element_size(),
                                    "seconds": round(d.seconds, 4), "store_seconds": round(d.store_seconds, 4)})
                        + "\n")


@contextlib.contextmanager
def producer_endpoints(info: D.DistInfo, *, verifier: str, layer_ids: list[int], urls: list[str] | None,
                       master: str | None, count: int, out: Path, vllm_venv: Path | None, dtype: str,
                       max_model_len: int) -> Iterator[tuple[list[str], str]]:
    """The producers' URLs and the master's address: the given ones, or (rank 0) a master and ``count`` vLLM
    producers started on 127.0.0.1 for the life of the block and always stopped. Every rank gets the same pair."""
    with contextlib.ExitStack() as stack:
        error = None
        if info.is_main:
            try:
                urls, master = _start(stack, verifier=verifier, layer_ids=layer_ids, urls=urls, master=master,
                                      count=count, out=out, vllm_venv=vllm_venv, dtype=dtype,
                                      max_model_len=max_model_len)
            except UserError as e:
                error = str(e)  # every rank raises it (they wait for rank 0 below)
        urls, master, error = D.broadcast_object((urls, master, error), info)
        if error is not None:
            raise UserError(error)
        yield list(urls), master


def _start(stack: contextlib.ExitStack, *, verifier: str, layer_ids: list[int], urls: list[str] | None,
           master: str | None, count: int, out: Path, vllm_venv: Path | None, dtype: str,
           max_model_len: int) -> tuple[list[str], str]:
    if master is None:
        if urls:
            raise UserError("--producer-urls needs --mooncake-master: the master those producers put hidden states "
                            "into")
        master = stack.enter_context(MooncakeMaster(out / "logs" / "mooncake_master.log")).address
    else:
        check_master(master)
    if urls:
        return list(urls), master
    if count < 1:
        raise UserError(f"--producers must be at least 1, got {count}")
    python = build_vllm_env(vllm_venv, log_path=out / "logs" / "vllm_env.log", mooncake=True)
    servers = [producer_server(python, verifier, layer_ids, master, log_path=out / "logs" / f"producer{i}.log",
                               dtype=dtype, max_model_len=max_model_len, name=f"vLLM producer {i}")
               for i in range(count)]
    for server in servers:  # each is stopped on the way out, whatever happens
        stack.callback(server.stop)
    enter_on_ports(servers)  # all start at once; a port taken before binding: another
    return [s.url for s in servers], master
