"""Tool-call parsers for tool_choice="auto" (`--tool-call-parser`): Hermes
`<tool_call>` blocks and Llama 3 JSON calls, as text in and OpenAI tool_calls
out, streaming's held-back prefix included; then end to end through the
server with the openai SDK (streaming and not): the embedded model behind a
Llama-3-style chat template, its reply made a call by a JSON-schema constraint
(a random reply would rarely be one), read with `llama3_json`.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerOptions, build_app
from kvserve.server.tools import ToolMode, check_parser, parse_tool_calls, safe_content_prefix
from tests.test_server import LiveServer

LLAMA = ToolMode("auto", parser="llama3_json")
HERMES = ToolMode("auto")


def _calls(text: str, mode: ToolMode = LLAMA) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, mode)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": {"b": [1, {"c": 2}]}}}', [("f", {"a": {"b": [1, {"c": 2}]}})]),
    ('  {"name": "f", "parameters": {}} ; {"name": "g", "arguments": {"x": "a;b"}};\n',
     [("f", {}), ("g", {"x": "a;b"})]),
])
def test_llama3_json_calls(text, calls):
    assert _calls(text) == (None, calls)


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    'Let me check. {"name": "get_weather", "parameters": {"city": "Paris"}}',   # only a reply of calls
    '{"name": "Ada", "age": 36}',                                # JSON, but no parameters: not a call
    '{"name": "f", "parameters": [1, 2]}',
    '{"name": "f", "parameters": {}} and then some text',
    '{"name": "f", "parameters": {"city": "Par',                 # cut off by max_tokens
    "",
])
def test_llama3_json_anything_else_is_content(text):
    assert _calls(text) == (text, [])


def test_hermes_calls_after_content_and_the_parser_choice():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert _calls(text, HERMES) == ("Sure.", [("f", {"x": 1})])
    assert _calls(text, LLAMA) == (text, [])
    assert _calls('{"name": "f", "parameters": {"x": 1}}', HERMES)[1] == []
    assert check_parser("llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        check_parser("mistral")


@pytest.mark.parametrize("streamed,safe", [
    ("", ""), ("  ", ""), ("{", ""), (' {"name": "f"', ""), ("<|pyth", ""), ("<|python_tag|>{", ""),
    ("The", "The"), ("Sure {", "Sure {"),
])
def test_llama3_json_streams_content_that_cannot_become_a_call(streamed, safe):
    assert safe_content_prefix(streamed, LLAMA) == safe


def test_hermes_holds_back_a_half_streamed_tag():
    assert safe_content_prefix("Sure.\n<tool_", HERMES) == "Sure.\n"
    assert safe_content_prefix("Sure.\n<tool_call>{", HERMES) == "Sure.\n"


def test_serve_takes_vllms_flags():
    import argparse
    from kvserve.server.cli import _server_options, add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert _server_options(args).tool_call_parser == "llama3_json"
    assert _server_options(parser.parse_args(["serve"])).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "mistral"])


# -- end to end ----------------------------------------------------------------------------------
# Llama 3.1's shape: tools as JSON in the first user turn with the {"name", "parameters"}
# instruction, assistant calls as that JSON, tool results as `ipython` turns.
LLAMA3_TEMPLATE = (
    "{%- set ns = namespace(tools_shown=false) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' and tools is not none and not ns.tools_shown -%}"
    "{%- set ns.tools_shown = true -%}"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON "
    "for a function call.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in message.tool_calls -%}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{%- endfor -%}<|eot_id|>"
    "{%- elif message.role in ('tool', 'ipython') -%}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else -%}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif -%}")
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": CITY}}
# The constraint that makes the reply a Llama 3 call.
LLAMA_CALL = {"type": "json_schema", "json_schema": {"name": "call", "schema": {
    "type": "object", "additionalProperties": False, "required": ["name", "parameters"],
    "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": CITY}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llama_server():
    engine = LLMEngine(EngineArgs(max_model_len=1024))
    engine.tokenizer.chat_template = LLAMA3_TEMPLATE
    with LiveServer(build_app(engine, "m", options=ServerOptions(tool_call_parser="llama3_json"))) as live:
        live.engine = engine
        yield live


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_call_through_the_server(llama_server, stream):
    kwargs = dict(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="auto", max_tokens=40,
                  temperature=0, response_format=LLAMA_CALL)
    if stream:
        chunks = [c.choices[0] for c in _client(llama_server).chat.completions.create(**kwargs, stream=True)]
        assert not "".join(c.delta.content or "" for c in chunks)      # the JSON never leaks as content
        calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
        finish = chunks[-1].finish_reason
    else:
        choice = _client(llama_server).chat.completions.create(**kwargs).choices[0]
        assert choice.message.content is None
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")


def test_llama3_json_plain_reply_streams_as_content(llama_server):
    """A reply that cannot be a call streams as it comes, not at the end."""
    chunks = [c.choices[0] for c in _client(llama_server).chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER], max_tokens=20, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": ["It is sunny in Paris today"]}})]
    assert "".join(c.delta.content or "" for c in chunks) == "It is sunny in Paris today"
    assert any(c.delta.content and c.finish_reason is None for c in chunks)
    assert chunks[-1].finish_reason == "stop" and not any(c.delta.tool_calls for c in chunks)


def test_llama3_call_history_renders_in_the_templates_own_form(llama_server):
    """A past call and its result reach the prompt as the Llama template writes
    them (no Hermes rewrite), and the call's text parses back."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = httpx.post(f"{llama_server.url}/tokenize", json={"model": "m", "messages": messages}).json()["tokens"]
    text = llama_server.engine.tokenizer.decode(ids)
    assert "<tool_response>" not in text and "<tool_call>" not in text
    assert "ipython<|end_header_id|>\n\nsunny, 21 C" in text
    start = text.index('{"name": "get_weather"')
    assert _calls(text[start:text.index("<|eot_id|>", start)]) == (None, [("get_weather", {"city": "Paris"})])
