"""``prepare --redact REGEX...``: what must not enter training data, replaced before the chat is rendered.

Every match of every pattern, in every message's text (``content``, ``reasoning_content``, and the string values of
tool call arguments), becomes ``[REDACTED]``. Patterns are Python regular expressions; a pattern that does not
compile is a one-line error naming it. The count of replacements goes into ``summary.json``.

    redactor = Redactor([r"[\\w.+-]+@[\\w-]+\\.[\\w.]+", r"sk-[A-Za-z0-9]{20,}"])
    messages, replaced = redactor.apply(messages)
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tiny_speculators.errors import UserError

__all__ = ["REDACTED", "Redactor"]

REDACTED = "[REDACTED]"


class Redactor:
    def __init__(self, patterns: list[str] | None) -> None:
        self.patterns = []
        for pattern in patterns or []:
            try:
                self.patterns.append(re.compile(pattern))
            except re.error as e:
                raise UserError(f"--redact {pattern!r} is not a regular expression ({e})") from None

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def apply(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """A copy of ``messages`` with every match replaced, and how many were."""
        if not self.patterns:
            return messages, 0
        out = copy.deepcopy(messages)
        total = 0
        for message in out:
            for key in ("content", "reasoning_content"):
                if isinstance(message.get(key), str):
                    message[key], n = self._text(message[key])
                    total += n
            for part in message["content"] if isinstance(message.get("content"), list) else []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):  # text beside images
                    part["text"], n = self._text(part["text"])
                    total += n
            for call in message.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and "arguments" in function:
                    function["arguments"], n = self._value(function["arguments"])
                    total += n
        return out, total

    def _text(self, text: str) -> tuple[str, int]:
        total = 0
        for pattern in self.patterns:
            text, n = pattern.subn(REDACTED, text)
            total += n
        return text, total

    def _value(self, value: Any) -> tuple[Any, int]:
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, dict):
            total, out = 0, {}
            for k, v in value.items():
                out[k], n = self._value(v)
                total += n
            return out, total
        if isinstance(value, list):
            total, items = 0, []
            for v in value:
                item, n = self._value(v)
                items.append(item)
                total += n
            return items, total
        return value, 0
