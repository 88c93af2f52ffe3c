"""The server contract as OpenAI and vLLM clients see it, driven with the
official `openai` SDK (streaming and not) and raw httpx where status codes,
headers and bodies are the point.

One embedded-model server for the module, its engine built in this process
(the core runs on a thread), so a test can inject a fault into the engine.
The server requires an API key, allows one CORS origin and exports vLLM's
metric names.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerOptions, build_app
from tests.test_server import LiveServer, _error

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(max_model_len=1024))
    options = ServerOptions(api_key=KEY, allowed_origins=(ORIGIN,), enable_vllm_metrics=True)
    with LiveServer(build_app(engine, MODEL, options=options)) as live:
        live.engine = engine
        yield live


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(server, path, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **kwargs.pop("headers", {})},
                      timeout=120, **kwargs)


def _token_ids(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text, add_special_tokens=False)


# -- fault isolation ----------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hello", "temperature": 1, "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": "Hello", "top_k": 2 ** 64}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2 ** 64}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -(2 ** 63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"12": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hello", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hello", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hello", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "Hello", "no_such_field": 1}, "no_such_field"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": []}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages"),
    ("/v1/completions", {"prompt": "Hello", "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": 7}, "cache_salt"),
])
def test_out_of_range_and_unknown_fields_are_400_naming_the_field(server, path, body, param):
    error = _error(_post(server, path, {"model": MODEL, **body}), 400)
    assert error["param"] == param, error
    assert not error["message"].startswith("Value error")
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": []}, "prompt", "prompt must not be empty"),
    ("/v1/completions", {"prompt": [5, -1]}, "prompt", "prompt[1]: token id -1 is outside [0, 2147483647]"),
    ("/v1/completions", {"prompt": [[5], [6, 2.5]]}, "prompt",
     "prompt[1][1]: a token id is a non-negative integer, got 2.5"),
    ("/v1/completions", {"prompt": [[5], []]}, "prompt", "prompt[1] is an empty token list"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt", "prompt[1] is an empty string"),
    ("/v1/completions", {"prompt": ["a", 5]}, "prompt",
     "prompt[1]: a list prompt holds strings, token ids or token-id lists, one kind throughout"),
    ("/v1/completions", {"prompt": [True]}, "prompt", "prompt[0]: a token id is a non-negative integer, got True"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages",
     "messages[0].content is required for role 'user'"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, "messages",
     "messages[0].content is required for role 'system'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     "messages", "messages[1].content is required unless the message has tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://x"}}]}]},
     "messages", "messages[0].content[1]: parts of type 'image_url' are not supported (text only)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "messages[0].content[0]: a text part needs a string `text`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages",
     "messages[0].content must be a string or a non-empty list of text parts, got []"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format",
     'the json_schema constraint does not compile: Unsupported type "nonsense"'),
])
def test_a_malformed_prompt_or_message_is_400_saying_what_and_where(server, path, body, param, message):
    """Each message names the offending item; pydantic's union error named its first
    member instead ("prompt.constrained-str: Input should be a valid string" for a
    negative token id), and null user content was served as an empty turn."""
    error = _error(_post(server, path, {"model": MODEL, **body}), 400)
    assert (error["param"], error["message"]) == (param, message)


@pytest.mark.parametrize("path,body,param,where", [
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt", "prompt"),   # a 500 (TypeError) before
    ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt", "prompt[1]"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop", "stop[0]"),
    ("/v1/completions", '{"prompt": "ok", "logit_bias": {"\\ud800": 1}}', "logit_bias", "a key of logit_bias"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages", "messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_400_naming_where(server, path, body, param, where):
    """JSON's \\ud800 escape parses to a lone surrogate, which UTF-8 cannot encode:
    the tokenizer raised (a 500 from /tokenize) or the error named the wrong thing."""
    content = body[:-1] + f', "model": "{MODEL}"}}'
    response = httpx.post(f"{server.url}{path}", content=content.encode(), timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == param
    assert error["message"].startswith(f"{where} holds a lone surrogate (U+"), error
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("prompt", ["Hi", [5, 6.0], ["Hi", "Yo"], [[5], [6, 7]]])
def test_every_prompt_form_is_served(server, prompt):
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    batched = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    assert len(response.json()["choices"]) == (len(prompt) if batched else 1)


@pytest.mark.parametrize("seed", [2 ** 63 - 1, -(2 ** 63)])
def test_a_seed_at_the_schemas_edge_serves_n_choices(server, seed):
    """Choice i samples with seed + i: at INT64_MAX that once left int64 and the request was
    refused with a seed the client never sent."""
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "n": 3,
                                          "temperature": 1, "seed": seed})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]


def test_cache_salt_keeps_cached_prefixes_apart(server):
    """vLLM's `cache_salt`: the usage's cached tokens show a prompt cached under one salt hit
    by the same salt only (on both endpoints)."""
    prompt = _token_ids(server, "A cache salt keeps one tenant's prefix out of another's reach. " * 6)

    def cached(path, **salt):
        body = {"model": MODEL, "max_tokens": 1, **salt}
        body.update({"prompt": prompt} if path == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "salted " * 60}]})
        response = _post(server, path, body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert cached(path, cache_salt="tenant-a") == 0
        assert cached(path, cache_salt="tenant-b") == 0 and cached(path) == 0
        assert cached(path, cache_salt="tenant-a") > 0 and cached(path) > 0


async def _stream_tokens(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, **kw):
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True}, **kw)
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_a_request_failing_inside_the_step_fails_alone(server, monkeypatch):
    """A request whose sampling state cannot be built (injected here: seed 4242)
    gets a 500 JSON body, or an SSE error event then [DONE]; three streams
    running at the same time finish, and /health stays 200."""
    sampler = server.engine.runner.sampler
    original = sampler._new_state

    def faulty(params, request_id):
        if params.seed == 4242:
            raise RuntimeError("injected sampler fault")
        return original(params, request_id)

    monkeypatch.setattr(sampler, "_new_state", faulty)
    bad = {"model": MODEL, "prompt": "Hello there", "max_tokens": 20, "temperature": 1.0, "seed": 4242}

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        good = [asyncio.create_task(_stream_tokens(client, _token_ids(server, f"Story {i}:"), 40))
                for i in range(3)]
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            plain = await http.post("/v1/completions", json=bad)
            streamed = await http.post("/v1/completions", json={**bad, "stream": True})
        results = await asyncio.gather(*good)
        await client.close()
        return plain, streamed, results

    plain, streamed, results = asyncio.run(run())
    error = _error(plain, 500)
    assert error["type"] == "internal_server_error"
    assert streamed.status_code == 200
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    for text, finish in results:
        assert finish == "length" and text
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = _client(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                            temperature=0)
    assert "Paris" in ok.choices[0].text


def test_a_step_failing_without_culprit_fails_that_step_and_the_engine_goes_on(server, monkeypatch):
    model = server.engine.runner.model
    original, marker = model.forward, 31337

    def faulty(input_ids, *args, **kwargs):
        if bool((input_ids == marker).any()):
            raise RuntimeError("injected forward fault")
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", faulty)
    error = _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": [marker, 5, 6],
                                                     "max_tokens": 3}), 500)
    assert "engine" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200, ok.text


# -- sampling -----------------------------------------------------------------------------------
def test_null_means_default_for_optional_fields(server):
    nulls = {k: None for k in ("n", "stream", "echo", "logprobs", "ignore_eos", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "temperature", "top_p", "seed",
                               "stop", "logit_bias", "min_tokens", "stream_options", "user", "suffix")}
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                   "max_tokens": 4, **nulls})
    assert response.status_code == 200, response.text
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "tools": None,
                                                   "tool_choice": None, "response_format": None,
                                                   "messages": [{"role": "user", "content": "Hi"}],
                                                   **{k: v for k, v in nulls.items()
                                                      if k not in ("echo", "logprobs", "suffix")}})
    assert chat.status_code == 200, chat.text


def _repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize("stream", [False, True])
def test_frequency_penalty_reduces_repeated_tokens(server, stream):
    client = _client(server)
    kwargs = dict(model=MODEL, prompt="one, one, one, one, one, one, one,", max_tokens=32, temperature=0,
                  logprobs=0)

    def tokens(extra_body=None, **extra) -> list[str]:
        body = {"ignore_eos": True, **(extra_body or {})}
        if not stream:
            return client.completions.create(**kwargs, **extra, extra_body=body).choices[0].logprobs.tokens
        chunks = client.completions.create(**kwargs, **extra, extra_body=body, stream=True)
        return [t for c in chunks for t in c.choices[0].logprobs.tokens]

    plain, penalized = tokens(), tokens(frequency_penalty=2.0)
    assert _repeats(plain) >= 20            # greedy decoding of this prompt loops
    assert _repeats(penalized) <= _repeats(plain) // 2, (plain, penalized)
    for other in ({"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        assert _repeats(tokens(**other)) < _repeats(plain), other


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_plus_100_forces_the_token(server, stream):
    client = _client(server)
    banana = _token_ids(server, " banana")[0]
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                  logit_bias={str(banana): 100}, extra_body={"ignore_eos": True})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == " banana" * 5
    sampled = client.completions.create(**{**kwargs, "temperature": 1.0, "seed": 3})
    assert sampled.choices[0].text == " banana" * 5


def test_min_tokens_holds_back_eos(server):
    client = _client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                            extra_body={"min_tokens": n})
    assert longer.usage.completion_tokens >= n


def test_chat_top_logprobs_lists_exactly_the_top_n(server):
    client = _client(server)
    for n in (1, 3):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=n)
        for entry in reply.choices[0].logprobs.content:
            assert len(entry.top_logprobs) == n
            assert entry.top_logprobs[0].token == entry.token      # greedy: the chosen one is the top
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)


def test_echo_prepends_the_prompt_and_stop_reason_names_the_stop(server):
    client = _client(server)
    prompt = "The capital of France is"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                       stop=["."])
    assert echoed.choices[0].text == prompt + " Paris"
    assert echoed.choices[0].model_extra["stop_reason"] == "."
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            echo=True, stop=["."], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + " Paris"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_lists_the_prompt_tokens_then_the_completion(server, stream):
    """The prompt's tokens lead, the first with null logprobs; token texts join
    into the echoed text and text_offset indexes it (a stream continues it)."""
    client = _client(server)
    prompt = "The capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
        text = "".join(c.text for c in chunks)
        lp = {key: [v for c in chunks for v in getattr(c.logprobs, key)]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, lp = choice.text, choice.logprobs.model_dump()
    ids = server.engine.encode_prompt(prompt)
    tokens = lp["tokens"]
    assert text.startswith(prompt + " Paris") and "".join(tokens) == text
    assert tokens[:len(ids)] == [server.engine.tokenizer.decode([t]) for t in ids]
    assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, logprob, top in zip(tokens[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert logprob <= 0 and top[token] == logprob and 1 <= len(top) <= 2
        assert max(top.values()) >= logprob
    for token, top in zip(tokens[len(ids):], lp["top_logprobs"][len(ids):]):
        assert max(top, key=top.get) == token   # greedy: the completion's tokens are the top ones


def test_prompt_logprobs_field_in_vllm_shape(server):
    """Completions: per choice; chat: beside the choices (vLLM's places). Not with stream."""
    client = _client(server)
    prompt = "The capital of France is"
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    rows, ids = choice.model_extra["prompt_logprobs"], server.engine.encode_prompt(prompt)
    assert rows[0] is None and len(rows) == len(ids) and choice.logprobs is None
    for token, row in zip(ids[1:], rows[1:]):
        assert str(token) in row and 2 <= len(row) <= 3
        assert sorted(e["rank"] for e in row.values())[:2] == [1, 2]   # the top 2, and the token's own
        assert row[str(token)]["decoded_token"] == server.engine.tokenizer.decode([token])
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, extra_body={"prompt_logprobs": 0})
    rows = reply.model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == reply.usage.prompt_tokens
    assert all(len(row) == 1 and next(iter(row.values()))["logprob"] <= 0 for row in rows[1:])
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "prompt_logprobs": 1}), 400)
    assert error["param"] == "prompt_logprobs"


