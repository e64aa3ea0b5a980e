"""``regenerate``: rewrite the assistant turns of a chat dataset with the verifier's own answers.

A draft learns to predict the verifier, so it accepts far more often when it is trained on text the
verifier itself wrote. This stage keeps every system and user turn of each conversation and replaces
each assistant turn (or adds the missing final one, for prompt-only records) with the verifier's
answer, generated either in-process with ``transformers`` (batched, left padding) or by any
OpenAI-compatible server (``--endpoint``, e.g. a running ``vllm serve``).

Multi-turn records: assistant turn *k* is generated from the conversation up to it with turns
1..k-1 already regenerated, so every answer is conditioned on history the verifier could itself
have produced (the original assistant answers are never shown to the verifier). Records that end
with a user turn get one more assistant turn; records with no user turn at all are dropped.

Resumable: finished records are appended to ``OUT/partial.jsonl`` with their record id; a rerun
with the same settings skips them. The final ``OUT/chats.jsonl`` (OpenAI ``messages`` form, input
order, what ``prepare`` reads) and ``OUT/summary.json`` are written atomically at the end.

    tiny-speculators regenerate --verifier smollm2-135m --data prompts.jsonl --out runs/regen \\
        --max-new-tokens 64 --max-records 8
    tiny-speculators regenerate --verifier Qwen/Qwen3-8B --data chats.jsonl --out runs/regen \\
        --endpoint http://localhost:8000 --batch-size 64
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_speculators.atomic import write_text_atomic
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["Conversation", "chat_completions_url", "read_conversations", "regenerate"]

OUTPUT_FILE = "chats.jsonl"
PARTIAL_FILE = "partial.jsonl"
SETTINGS_FILE = "partial.settings.json"


@dataclass
class Conversation:
    """One input record: where it came from and its messages (OpenAI form)."""

    source: str  # where the reader found it: ``file:line`` (JSONL) or ``file#record``
    index: int  # position among all records read
    messages: list[dict[str, str]]
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            blob = json.dumps([Path(self.source).name, self.messages], sort_keys=True, ensure_ascii=False)
            self.id = hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class _Work:
    conv: Conversation
    history: list[dict[str, str]] = field(default_factory=list)  # regenerated so far
    pending: list[dict[str, str]] = field(default_factory=list)  # original turns not yet consumed
    truncated: int = 0
    tokens: int = 0
    turns: int = 0
    failed: str | None = None


# --------------------------------------------------------------------------------------------- input
def read_conversations(paths: Iterable[Path], strict: bool = False) -> tuple[list[Conversation], Counter]:
    """Read chat records (OpenAI or ShareGPT form) with ``prepare``'s readers and bad-input rules.

    Returns the good conversations and a counter of dropped records by reason. With ``strict`` the
    first bad record raises :class:`UserError`.
    """
    from tiny_speculators.data.readers import read_records

    convs: list[Conversation] = []
    dropped: Counter = Counter()
    for index, record in enumerate(read_records(paths)):
        if record.error is not None:
            if strict:
                raise UserError(f"{record.where}: {record.error} (--strict stops at the first bad record)")
            dropped[record.error.reason] += 1
            log.warning("%s: %s", record.where, record.error)
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in record.messages or []]
        convs.append(Conversation(source=record.where, index=index, messages=messages))
    return convs, dropped


def _prepare_work(conv: Conversation) -> _Work | str:
    """Set up a conversation for generation, or name the reason it cannot be used."""
    msgs = conv.messages
    if not any(m["role"] == "user" for m in msgs):
        return "no_user_turn"
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    # assistant turns before the first user turn have no prompt to regenerate them from: drop them
    pending = [dict(m) for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
    return _Work(conv=conv, pending=pending)


def _advance(work: _Work) -> bool:
    """Drop the original answer(s) now replaced, move the next turns into the history; True if a turn is due."""
    while work.pending and work.pending[0]["role"] == "assistant":
        work.pending.pop(0)  # the original answer is replaced, never shown to the verifier
    while work.pending and work.pending[0]["role"] != "assistant":
        work.history.append(work.pending.pop(0))
    return bool(work.history) and work.history[-1]["role"] != "assistant"


# ---------------------------------------------------------------------------------------- backends
Generate = Callable[[list[list[dict[str, str]]]], list[tuple[str, int, bool]]]


class _HFGenerator:
    """Batched in-process generation; returns (text, new tokens, truncated) per conversation."""

    def __init__(self, verifier: str, dtype: str, device: str, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, enable_thinking: bool | None, trust_remote_code: bool):
        import torch

        from tiny_speculators.verifier.load import load_verifier

        self.torch = torch
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
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.calls = 0
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 **self.template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def __call__(self, batch: list[list[dict[str, str]]]) -> list[tuple[str, int, bool]]:
        torch = self.torch
        rows = [self._render(m) for m in batch]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)  # (B, T)
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        sample = self.temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=sample, pad_token_id=pad,
                                      eos_token_id=self.eos)
        if sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=0)
            torch.manual_seed(self.seed + self.calls)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        self.calls += 1
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
        results = []
        for row in out[:, width:].tolist():
            n, ended = len(row), False
            for j, t in enumerate(row):
                if t in self.eos:
                    n, ended = j, True
                    break
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True).strip()
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


class _EndpointGenerator:
    """Requests to an OpenAI-compatible ``/v1/chat/completions``, ``concurrency`` at a time."""

    def __init__(self, endpoint: str, model: str, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, enable_thinking: bool | None, concurrency: int, timeout: float, retries: int = 3):
        self.url = chat_completions_url(endpoint)
        self.model = model
        self.body: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                     "seed": seed}
        if enable_thinking is not None:
            self.body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.api_key = os.environ.get("OPENAI_API_KEY")

    def one(self, messages: list[dict[str, str]]) -> tuple[str, int, bool]:
        body = json.dumps({"model": self.model, "messages": messages, **self.body}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    reply = json.loads(response.read().decode("utf-8"))
                break
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:300]
                if e.code < 500 or attempt == self.retries:
                    raise UserError(f"endpoint {self.url} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
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
        return text.strip(), tokens, choice.get("finish_reason") == "length"

    def __call__(self, batch: list[list[dict[str, str]]]) -> list[tuple[str, int, bool]]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(batch)))) as pool:
            return list(pool.map(self.one, batch))


# -------------------------------------------------------------------------------------------- stage
def _load_partial(out: Path, settings: dict[str, Any], resume: bool) -> dict[str, dict[str, Any]]:
    partial, settings_file = out / PARTIAL_FILE, out / SETTINGS_FILE
    if resume and partial.is_file() and settings_file.is_file():
        if json.loads(settings_file.read_text(encoding="utf-8")) == settings:
            done: dict[str, dict[str, Any]] = {}
            raw = partial.read_bytes()
            if raw and not raw.endswith(b"\n"):  # a torn last line from an interrupted run: cut it off
                with partial.open("r+b") as f:
                    f.truncate(raw.rfind(b"\n") + 1)
            with partial.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        done[rec["id"]] = rec
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue
            log.info("resuming: %d records already regenerated in %s", len(done), partial)
            return done
        log.warning("generation settings changed since %s was written: starting over", partial)
    partial.unlink(missing_ok=True)
    write_text_atomic(settings_file, json.dumps(settings, indent=2, sort_keys=True))
    return {}


def regenerate(
    verifier: str,
    data: list[Path],
    out: Path,
    endpoint: str | None = None,
    model_name: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    max_records: int | None = None,
    enable_thinking: bool | None = None,
    strict: bool = False,
    resume: bool = True,
    dtype: str = "float32",
    device: str = "cpu",
    timeout: float = 300.0,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Replace every assistant turn of a chat dataset with the verifier's own answer.

    Args:
        verifier: The verifier: a Hugging Face id, a local folder, or ``smollm2-135m``.
        data: Chat files (JSON, JSONL, Parquet, or a ``datasets`` folder) in OpenAI or ShareGPT form;
            records may be prompts only.
        out: Output folder: ``chats.jsonl`` (OpenAI messages form) and ``summary.json``.
        endpoint: Base URL of an OpenAI-compatible server (e.g. ``http://localhost:8000``); generate
            there instead of loading the verifier in this process.
        model_name: Model name sent to the endpoint (default: the verifier's hub id).
        max_new_tokens: Longest answer per assistant turn, in tokens.
        temperature: 0 means greedy; above 0 samples with this temperature.
        top_p: Nucleus sampling threshold when sampling.
        seed: Random seed for sampling.
        batch_size: Conversations generated together (in-process) or requests in flight (endpoint).
        max_records: Use only the first N good records.
        enable_thinking: Passed to chat templates that support it (Qwen3); unset leaves the default.
        strict: Fail on the first bad record instead of dropping it.
        resume: Skip records already finished by an earlier run with the same settings.
        dtype: Verifier weights dtype for in-process generation (float32, bfloat16, float16).
        device: Device for in-process generation.
        timeout: Seconds to wait for one endpoint answer.
        trust_remote_code: Allow the verifier's own code from the hub (off by default).
    """
    t0 = time.perf_counter()
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    if batch_size < 1:
        raise UserError("batch_size must be at least 1")
    from tiny_speculators.verifier.load import verifier_id

    convs, dropped = read_conversations(data, strict=strict)
    records_read = len(convs) + sum(dropped.values())
    if max_records is not None:
        convs = convs[:max_records]
    works: list[_Work] = []
    for conv in convs:
        w = _prepare_work(conv)
        if isinstance(w, str):
            if strict:
                raise UserError(f"{conv.source}: the record has no user turn (--strict stops at the first bad record)")
            dropped[w] += 1
            log.warning("%s: %s: nothing to answer", conv.source, w)
        else:
            works.append(w)
    if not works:
        raise UserError(f"no usable chat records in {', '.join(map(str, data))}")

    out.mkdir(parents=True, exist_ok=True)
    backend = "endpoint" if endpoint else "transformers"
    model = model_name or verifier_id(verifier)
    settings = {"verifier": verifier_id(verifier), "backend": backend, "model": model if endpoint else None,
                "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p if temperature > 0 else None, "seed": seed if temperature > 0 else None,
                "enable_thinking": enable_thinking, "dtype": dtype if not endpoint else None}
    done = _load_partial(out, settings, resume)
    todo = [w for w in works if w.conv.id not in done]
    log.info("%d records to regenerate (%d already done), backend %s", len(todo), len(works) - len(todo), backend)

    generated_tokens = truncated = turns = 0
    gen_seconds = 0.0
    if todo:
        if endpoint:
            gen: Any = _EndpointGenerator(endpoint, model, max_new_tokens, temperature, top_p, seed,
                                          enable_thinking, batch_size, timeout)
        else:
            gen = _HFGenerator(verifier, dtype, device, max_new_tokens, temperature, top_p, seed,
                               enable_thinking, trust_remote_code)
        for w in todo:
            _advance(w)  # every record now has its first prompt (it has a user turn)
        # Multi-turn records together (their later turns then still run as full batches, not as a few
        # stragglers per batch), and similar lengths together (less padding).
        todo.sort(key=lambda w: (sum(m["role"] == "user" for m in w.conv.messages),
                                 sum(len(m["content"]) for m in w.history)))
        g0 = time.perf_counter()
        with (out / PARTIAL_FILE).open("a", encoding="utf-8") as partial:
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                active = list(batch)
                while active:
                    results = gen([w.history for w in active])
                    for w, (text, n, cut) in zip(active, results, strict=True):
                        if not text:
                            w.failed = "empty_answer"
                        w.history.append({"role": "assistant", "content": text})
                        w.tokens += n
                        w.truncated += int(cut)
                        w.turns += 1
                    active = [w for w in active if not w.failed and _advance(w)]
                for w in batch:
                    rec = {"id": w.conv.id, "source": w.conv.source, "index": w.conv.index,
                           "messages": w.history, "truncated_turns": w.truncated, "new_tokens": w.tokens,
                           "failed": w.failed}
                    partial.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    done[w.conv.id] = rec
                    generated_tokens += w.tokens
                    truncated += w.truncated
                    turns += w.turns
                partial.flush()
                log.info("regenerated %d/%d records (%.1f new tokens/s)", min(start + batch_size, len(todo)),
                         len(todo), generated_tokens / max(time.perf_counter() - g0, 1e-9))
        gen_seconds = time.perf_counter() - g0

    lines, kept = [], 0
    for w in works:
        rec = done[w.conv.id]
        if rec.get("failed"):
            dropped[rec["failed"]] += 1
            continue
        lines.append(json.dumps({"id": rec["id"], "messages": rec["messages"]}, ensure_ascii=False))
        kept += 1
    if not lines:
        raise UserError("the verifier produced no usable answer for any record")
    write_text_atomic(out / OUTPUT_FILE, "\n".join(lines) + "\n")
    summary = {
        "verifier": str(verifier), "verifier_id": verifier_id(verifier), "backend": backend,
        "endpoint": chat_completions_url(endpoint) if endpoint else None, "output": OUTPUT_FILE,
        "records_read": records_read, "kept": kept, "dropped": dict(sorted(dropped.items())),
        "resumed_records": len(works) - len(todo), "assistant_turns_generated": turns,
        "new_tokens": generated_tokens, "truncated_turns": truncated,
        "generation_seconds": round(gen_seconds, 3),
        "new_tokens_per_second": round(generated_tokens / gen_seconds, 2) if gen_seconds else None,
        "seconds": round(time.perf_counter() - t0, 3), **{k: v for k, v in settings.items() if k != "verifier"},
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    log.info("regenerate: %d records kept, %d dropped, %d new tokens in %.1f s", kept, sum(dropped.values()),
             generated_tokens, gen_seconds)
    return summary
