"""The two generation endpoints: turn a validated request into a Job, then
either stream SSE chunks or collect one response. Completions and chat differ
only in how a prompt is given and how a choice is rendered (`_Format`).

Chat prompts (tools and tool-call history included) and grammars are made here,
with the HTTP side's own tokenizer copy, so the engine thread only runs steps.
A request that fails inside the engine ends with a 500 JSON body, or, once a
stream has started, an SSE error event followed by `[DONE]`.

Completions with `echo` and `logprobs` list the prompt's tokens first (the
first with null logprobs, as nothing precedes it), from the prompt logprobs
the engine computes for such requests; `prompt_logprobs` (vLLM's field)
returns them in vLLM's shape, per choice (completions) or per response (chat).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.outputs import PromptLogprobRow, prompt_logprobs_of
from kvserve.server import tools as tool_calls
from kvserve.server.async_engine import AsyncEngine, Delta, Job, Overloaded, Submission
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice

logger = logging.getLogger(__name__)
ENGINE_ERROR = "the engine failed while running this request; other requests are unaffected"
# What OpenAI (and vLLM) send for a logprob of -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0


@dataclass
class _Choice:
    """One choice being assembled."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    sent: str = ""   # content already streamed (tool-call mode holds some back)
    # Characters of the token texts streamed so far, echo included: where the
    # next chunk's logprobs text_offset starts (as in the one-piece response).
    token_chars: int = 0
    prompt_logprobs: list[PromptLogprobRow | None] | None = None