# -- structured output and tools -------------------------------------------------------------------
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}


def _valid(instance, schema) -> bool:
    import jsonschema_rs
    return jsonschema_rs.is_valid(schema, instance)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_parses_and_validates(server, stream):
    client = _client(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=80,
                  temperature=0.8, seed=1,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **kwargs, stream=True) if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert _valid(json.loads(text), PERSON), text


def test_json_object_and_vllm_guided_fields(server):
    client = _client(server)
    messages = [{"role": "user", "content": 'Return the JSON object {"ok": true} and nothing else.'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"}).choices[0]
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert choice.choices[0].text in ("red", "green")
    regex = client.completions.create(model=MODEL, prompt="A year:", max_tokens=8, temperature=0,
                                      extra_body={"guided_regex": "[12][0-9]{3}"})
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.isdigit()
    error = _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                     "guided_json": {"type": "nonsense-type"}}), 400)
    assert error["param"] == "guided_json"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 16}}}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_or_named_returns_tool_calls(server, stream, tool_choice):
    client = _client(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[WEATHER], tool_choice=tool_choice, max_tokens=60, temperature=0)
    if stream:
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and len(calls) >= 1
    assert calls[0].function.name == "get_weather"
    assert _valid(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_tool_call_history_round_trips_through_the_chat_template(server):
    """A call the model made and the tool's answer both reach the prompt, and the
    `<tool_call>` text the model would write parses back into tool_calls."""
    from kvserve.server.tools import ToolMode, parse_tool_calls
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = _post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
    prompt = server.engine.tokenizer.decode(ids)
    assert "<tool_call>" in prompt and '"city": "Paris"' in prompt and "sunny, 21 C" in prompt
    content, calls = parse_tool_calls(prompt[prompt.index("<tool_call>"):], ToolMode("auto"))
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    reply = _client(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                    max_tokens=16, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > len(ids)   # the tool list went into the prompt too


# -- endpoints and operations -----------------------------------------------------------------------
def test_tokenize_detokenize_version(server):
    tokens = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["tokens"] == server.engine.tokenizer.encode("Hello world") and tokens["count"] == 2
    assert tokens["max_model_len"] == 1024
    text = _post(server, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    assert _error(_post(server, "/detokenize", {"tokens": [10 ** 9]}), 400)["param"] == "tokens"
    assert httpx.get(f"{server.url}/version").json()["version"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, "add_special_tokens"),
])
def test_tokenize_refuses_a_field_that_does_not_apply(server, body, param):
    """Each is a field of the other input kind: taken, it would be silently ignored."""
    assert _error(_post(server, "/tokenize", body), 400)["param"] == param
    messages = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}
    assert _post(server, "/tokenize", messages).status_code == 200   # vLLM's default for chat, spelled out


