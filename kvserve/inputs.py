"""Checks of text and chat-message inputs that the offline API and the server
share: what a message's content may be, and text that is not valid Unicode.
Each check returns what is wrong (a message that names the place after its
caller's path), or None."""
from __future__ import annotations

import re
from typing import Any

LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_error(text: str) -> str | None:
    """JSON's "\\ud800" escape parses to a lone UTF-16 surrogate, which UTF-8
    cannot encode: the tokenizer, the chat template or xgrammar would fail on it."""
    found = LONE_SURROGATE.search(text)
    return f" holds a lone surrogate (U+{ord(found.group()):04X}): not valid Unicode" if found else None


def content_error(message: dict[str, Any]) -> str | None:
    """What is wrong with a message's content. Only an assistant turn that calls
    tools may leave it null, as OpenAI rules; content parts are text only."""
    content, role = message.get("content"), message.get("role")
    if content is None:
        if role == "assistant":
            return None if message.get("tool_calls") else ".content is required unless the message has tool_calls"
        return f".content is required for role {role!r}"
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return f".content must be a string or a non-empty list of text parts, got {content!r:.40}"
    return next(filter(None, map(_part_error, range(len(content)), content)), None)


def _part_error(j: int, part: Any) -> str | None:
    """What is wrong with content part j."""
    if not isinstance(part, dict):
        return f".content[{j}] must be an object with a type, got {part!r:.40}"
    if part.get("type") != "text":
        return f".content[{j}]: parts of type {part.get('type')!r} are not supported (text only)"
    return None if isinstance(part.get("text"), str) else f".content[{j}]: a text part needs a string `text`"


def flat_content(content: str | list[dict[str, Any]] | None) -> str:
    """The text a chat template sees: text parts joined; null (a tool-calling turn) as ""."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages checked (content, Unicode) and with their content as the chat
    template reads it; raises ValueError naming the message and the place."""
    out = []
    for i, message in enumerate(messages):
        error = content_error(message)
        text = "" if error else flat_content(message.get("content"))
        if error is None and (bad := surrogate_error(text)):
            error = ".content" + bad
        if error:
            raise ValueError(f"messages[{i}]{error}")
        out.append({**message, "content": text})
    return out
