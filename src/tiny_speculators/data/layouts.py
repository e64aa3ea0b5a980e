"""Turn one chat record, in any common layout, into template-ready messages (and tool definitions).

Detection is per record, so one file may mix layouts:

* the turns live under ``conversations``, ``messages`` or ``conversation`` (first one present), or
  under the key named by ``field`` (``prepare --field``); a JSON string there (a CSV cell, a string
  column in Parquet) is decoded first;
* each turn is ``role``/``content`` (OpenAI, SpecForge, speculators, UltraChat, LMSYS) or
  ``from``/``value`` (ShareGPT, LLaMA-Factory), decided per turn;
* roles: ``system``/``developer``; ``user``/``human``; ``assistant``/``gpt``/``model`` (and
  ``chatgpt``/``bing``/``bard`` of raw ShareGPT dumps); ``tool``/``function``/``observation``/
  ``ipython`` (a tool result); ``function_call`` (LLaMA-Factory: an assistant turn whose value is
  the JSON call ``{"name", "arguments"}`` or a list of them);
* assistant ``tool_calls`` (OpenAI: ``{"id", "type", "function": {"name", "arguments"}}``, arguments
  a JSON string or an object) and the legacy ``function_call`` field become
  ``{"type": "function", "function": {"name", "arguments": <object>}[, "id"]}`` -- the shape
  transformers documents for chat templates (Qwen3, Llama-3.1 and Mistral render it);
* a served request and its response, as services log them: ``{"request": {"messages": [...], "tools": [...]},
  "response": <a chat completion (its ``choices[0].message``), one message, or the answer's text>}``;
* images in user and system turns: OpenAI content parts (``{"type": "image_url", "image_url": {"url": ...}}``, a
  path, ``file://`` or ``data:`` URL) and transformers' ``{"type": "image", "image": PATH}`` become
  ``{"type": "image", "image": REF}`` parts in their order; LLaVA / ShareGPT records list them in ``image`` /
  ``images`` and mark where they go with ``<image>`` in the turns (no marker: before the first user turn's text);
* ``reasoning_content`` (vLLM, DeepSeek API) or ``reasoning`` on assistant turns is kept as
  ``reasoning_content``; a top-level ``tools`` list (or JSON string) is passed to the template; a
  top-level ``system`` string becomes the first message when the turns hold none.

Anything else is a :class:`~tiny_speculators.data.chat.RecordError` naming the turn and the reason.

    from tiny_speculators.data.layouts import normalize_record
    messages, tools = normalize_record({"conversations": [{"from": "human", "value": "hi"},
                                                          {"from": "gpt", "value": "hello"}]})
"""

from __future__ import annotations

import json
import re
from typing import Any

from tiny_speculators.data.chat import RecordError

__all__ = ["ROLES", "TURN_KEYS", "image_refs", "normalize_record"]

TURN_KEYS = ("conversations", "messages", "conversation")
_IMAGE_TYPES = ("image", "image_url")
_IMAGE_MARKER = "<image>"  # LLaVA / ShareGPT: where the record's images go in a turn

# "from" / "role" value (lower case) -> template role; function_call is an assistant tool call
ROLES: dict[str, str] = {
    "system": "system", "developer": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "function_call": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}

_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogates(value: Any) -> bool:
    """True if a decoded string holds bytes that were not UTF-8 (kept as lone surrogates)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _decode_json(value: Any, what: str) -> Any:
    """A JSON string (CSV cell, string column) decoded; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RecordError("invalid JSON", f"{what} is a string but not JSON ({e.msg} at column {e.colno})") from None