@pytest.mark.parametrize("kwargs,named", [
    ({"return_tensors": "pt"}, "return_tensors"),   # took the engine core down: it could not decode a tensor
    ({"truncation": True, "max_length": 5}, "max_length, truncation"),   # a silently truncated prompt
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),   # a template the request supplies
    ({"tokenize": False}, "tokenize"),
    ({"messages": []}, "messages"),
])
def test_chat_template_kwargs_take_template_variables_only(server, kwargs, named):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    error = _error(_post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": kwargs}), 400)
    assert error["param"] == "chat_template_kwargs"
    assert error["message"].startswith(f"chat_template_kwargs may not set {named}: "), error
    served = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert served.status_code == 200, served.text   # a template variable passes; the engine still serves


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'"text"'])
def test_a_body_that_is_not_an_object_is_400_saying_so(server, content):
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert _error(response, 400)["message"] == "the request body must be a JSON object"


def test_tokenize_checks_messages_as_chat_does(server):
    error = _error(_post(server, "/tokenize", {"messages": [{"role": "user", "content": None}]}), 400)
    assert (error["param"], error["message"]) == ("messages", "messages[0].content is required for role 'user'")


def test_api_key_request_id_and_cors(server):
    no_key = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    error = _error(no_key, 401)
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200          # not under /v1
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                     headers={"X-Request-Id": "req-42"})
    assert response.headers["x-request-id"] == "req-42" and response.json()["id"] == "cmpl-req-42"
    preflight = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_vllm_metric_names_with_model_name_label(server):
    _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert f'{name}{{model_name="{MODEL}"}}' in text, name
    assert f'vllm:inter_token_latency_seconds_bucket{{le="0.001",model_name="{MODEL}"}}' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="' in text


