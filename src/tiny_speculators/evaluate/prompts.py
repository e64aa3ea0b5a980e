"""Evaluation prompts: built-in held-out sets (chat, code, math; and user) and user JSONL files.

``user`` is a second held-out set, written by hand the way people type into a chat box (casual, lower case, typos,
pasted errors): no public prompt set ships on PyPI to take one from. It is not part of ``builtin`` (whose numbers
earlier runs report); name it to use it (``--prompts user``, ``--prompts builtin,user``).

A JSONL line is ``{"prompt": "..."}`` (one user turn) or ``{"messages": [{"role": ..., "content": ...}, ...]}``
(ending with a user turn), optionally with an ``"id"``. Prompts are rendered with the verifier's chat template
and ``add_generation_prompt=True``. For a vision-language verifier, user turns may hold images as content parts
(``{"type": "image_url", "image_url": {"url": ...}}`` or ``{"type": "image", "image": PATH}``; a path relative to
the prompt file), rendered and expanded by the verifier's processor (:func:`render_image_prompt`).

    from tiny_speculators.evaluate.prompts import load_prompts
    prompts = load_prompts("builtin", max_prompts=6)   # round-robin over chat, code, math
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from itertools import zip_longest
from pathlib import Path
from typing import Any

from tiny_speculators.errors import UserError

__all__ = ["BUILTIN_SETS", "EXTRA_SETS", "Prompt", "load_prompts", "render_image_prompt", "render_prompt"]

log = logging.getLogger(__name__)

BUILTIN_SETS = ("chat", "code", "math")  # what "builtin" interleaves
EXTRA_SETS = ("user",)  # held out too, by name only


@dataclass
class Prompt:
    id: str
    messages: list[dict[str, Any]]
    base: Path | None = None  # the prompt file's folder: where relative image paths resolve

    @property
    def images(self) -> list[str]:
        from tiny_speculators.data.layouts import image_refs

        return image_refs(self.messages)


def _parse_line(line: str, where: str, default_id: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where} must be a JSON object with 'prompt' or 'messages'")
    if isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
    elif isinstance(record.get("messages"), list) and record["messages"]:
        messages = record["messages"]
        if any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
            messages = _with_parts(messages, where)
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
                   for m in messages):
            raise UserError(f"{where}: every message needs string 'role' and 'content'")
        if messages[-1]["role"] == "assistant":
            raise UserError(f"{where}: the last message is an assistant turn; a prompt must end with a user turn")
    else:
        raise UserError(f"{where} has neither a 'prompt' string nor a non-empty 'messages' list")
    return Prompt(id=str(record.get("id", default_id)), messages=messages)


def _with_parts(messages: list[Any], where: str) -> list[dict[str, Any]]:
    """Messages whose content holds parts (text, images) in the form chat data normalises them to."""
    from tiny_speculators.data.chat import RecordError
    from tiny_speculators.data.layouts import normalize_record

    try:
        return normalize_record({"messages": messages})[0]
    except RecordError as e:
        raise UserError(f"{where}: {e}") from None


def _read_jsonl(text: str, source: str, base: Path | None = None) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompt = _parse_line(line, f"{source} line {n}", f"{Path(source).stem}-{n}")
            prompt.base = base
            prompts.append(prompt)
    if not prompts:
        raise UserError(f"{source} holds no prompts")
    return prompts


def _builtin(name: str) -> list[Prompt]:
    text = (resources.files("tiny_speculators") / "resources" / "eval_prompts" / f"{name}.jsonl").read_text("utf-8")
    return _read_jsonl(text, f"{name}.jsonl")


def load_prompts(spec: str, max_prompts: int | None = None) -> list[Prompt]:
    """``spec``: "builtin" (the chat, code and math sets, interleaved), a set name ("chat", "code", "math", "user";
    several joined by commas, "builtin" among them), or the path of a JSONL file."""
    path = Path(spec).expanduser()
    if path.is_file():
        prompts = _read_jsonl(path.read_text("utf-8"), str(path), path.resolve().parent)
    else:
        given = [s.strip() for s in spec.split(",")]
        names = [n for g in given for n in (BUILTIN_SETS if g in ("builtin", "all") else (g,))]
        unknown = [n for n in names if n not in BUILTIN_SETS + EXTRA_SETS]
        if unknown:
            raise UserError(f"prompts {spec!r} is neither a file nor a built-in set "
                            f"(builtin, {', '.join(BUILTIN_SETS + EXTRA_SETS)})")
        sets = [_builtin(n) for n in names]
        prompts = [p for group in zip_longest(*sets) for p in group if p is not None]
    if max_prompts is not None:
        if max_prompts < 1:
            raise UserError(f"max_prompts must be at least 1, not {max_prompts}")
        prompts = prompts[:max_prompts]
    return prompts


def render_image_prompt(prompt: Prompt, vision) -> tuple[list[int], dict[str, Any]]:
    """A prompt with images for a vision-language verifier: its token ids (the processor's template, each image
    token repeated as the processor repeats it) and the image inputs (``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids``)."""
    import torch

    from tiny_speculators.verifier.vision import ImageError, load_image

    try:
        pictures = [load_image(ref, prompt.base) for ref in prompt.images]
    except ImageError as e:
        raise UserError(f"prompt {prompt.id}: {e}") from None
    processor = vision.processor
    text = processor.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        ids, _, _ = vision.expand(text, ids, [0] * len(ids), pictures)
    except ImageError as e:
        raise UserError(f"prompt {prompt.id}: {e}") from None
    inputs = vision.pixels(pictures)
    inputs["mm_token_type_ids"] = (torch.tensor([ids]) == vision.image_token_id).to(torch.int32)
    return ids, inputs


def render_prompt(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids of ``prompt`` under the verifier's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    log.warning("the verifier's tokenizer has no chat template: prompt %s is encoded as plain text", prompt.id)
    return tokenizer("\n".join(m["content"] for m in prompt.messages))["input_ids"]
