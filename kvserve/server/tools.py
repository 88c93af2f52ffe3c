"""Tool calling: tools into the prompt, tool calls out of the text.

Prompt side: `tools` go to the chat template. A template that does not know
tools (or tool-call history) gets them in the Hermes / Qwen form instead: a
system block listing the functions, assistant tool calls as `<tool_call>` JSON
and tool results as `<tool_response>`, so no turn is dropped from the prompt.

Output side: `tool_choice="auto"` parses the model's own form, chosen by the
server's `--tool-call-parser` (vLLM's names):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
               after any content (Hermes, Qwen);
  llama3_json  a reply that is nothing but `{"name": ..., "parameters": {...}}`
               objects separated by `;`, optionally after `<|python_tag|>`
               (Llama 3.1 / 3.2 chat templates); any other reply is content.
A reply that does not parse is content, whole. While streaming, content that
could still become a call is held back; the calls go out whole at the end.
"required" and a named function are enforced by structured output (vLLM's
shapes: a JSON array of {name, parameters}, or the named function's arguments
object) and parsed from that JSON, whatever the parser.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
_CALL_SEPARATOR = re.compile(r"\s*(;\s*)?")


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls."""
    choice: str                 # "auto" | "required" | "named"
    name: str | None = None     # the function, for "named"
    parser: str = "hermes"      # the auto form: a key of TOOL_CALL_PARSERS


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
    if not _knows_tool_results(template):
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
    return TOOL_CALL_PARSERS[mode.parser].parse(text)


def safe_content_prefix(text: str, mode: ToolMode) -> str:
    """The part of streamed `text` that cannot become a tool call (auto mode)."""
    return TOOL_CALL_PARSERS[mode.parser].safe_content_prefix(text)


def check_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(sorted(TOOL_CALL_PARSERS))}, got {name!r}")
    return name


class HermesParser:
    """`<tool_call>` JSON blocks; the text before the first is content."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls = []
        for body in _HERMES.findall(text):
            parsed = _loads(body, None)
            if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
                calls.append(_call(parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))))
        if not calls:
            return text, []
        content = text[:text.find(TOOL_CALL_OPEN)].strip()
        return content or None, calls

    def safe_content_prefix(self, text: str) -> str:
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            return text[:at]
        return _without_partial_tag(text, TOOL_CALL_OPEN)


class Llama3JsonParser:
    """A reply of `{"name", "parameters"}` objects joined by `;` (module doc)."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = _after_python_tag(text)
        if not body.startswith("{"):
            return text, []
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            arguments = _llama_arguments(obj)
            separator = _CALL_SEPARATOR.match(body, end)
            if arguments is None or (separator.group(1) is None and separator.end() < len(body)):
                return text, []   # not a call, or something other than `;` follows one
            calls.append(_call(obj["name"], arguments))
            at = separator.end()
        return None, calls

    def safe_content_prefix(self, text: str) -> str:
        start = text.lstrip()
        if not start or start.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(start):
            return ""   # may still be (or become) a call
        return text


TOOL_CALL_PARSERS = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def _after_python_tag(text: str) -> str:
    body = text.strip()
    return body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body


def _llama_arguments(obj: Any) -> dict[str, Any] | None:
    """A call's arguments (Llama writes `parameters`, some prompts `arguments`), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("parameters", obj.get("arguments"))
    return arguments if isinstance(arguments, dict) else None


def _without_partial_tag(text: str, tag: str) -> str:
    """`text` less a trailing prefix of `tag` (a tag may be half-streamed)."""
    for k in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def _knows_tool_results(template: str) -> bool:
    """Whether a chat template renders tool-result turns itself (by id, as
    Hermes `<tool_response>`, or as Llama's `ipython` turn)."""
    return any(word in template for word in ("tool_call_id", "tool_response", "ipython"))


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": str(name), "arguments": args}}


def _loads(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return default