def test_openapi_schema_documents_what_the_server_answers(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "500", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/plain" in schema["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["presence_penalty"]["anyOf"][0]["maximum"] == 2.0
    assert fields["suffix"]["type"] == "null"


# -- generation config ------------------------------------------------------------------------------
def test_generation_config_defaults(tmp_path):
    from kvserve.server.generation_config import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True,
         "max_new_tokens": 100, "eos_token_id": 2}))
    assert generation_defaults(str(tmp_path), "auto") == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 100}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(None, "auto") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(str(tmp_path), "auto")


# -- a burst is queued, not refused ------------------------------------------------------------------
def test_a_burst_of_1000_requests_is_queued_and_served(tmp_path):
    from tests.tiny_models import save_tiny_checkpoint
    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu", max_num_seqs=64))
    with LiveServer(build_app(engine, "tiny")) as live:
        async def burst():
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            async with httpx.AsyncClient(base_url=live.url, timeout=600, limits=limits) as http:
                bodies = [{"model": "tiny", "prompt": [3 + i % 100, 7, 9], "max_tokens": 2,
                           "ignore_eos": True} for i in range(1000)]
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert codes.count(200) == 1000, {c: codes.count(c) for c in set(codes)}
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in responses)


def test_structured_output_and_tools_through_the_core_process():
    """As under `kvserve serve`: the engine core in its own process, grammars
    crossing to it as xgrammar JSON."""
    app = build_app(EngineArgs(max_model_len=512), MODEL)
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        text = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=80,
            temperature=0, response_format={"type": "json_schema",
                                            "json_schema": {"name": "person", "schema": PERSON}},
        ).choices[0].message.content
        assert _valid(json.loads(text), PERSON), text
        choice = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice="required", max_tokens=60, temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