class _Format:
    """Renders choices and chunks of one endpoint."""
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, num_logprobs: int | None, echo: list[str] | None = None, n: int = 1,
                 prompt_logprobs: bool = False) -> None:
        self.tokenizer, self.num_logprobs = tokenizer, num_logprobs
        self.echo, self.n = echo, n
        self.want_prompt_logprobs = prompt_logprobs   # vLLM's `prompt_logprobs` field in the response
        self.prompt_token_ids: list[list[int]] = []   # per prompt, known once the job is submitted

    @property
    def want_logprobs(self) -> bool:
        return self.num_logprobs is not None

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def choice(self, index: int, c: _Choice) -> dict[str, Any]:
        logprobs = self._completion_logprobs(index, c, c.token_ids, c.logprobs, self.echo is not None, 0)
        out = {"index": index, "text": self._echo(index) + c.text, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason, "logprobs": logprobs}
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(index, c.prompt_logprobs)
        return out

    def chunk_choices(self, d: Delta, c: _Choice, first: bool) -> list[dict[str, Any]]:
        text = (self._echo(d.index) if first else "") + d.text
        echo = first and self.echo is not None
        logprobs = self._completion_logprobs(d.index, c, d.token_ids, d.logprobs or [], echo, c.token_chars)
        if logprobs is not None and logprobs["tokens"]:
            c.token_chars = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return [{"index": d.index, "text": text, "finish_reason": d.finish_reason,
                 "stop_reason": d.stop_reason, "logprobs": logprobs}]

    def response_fields(self, choices: list[_Choice]) -> dict[str, Any]:
        """Response-level fields beyond id, object, choices and usage."""
        return {}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, index: int, c: _Choice, token_ids: list[int],
                             entries: list[dict[int, float]], echo: bool, offset: int) -> dict[str, Any] | None:
        """OpenAI completion logprobs, led by the prompt's tokens when echoing."""
        if not self.want_logprobs:
            return None
        if echo:
            prompt_ids = self.prompt_token_ids[index // self.n]
            token_ids = prompt_ids + token_ids
            entries = _prompt_entries(prompt_ids, c.prompt_logprobs) + entries
        return self.logprobs(token_ids, entries, offset)

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None],
                 offset: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else _clamp(e[t]) for t, e in zip(token_ids, entries)],
                "top_logprobs": [None if e is None else {self.token_text(k): _clamp(v) for k, v in e.items()}
                                 for e in entries],
                "text_offset": _offsets(tokens, offset)}

    def vllm_prompt_logprobs(self, index: int, rows: list[PromptLogprobRow | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`: null, then token id -> {logprob, rank, decoded_token}."""
        prompt_ids = self.prompt_token_ids[index // self.n]
        entries = prompt_logprobs_of(prompt_ids, rows or [], self.token_text)
        return [None if e is None else {t: {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                                            "decoded_token": lp.decoded_token} for t, lp in e.items()}
                for e in entries]


class _ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, num_logprobs: int | None, mode: tool_calls.ToolMode | None = None,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(tokenizer, num_logprobs, prompt_logprobs=prompt_logprobs)
        self.mode = mode

    def response_fields(self, choices: list[_Choice]) -> dict[str, Any]:
        """vLLM puts a chat response's prompt logprobs beside its choices (one prompt)."""
        if not self.want_prompt_logprobs:
            return {}
        return {"prompt_logprobs": self.vllm_prompt_logprobs(0, choices[0].prompt_logprobs)}

    def choice(self, index: int, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if self.mode is not None:
            content, calls = tool_calls.parse_tool_calls(c.text, self.mode)
            if calls:
                message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": index, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                "logprobs": self.logprobs(c.token_ids, c.logprobs)}

    def chunk_choices(self, d: Delta, c: _Choice, first: bool) -> list[dict[str, Any]]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        finish = d.finish_reason
        if self.mode is None:
            delta["content"] = d.text
        else:
            delta, finish = self._tool_delta(delta, d, c)
        return [{"index": d.index, "delta": delta, "finish_reason": finish, "stop_reason": d.stop_reason,
                 "logprobs": self.logprobs(d.token_ids, d.logprobs or [])}]

    def _tool_delta(self, delta: dict[str, Any], d: Delta, c: _Choice) -> tuple[dict[str, Any], str | None]:
        """Stream content up to a possible tool call; the calls go out whole at the end."""
        if not d.finished:
            safe = tool_calls.safe_content_prefix(c.text, self.mode) if self.mode.choice == "auto" else ""
            delta["content"], c.sent = safe[len(c.sent):], max(safe, c.sent, key=len)
            return delta, None
        content, calls = tool_calls.parse_tool_calls(c.text, self.mode)
        if not calls:
            delta["content"] = c.text[len(c.sent):]
            return delta, d.finish_reason
        delta["content"] = (content or "")[len(c.sent):] or None
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return delta, "tool_calls"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                 offset: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for token, entry in zip(token_ids, entries):
            # The entry holds the sampled token and the top n; OpenAI lists exactly the top n.
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_logprobs]
            top = [self._item(k, v) for k, v in ranked]
            content.append({**self._item(token, entry[token]), "top_logprobs": top})
        return {"content": content}

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class GenerationHandler:
    def __init__(self, engine: AsyncEngine, model_names: list[str],
                 generation_defaults: dict[str, Any] | None = None, tool_call_parser: str = "hermes") -> None:
        self.engine, self.model_name, self.model_names = engine, model_names[0], frozenset(model_names)
        self.defaults = dict(generation_defaults or {})
        self.tool_call_parser = tool_calls.check_parser(tool_call_parser)   # the auto tool-call form
        # The HTTP side's own copy: a fast tokenizer must not be used by two threads at once.
        tokenizer = engine.engine.tokenizer
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._grammars = None

    # -- endpoints ---------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        params = body.sampling_kwargs(body.logprobs, self.defaults)
        params["structured"] = await self._structured(body, None)
        prompts = body.prompts()
        job = Job(prompts, params, body.max_tokens or self.defaults.get("max_tokens") or 16,
                  body.num_choices_per_prompt, body.cache_salt)
        echo = [self._prompt_text(p) for p in prompts] if body.echo else None
        fmt = _Format(self.tokenizer, body.logprobs, echo, job.n, body.prompt_logprobs is not None)
        return await self._serve(job, body, fmt, http)

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        use_tools = tools if body.tool_choice != "none" else None
        mode = _tool_mode(body, self.tool_call_parser) if use_tools else None
        prompt = self._render_chat(body, use_tools)
        params = body.sampling_kwargs(body.num_logprobs, self.defaults)
        params["structured"] = await self._structured(body, mode and (mode, use_tools))
        job = Job([prompt], params, body.max_new_tokens or self.defaults.get("max_tokens"),
                  body.num_choices_per_prompt, body.cache_salt)
        fmt = _ChatFormat(self.tokenizer, body.num_logprobs, mode, body.prompt_logprobs is not None)
        return await self._serve(job, body, fmt, http)

    def tokenize(self, body) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt (with special tokens by default) or chat messages."""
        if body.model is not None:
            self._check_model(body.model)
        tok = self._need_tokenizer()
        if body.messages is not None:
            ids = self._render_messages(body.messages, None, {}, body.add_generation_prompt is not False)
        else:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False))
        return {"count": len(ids), "max_model_len": self.engine.engine.scheduler_config.max_model_len,
                "tokens": ids}

    def detokenize(self, body) -> dict[str, Any]:
        if body.model is not None:
            self._check_model(body.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self._need_tokenizer().decode(body.tokens)}

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="prompt")
        return self.tokenizer

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in sorted(self.model_names))
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           param="model", code="model_not_found")

    # -- prompts and constraints ---------------------------------------------------------
    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt) if self.tokenizer is not None else ""

    def _render_chat(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
        return self._render_messages(body.messages, tools, body.chat_template_kwargs or {}, True)

    def _render_messages(self, chat_messages, tools: list[dict[str, Any]] | None,
                         template_kwargs: dict[str, Any], add_generation_prompt: bool) -> list[int]:
        tok = self.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions instead",
                           param="messages")
        _check_template_kwargs(tok, template_kwargs)
        messages = tool_calls.messages_for_template([m.as_template_message() for m in chat_messages],
                                                    tools, tok.chat_template)
        try:
            ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, **template_kwargs)
        except Exception as e:  # the template rejected these messages (e.g. role order)
            raise APIError(400, f"the chat template could not render these messages: {e}",
                           param="messages") from e
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if not all(type(t) is int for t in ids):   # else the core could not read the job (`salvage_inputs`)
            raise APIError(500, "the chat template's token ids are not a list of integers",
                           type="internal_server_error")
        return ids

    async def _structured(self, body, tools_mode) -> Any:
        """The compiled constraint of a request, or None (compiled off the event loop)."""
        found = _constraint(body, tools_mode)
        if found is None:
            return None
        param, kind, value = found
        try:
            pool = self._grammar_pool()
            return await asyncio.to_thread(pool.compile, kind, value)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    def _grammar_pool(self):
        if self._grammars is None:
            from kvserve.structured import GrammarCompilerPool
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer")
            eng = self.engine.engine
            self._grammars = GrammarCompilerPool(self.tokenizer, eng.model_config.vocab_size,
                                                 list(eng.eos_token_ids))
        return self._grammars

    # -- serving -----------------------------------------------------------------------
    async def _serve(self, job: Job, body, fmt: _Format, http: HTTPRequest):
        sub, prompt_lens = await self._submit(job)
        fmt.prompt_token_ids = sub.prompt_token_ids
        request_id = http.headers.get("x-request-id") or uuid.uuid4().hex
        meta = {"id": f"{fmt.id_prefix}-{request_id}", "created": int(time.time()), "model": self.model_name}
        if body.is_stream:
            return _ClosingStream(self._stream(sub, fmt, meta, prompt_lens, body.include_usage),
                                  media_type="text/event-stream")
        collect = asyncio.ensure_future(self._collect(sub, job))
        choices = await _unless_disconnected(collect, http)
        return JSONResponse({**meta, "object": fmt.object_name,
                             "choices": [fmt.choice(i, c) for i, c in enumerate(choices)],
                             "usage": _usage(prompt_lens, choices, job.n), **fmt.response_fields(choices)})

    async def _submit(self, job: Job) -> tuple[Submission, list[int]]:
        try:
            return await self.engine.submit(job)
        except Overloaded as e:
            raise APIError(429, str(e), type="server_overloaded", code="server_overloaded",
                           headers={"Retry-After": "1"}) from e
        except APIError:   # the engine is not running (503)
            raise
        except ValueError as e:
            raise _limit_error(str(e)) from e
        except Exception as e:
            raise APIError(500, f"could not prepare the request: {type(e).__name__}: {e}",
                           type="internal_server_error") from e

    async def _collect(self, sub: Submission, job: Job) -> list[_Choice]:
        choices = [_Choice() for _ in range(job.num_choices)]
        try:
            async for d in self.engine.deltas(sub):
                _check_failed(d)
                _absorb(choices[d.index], d)
        except APIError:
            raise
        except Exception as e:  # the engine failed every request it had
            raise APIError(500, f"{ENGINE_ERROR}: {e}", type="internal_server_error",
                           code="internal_error") from e
        return choices

    async def _stream(self, sub: Submission, fmt: _Format, meta: dict[str, Any],
                      prompt_lens: list[int], include_usage: bool) -> AsyncIterator[str]:
        head = {**meta, "object": fmt.chunk_object}
        started: set[int] = set()
        choices = [_Choice() for _ in range(sub.job.num_choices)]
        try:
            # Closing this generator closes `deltas` now (which aborts what is
            # open), not when the garbage collector finalizes it.
            async with contextlib.aclosing(self.engine.deltas(sub)) as deltas:
                async for d in deltas:
                    _check_failed(d)
                    _absorb(choices[d.index], d)
                    chunk = {**head, "choices": fmt.chunk_choices(d, choices[d.index], d.index not in started)}
                    started.add(d.index)
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
        except Exception as e:  # headers are sent: the error travels as an event
            error = e if isinstance(e, APIError) else APIError(
                500, f"{ENGINE_ERROR}: {e}", type="internal_server_error", code="internal_error")
            yield _sse(error.body())
            yield DONE
            return
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_lens, choices, sub.job.n)})
        yield DONE


class _ClosingStream(StreamingResponse):
    """An SSE response that closes its generator as soon as it ends, however it
    ends. Starlette only cancels the task driving the generator: a client that
    left while a chunk was being sent left the generator suspended at its
    `yield`, and its requests generated on to max_tokens until the garbage
    collector finalized it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _absorb(c: _Choice, d: Delta) -> None:
    c.text += d.text
    c.token_ids += d.token_ids
    c.logprobs += d.logprobs or []
    if d.prompt_logprobs is not None:
        c.prompt_logprobs = d.prompt_logprobs
    if d.finished:
        c.finish_reason, c.num_cached_tokens = d.finish_reason, d.num_cached_tokens
        c.stop_reason = d.stop_reason


def _check_failed(d: Delta) -> None:
    if d.finish_reason == "error":
        raise APIError(500, ENGINE_ERROR, type="internal_server_error", code="internal_error")


def _check_template_kwargs(tokenizer, template_kwargs: dict[str, Any]) -> None:
    """`chat_template_kwargs` are the template's own variables only. One naming an
    argument of `apply_chat_template` (return_tensors, truncation, max_length,
    chat_template, ...) or the `messages` it renders would change what the server
    gets back: a tensor the engine core cannot decode, a silently truncated prompt,
    or a template the request itself supplies; a 400 names it."""
    if not template_kwargs:
        return
    refused = sorted(_template_arguments(type(tokenizer).apply_chat_template) & set(template_kwargs))
    if refused:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(refused)}: only the chat template's own "
                            "variables (e.g. enable_thinking) are taken there", param="chat_template_kwargs")


@functools.lru_cache(maxsize=None)
def _template_arguments(apply_chat_template: Callable[..., Any]) -> frozenset[str]:
    """`apply_chat_template`'s named arguments and the `messages` it renders (read once per tokenizer class)."""
    parameters = inspect.signature(apply_chat_template).parameters.items()
    return frozenset({"messages"} | {name for name, p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD})


def _tool_mode(body: ChatCompletionRequest, parser: str) -> tool_calls.ToolMode:
    if isinstance(body.tool_choice, NamedToolChoice):
        return tool_calls.ToolMode("named", body.tool_choice.function.name, parser)
    return tool_calls.ToolMode("required" if body.tool_choice == "required" else "auto", parser=parser)


def _constraint(body, tools_mode) -> tuple[str, str, Any] | None:
    """(param, kind, value) of the request's output constraint, if any."""
    if tools_mode:
        mode, tools = tools_mode
        if mode.choice == "named":
            return "tool_choice", "json_schema", tool_calls.named_schema(tools, mode.name)
        if mode.choice == "required":
            return "tool_choice", "json_schema", tool_calls.required_schema(tools)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return "response_format", "json_object", None
    if fmt is not None and fmt.type == "json_schema":
        return "response_format", "json_schema", fmt.json_schema.schema_ or {"type": "object"}
    so = body.structured_outputs
    if so is not None:
        for kind, value in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar)):
            if value is not None:
                return "structured_outputs", kind, value
        if so.json_object:
            return "structured_outputs", "json_object", None
        raise APIError(400, "structured_outputs needs one of json, regex, choice, grammar, json_object",
                       param="structured_outputs")
    for param, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, param) is not None:
            return param, kind, getattr(body, param)
    return None


async def _unless_disconnected(task: asyncio.Future, http: HTTPRequest):
    """Await `task`, cancelling it (which aborts its requests) if the client leaves.

    Listens on the ASGI receive channel: behind an `@app.middleware("http")`
    (Starlette's BaseHTTPMiddleware) `Request.is_disconnected()` never reports
    a disconnect, so polling it let a non-streaming request run to its end."""
    left = asyncio.ensure_future(_client_left(http))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise APIError(499, "client disconnected", code="client_disconnected")


async def _client_left(http: HTTPRequest) -> None:
    """Returns once the client disconnects (the body was read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_lens: list[int], choices: list[_Choice], n: int) -> dict[str, Any]:
    # One prompt is billed once however many choices it fans out into.
    prompt_tokens = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(choices[p * n].num_cached_tokens for p in range(len(prompt_lens)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _limit_error(message: str) -> APIError:
    if "max_model_len" in message or "KV blocks" in message:
        return APIError(400, message, param="max_tokens", code="context_length_exceeded")
    # SamplingParams and the engine start their messages with the field's name.
    first = message.split(" ", 1)[0].rstrip(":")
    if first in _SAMPLING_FIELDS:
        return APIError(400, message, param=first)
    return APIError(400, message, param="prompt")


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "seed",
                    "logprobs", "prompt_logprobs", "n"}


_JSON = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event. msgspec, not json.dumps: 0.6 against 6.3 us an event on
    this project's CPU, once per streamed token; non-ASCII text goes as UTF-8, unescaped."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    """Each token's offset in the choice's text (a stream's chunks continue from `start`)."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return offsets


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _prompt_entries(prompt_ids: list[int],
                    rows: list[PromptLogprobRow | None] | None) -> list[dict[int, float] | None]:
    """Per prompt token: None for the first (and for any the engine lost), else token id -> logprob."""
    entries = [None if e is None else {t: lp.logprob for t, lp in e.items()}
               for e in prompt_logprobs_of(prompt_ids, rows or [])]
    return entries + [None] * (len(prompt_ids) - len(entries))
