"""The two generation endpoints: turn a validated request into a Job, then
either stream SSE chunks or collect one response. Completions and chat differ
only in how a prompt is given and how a choice is rendered (`_Format`)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.async_engine import AsyncEngine, Delta, Job, Overloaded, Submission
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass
class _Choice:
    """One choice being assembled for a non-streaming response."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class _Format:
    """Renders choices and chunks of one endpoint."""
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, want_logprobs: bool) -> None:
        self.tokenizer, self.want_logprobs = tokenizer, want_logprobs

    def choice(self, index: int, c: _Choice) -> dict[str, Any]:
        return {"index": index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": self.logprobs(c.token_ids, c.logprobs)}

    def chunk_choice(self, d: Delta, first: bool) -> dict[str, Any]:
        return {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                "logprobs": self.logprobs(d.token_ids, d.logprobs or [])}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [{self.token_text(k): v for k, v in e.items()} for e in entries],
                "text_offset": _offsets(tokens)}


class _ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index: int, c: _Choice) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": self.logprobs(c.token_ids, c.logprobs)}

    def chunk_choice(self, d: Delta, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        return {"index": d.index, "delta": delta, "finish_reason": d.finish_reason,
                "logprobs": self.logprobs(d.token_ids, d.logprobs or [])}

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for token, entry in zip(token_ids, entries):
            top = [self._item(k, v) for k, v in entry.items()][1:] if len(entry) > 1 else []
            content.append({**self._item(token, entry[token]), "top_logprobs": top})
        return {"content": content}

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class GenerationHandler:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    async def completions(self, body: CompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        job = Job(body.prompts(), body.sampling_kwargs(body.logprobs), body.max_tokens or 16, body.n)
        return await self._serve(job, body, _Format(self.engine.engine.tokenizer, body.logprobs is not None), http)

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        try:
            messages = [m.as_template_message() for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        job = Job([messages], body.sampling_kwargs(body.num_logprobs), body.max_new_tokens, body.n)
        return await self._serve(job, body, _ChatFormat(self.engine.engine.tokenizer, body.logprobs), http)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    async def _serve(self, job: Job, body, fmt: _Format, http: HTTPRequest):
        sub, prompt_lens = await self._submit(job)
        meta = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._stream(sub, fmt, meta, prompt_lens, body.include_usage),
                                     media_type="text/event-stream")
        collect = asyncio.ensure_future(self._collect(sub, job))
        choices = await _unless_disconnected(collect, http)
        return JSONResponse({**meta, "object": fmt.object_name,
                             "choices": [fmt.choice(i, c) for i, c in enumerate(choices)],
                             "usage": _usage(prompt_lens, choices, job.n)})

    async def _submit(self, job: Job) -> tuple[Submission, list[int]]:
        try:
            return await self.engine.submit(job)
        except Overloaded as e:
            raise APIError(503, str(e), type="server_overloaded", code="server_overloaded",
                           headers={"Retry-After": "1"}) from e
        except ValueError as e:
            raise _limit_error(str(e)) from e
        except Exception as e:
            raise APIError(500, f"could not prepare the request: {type(e).__name__}: {e}",
                           type="internal_server_error") from e

    async def _collect(self, sub: Submission, job: Job) -> list[_Choice]:
        choices = [_Choice() for _ in range(job.num_choices)]
        async for d in self.engine.deltas(sub):
            c = choices[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            if d.finished:
                c.finish_reason, c.num_cached_tokens = d.finish_reason, d.num_cached_tokens
        return choices

    async def _stream(self, sub: Submission, fmt: _Format, meta: dict[str, Any],
                      prompt_lens: list[int], include_usage: bool) -> AsyncIterator[str]:
        head = {**meta, "object": fmt.chunk_object}
        started: set[int] = set()
        choices = [_Choice() for _ in range(sub.job.num_choices)]
        async for d in self.engine.deltas(sub):
            choices[d.index].token_ids += d.token_ids
            if d.finished:
                choices[d.index].num_cached_tokens = d.num_cached_tokens
            chunk = {**head, "choices": [fmt.chunk_choice(d, d.index not in started)]}
            started.add(d.index)
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_lens, choices, sub.job.n)})
        yield "data: [DONE]\n\n"


async def _unless_disconnected(task: asyncio.Future, http: HTTPRequest):
    """Await `task`, cancelling it (which aborts its requests) if the client leaves."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected", code="client_disconnected")


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
    return APIError(400, message, param="prompt" if "prompt" in message else None)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _offsets(tokens: list[str]) -> list[int]:
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return offsets
