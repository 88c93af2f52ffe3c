"""Tool calling: tools into the prompt, tool calls out of the text.

Prompt side: `tools` go to the chat template. A template that does not know
tools (or tool-call history) gets them in the Hermes / Qwen form instead: a
system block listing the functions, assistant tool calls as `<tool_call>` JSON
and tool results as `<tool_response>`, so no turn is dropped from the prompt.

Output side: `tool_choice="auto"` parses Hermes `<tool_call>{...}</tool_call>`
blocks; "required" and a named function are enforced by structured output
(vLLM's shapes: a JSON array of {name, parameters}, or the named function's
arguments object) and parsed from that JSON.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls."""
    choice: str                 # "auto" | "required" | "named"
    name: str | None = None     # the function, for "named"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    functions = "\n".join(json.dumps(t, separators=(",", ":")) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{functions}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: str) -> list[dict[str, Any]]:
    """Rewrite what `template` would drop (tools, tool calls, tool results) in Hermes form."""
    out = [dict(m) for m in messages]
    if "tool_calls" not in template:
        for m in out:
            for call in m.pop("tool_calls", None) or []:
                body = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                m["content"] = f"{m['content']}\n{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}".lstrip("\n")
    if "tool_call_id" not in template and "tool_response" not in template:
        for m in out:
            if m["role"] == "tool":
                m.pop("tool_call_id", None)
                m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    if tools and "tools" not in template:
        block = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """tool_choice="required": a non-empty JSON array of calls to the given tools."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    tool = next(t for t in tools if t["function"]["name"] == name)
    return tool["function"].get("parameters") or {"type": "object"}


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output; no calls -> the text is content."""
    if mode.choice == "named":
        return None, [_call(mode.name, _loads(text, text))]
    if mode.choice == "required":
        calls = _loads(text, [])
        calls = [_call(c.get("name"), c.get("parameters", {})) for c in calls if isinstance(c, dict)] \
            if isinstance(calls, list) else []
        return (None, calls) if calls else (text, [])
    calls = []
    for body in _HERMES.findall(text):
        parsed = _loads(body, None)
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            calls.append(_call(parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))))
    if not calls:
        return text, []
    content = text[:text.find(TOOL_CALL_OPEN)].strip()
    return content or None, calls


def safe_content_prefix(text: str) -> str:
    """The part of streamed `text` that cannot become a tool call (auto mode)."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return text[:at]
    for k in range(len(TOOL_CALL_OPEN) - 1, 0, -1):  # a tag may be half-streamed
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return text[:-k]
    return text


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": str(name), "arguments": args}}


def _loads(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return default