def _get(turn: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` whose value is not None (Arrow fills absent struct fields with None)."""
    for key in keys:
        if turn.get(key) is not None:
            return turn[key]
    return None


def _text(value: Any, where: str, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if isinstance(value, list):  # OpenAI content parts: text only
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") in _IMAGE_TYPES:
                raise RecordError("image in an assistant turn", f"{where} has an image: images are read in user "
                                                                "and system turns")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RecordError("non-string content", f"{where} has a content part that is not text")
            texts.append(part["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise RecordError("non-string content", f"{where} content is {type(value).__name__}, not a string")
    if required and not value.strip():
        raise RecordError("empty content", f"{where} content is empty")
    return value


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"type": "image", "image": REF}`` from an OpenAI ``image_url`` part or a transformers ``image`` part."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        ref = url.get("url") if isinstance(url, dict) else url
    else:
        ref = _get(part, "image", "url", "path")
    if not isinstance(ref, str) or not ref.strip():
        raise RecordError("invalid image", f"{where} has an image part without a path or URL")
    return {"type": "image", "image": ref}


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A user or system turn's content: text, or text and image parts in their order when it holds images."""
    if not (isinstance(value, list) and any(isinstance(p, dict) and p.get("type") in _IMAGE_TYPES for p in value)):
        return _text(value, where)  # type: ignore[return-value]
    parts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _IMAGE_TYPES:
            parts.append(_image_part(part, where))
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise RecordError("unsupported content", f"{where} has a {kind or type(part).__name__!r} part: prepare "
                                                     "reads text and image parts")
    return parts


def image_refs(messages: list[dict[str, Any]]) -> list[str]:
    """The image references of normalised ``messages``, in the order the template renders them."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


def _place_images(messages: list[dict[str, Any]], images: list[str]) -> None:
    """LLaVA / ShareGPT: the record's ``image`` / ``images`` go where the user turns say ``<image>``, or before the
    first user turn's text when none does."""
    markers = sum(m["content"].count(_IMAGE_MARKER) for m in messages
                  if m["role"] in ("user", "system") and isinstance(m["content"], str))
    if markers == 0:
        first = next((m for m in messages if m["role"] == "user" and isinstance(m["content"], str)), None)
        if first is None:
            raise RecordError("image mismatch", "the record has images but no user turn to hold them")
        first["content"] = _IMAGE_MARKER * len(images) + first["content"]
        markers = len(images)
    if markers != len(images):
        raise RecordError("image mismatch", f"{markers} {_IMAGE_MARKER} markers in the turns for {len(images)} "
                                            "images")
    queue = list(images)
    for m in messages:
        if m["role"] not in ("user", "system") or not isinstance(m["content"], str) \
                or _IMAGE_MARKER not in m["content"]:
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(m["content"].split(_IMAGE_MARKER)):
            if i:
                parts.append({"type": "image", "image": queue.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        m["content"] = parts


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    call = _decode_json(call, f"{where} tool call")
    if not isinstance(call, dict):
        raise RecordError("invalid tool call", f"{where} has a tool call that is not an object")
    function = call["function"] if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RecordError("invalid tool call", f"{where} has a tool call without a function name")
    arguments = _get(function, "arguments", "parameters")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise RecordError("invalid tool call", f"{where} calls {name} with arguments that are not JSON") from None
    if not isinstance(arguments, dict):
        raise RecordError("invalid tool call", f"{where} calls {name} with arguments that are not a JSON object")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _tool_calls(turn: dict[str, Any], role_value: str, content: Any, where: str) -> list[dict[str, Any]]:
    if role_value == "function_call":  # LLaMA-Factory: the value is the call itself
        calls = _decode_json(content, f"{where} value")
        calls = calls if isinstance(calls, list) else [calls]
    else:
        calls = _decode_json(_get(turn, "tool_calls"), f"{where} tool_calls")
        if calls is None and turn.get("function_call") is not None:  # legacy OpenAI field
            calls = [turn["function_call"]]
        if calls is None:
            return []
        if not isinstance(calls, list):
            raise RecordError("invalid tool call", f"{where} tool_calls must be a list")
    return [_tool_call(c, where) for c in calls]


def _message(turn: Any, where: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise RecordError("invalid record", f"{where} must be an object, not {type(turn).__name__}")
    role_value = _get(turn, "role", "from")
    if role_value is None:
        raise RecordError("missing field", f"{where} has no 'role' (or 'from')")
    if not isinstance(role_value, str) or role_value.lower() not in ROLES:
        raise RecordError("unknown role", f"{where} has role {role_value!r}")
    role_value = role_value.lower()
    role = ROLES[role_value]
    has_content = any(turn.get(k) is not None for k in ("content", "value"))
    content = _get(turn, "content", "value")
    if role == "tool":
        parts = isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
        if isinstance(content, (dict, list)) and not parts:
            content = json.dumps(content, ensure_ascii=False)  # a structured tool result, as JSON text
        if content is None:
            raise RecordError("missing field", f"{where} has no 'content' (or 'value')")
        message: dict[str, Any] = {"role": "tool", "content": _text(content, where, required=False)}
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str):
                message[key] = turn[key]
        return message
    if role != "assistant":
        if not has_content:
            raise RecordError("missing field", f"{where} has no 'content' (or 'value')")
        return {"role": role, "content": _content(content, where)}
    calls = _tool_calls(turn, role_value, content, where)
    if role_value == "function_call":
        content = None
    if not calls and not has_content:
        raise RecordError("missing field", f"{where} has no 'content' (or 'value')")
    message = {"role": "assistant", "content": _text(content, where, required=not calls)}
    if calls:
        message["tool_calls"] = calls
    reasoning = _get(turn, "reasoning_content", "reasoning")
    if isinstance(reasoning, str) and reasoning.strip():
        message["reasoning_content"] = reasoning
    return message


def _record_images(record: dict[str, Any]) -> list[str]:
    """LLaVA / ShareGPT's record-level ``images`` (a list, or a JSON string of one) or ``image`` (one path)."""
    images = record.get("images") if record.get("images") is not None else record.get("image")
    if isinstance(images, str) and images.lstrip().startswith("["):
        images = _decode_json(images, "'images'")
    if images is None or images == "" or images == []:
        return []
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(i, str) and i.strip() for i in images):
        raise RecordError("invalid image", "'image(s)' must be a path or a list of paths")
    return images


def _tools(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = record.get("tools")
    if isinstance(tools, str) and not tools.strip():
        return None
    tools = _decode_json(tools, "'tools'")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError("invalid tools", "'tools' must be a list of tool definitions (objects)")
    return tools


def normalize_record(record: Any, field: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` from a chat record in any layout above, or a ``RecordError``."""
    if not isinstance(record, dict):
        raise RecordError("invalid record", f"a record must be a JSON object, not {type(record).__name__}")
    if _has_surrogates(record):
        raise RecordError("not UTF-8", "the record contains bytes that are not valid UTF-8")
    keys = (field,) if field else TURN_KEYS
    key = next((k for k in keys if record.get(k) is not None), None)
    if key is None and not field and record.get("request") is not None and record.get("response") is not None:
        return normalize_record(_request_response(record))
    if key is None:
        wanted = f"no '{field}' (--field)" if field else "none of " + ", ".join(f"'{k}'" for k in TURN_KEYS)
        raise RecordError("missing field", f"the record has {wanted}")
    turns = _decode_json(record[key], f"'{key}'")
    if not isinstance(turns, list):
        raise RecordError("invalid record", f"'{key}' must be a list, not {type(turns).__name__}")
    messages = [_message(turn, f"{key}[{i}]") for i, turn in enumerate(turns)]
    images = _record_images(record)
    if images:
        if image_refs(messages):
            raise RecordError("image mismatch", "the record has both image parts in its turns and 'image(s)'")
        _place_images(messages, images)
    system = record.get("system")
    if isinstance(system, str) and system.strip() and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages, _tools(record)


def _request_response(record: dict[str, Any]) -> dict[str, Any]:
    """A served request and its response (an OpenAI chat request; a chat completion, one message or the text) as
    one record: the request's messages, then the response's message; the request's tools."""
    request = _decode_json(record["request"], "'request'")
    response = record["response"]
    if isinstance(response, str) and response.lstrip().startswith("{"):  # a JSON string column; else the text
        response = _decode_json(response, "'response'")
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise RecordError("invalid record", "'request' must be an OpenAI chat request with a 'messages' list")
    message: Any = None
    if isinstance(response, dict) and isinstance(response.get("choices"), list) and response["choices"]:
        choice = response["choices"][0]
        message = choice.get("message") if isinstance(choice, dict) else None
    elif isinstance(response, dict) and ("content" in response or "tool_calls" in response):
        message = response
    elif isinstance(response, str):
        message = {"role": "assistant", "content": response}
    if not isinstance(message, dict):
        raise RecordError("invalid record", "'response' must be a chat completion (choices[0].message), a message "
                                            "or the answer's text")
    return {"messages": [*request["messages"], {**message, "role": message.get("role") or "assistant"}],
            "tools": request.get("tools")}
