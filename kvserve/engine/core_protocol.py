"""What crosses between the API server and the engine core, and its wire format.

The API side sends `CoreInputs`: a batch of jobs to add (token ids and
sampling parameters, already tokenized) and request ids to abort. The core
answers with `CoreOutputs`: one message per engine step carrying every
request's new token ids (plus logprobs, finish reason, cached-token count;
a running request's plain next tokens travel as two columns, ids and tokens,
so the core builds no struct per request on a steady decode step),
the jobs it accepted or rejected since the last message, and now and then a
metrics snapshot. Prompt logprobs, when a request asked, ride with its first
output (its prompt is computed by then) as compact rows. A debug query (an id
in `CoreInputs.debug`) is answered before the next step with the core's debug
snapshot under that id (`GET /debug/kvserve`: configuration, fresh metrics,
recent request timelines): nothing of it crosses unless asked; a profile
command (`CoreInputs.profile`) is answered the same way. Text never
crosses: tokenization, detokenization and stop strings are the API side's.

Messages are msgspec structs encoded as msgpack. SamplingParams travel
pickled (a field may hold any object, a compiled grammar say), and so does any
value msgspec cannot encode (as a msgpack extension): both ends are this
program on one machine.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Iterator

import msgspec

from kvserve.outputs import PromptLogprobRow

_PICKLE_EXT = 1


class CoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine request: a choice of a job."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: bytes    # a pickled SamplingParams (it may hold any object), stop strings left out
    arrival_time: float
    # A compiled grammar (SamplingParams.structured.compiled) does not pickle:
    # it travels as xgrammar's JSON and is loaded again in the core.
    grammar_json: str | None = None
    cache_salt: str | None = None


class CoreJob(msgspec.Struct, array_like=True):
    """Requests accepted or rejected together: a bad prompt must not leave half a job running."""
    job_id: str
    requests: list[CoreRequest]


class ProfileCommand(msgspec.Struct, array_like=True):
    """POST /start_profile or /stop_profile (kvserve/engine/device_profile.py), answered
    by one DebugReply under `query_id`."""
    query_id: str
    action: str                # "start" | "stop"


class CoreInputs(msgspec.Struct, omit_defaults=True):
    """Everything the API side queued during one turn of its event loop.

    The core applies adds before aborts: an abort is always sent after its add.
    """
    adds: list[CoreJob] = []
    aborts: list[str] = []
    debug: list[str] = []      # query ids, each answered by one DebugReply
    profile: list[ProfileCommand] = []
    shutdown: bool = False
    # Set by the core only (`salvage_inputs`), never sent: (job id, why) of each job it
    # could not read; it rejects them and goes on.
    unreadable: list[tuple[str, str]] = []


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one step."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None        # "stop" | "length" (stop strings are the API side's)
    stop_reason: int | None = None          # the stop token id, when one ended the request
    num_cached_tokens: int = 0
    scheduled_time: float | None = None     # sent with a request's first output
    # SamplingParams.prompt_logprobs: row i is prompt token i + 1's (first output only).
    prompt_logprobs: list[PromptLogprobRow | None] | None = None


class Rejection(msgspec.Struct, array_like=True):
    job_id: str
    message: str
    invalid: bool      # True: a limit the request broke (HTTP 400); False: an engine fault


class DebugReply(msgspec.Struct, array_like=True):
    query_id: str
    snapshot: dict[str, Any]   # kvserve.diagnose.endpoint.engine_snapshot, or a profile command's reply


class CoreOutputs(msgspec.Struct, omit_defaults=True):
    # Outputs that carry more than tokens: a first one, a finishing one, logprobs.
    outputs: list[CoreOutput] = []
    # Every other request's new tokens, as columns (`every_output` joins both).
    next_ids: list[str] = []
    next_tokens: list[list[int]] = []
    accepted: list[str] = []
    rejected: list[Rejection] = []
    debug: list[DebugReply] = []
    metrics: dict[str, Any] | None = None
    error: str | None = None   # the core failed and is exiting

    def every_output(self) -> Iterator[CoreOutput]:
        """The step's outputs, the columns' ones as CoreOutputs with defaults
        (no cached-token count: a request's first output carried it)."""
        yield from self.outputs
        for request_id, tokens in zip(self.next_ids, self.next_tokens):
            yield CoreOutput(request_id, tokens)


def _enc_hook(obj: Any) -> Any:
    return msgspec.msgpack.Ext(_PICKLE_EXT, pickle.dumps(obj))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLE_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    return pickle.loads(data)


class Codec:
    """Encoder for any message; decoder for one message type."""

    def __init__(self, decodes: type) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(decodes, ext_hook=_ext_hook)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def pack_sampling_params(params: Any) -> tuple[bytes, str | None]:
    """SamplingParams -> (pickled params without the compiled grammar, grammar JSON or None)."""
    spec = getattr(params, "structured", None)
    if spec is None or getattr(spec, "compiled", None) is None:
        return pickle.dumps(params), None
    grammar_json = spec.compiled.serialize_json()
    return pickle.dumps(dataclasses.replace(params, structured=dataclasses.replace(spec, compiled=None))), \
        grammar_json


def unpack_sampling_params(data: bytes, grammar_json: str | None, load_grammar: Callable[[str], Any]) -> Any:
    params = pickle.loads(data)
    if grammar_json is None:
        return params
    spec = dataclasses.replace(params.structured, compiled=load_grammar(grammar_json))
    return dataclasses.replace(params, structured=spec)


def salvage_inputs(data: bytes | memoryview) -> CoreInputs:
    """A `CoreInputs` whose typed decoding failed (a job carrying a value of the
    wrong type, say a tensor among its token ids): each job decoded alone, and
    one that still fails listed in `unreadable` instead of failing the message,
    and with it the engine core and every request. A failure outside the jobs
    raises: that is the API side's bug, not a request's."""
    raw = msgspec.msgpack.decode(data, ext_hook=_ext_hook)
    jobs = raw.pop("adds", []) if isinstance(raw, dict) else []
    message = msgspec.convert(raw, CoreInputs)
    for job in jobs:
        try:
            message.adds.append(msgspec.convert(job, CoreJob))
        except msgspec.ValidationError as e:
            job_id = job[0] if isinstance(job, list) and job and isinstance(job[0], str) else "?"
            message.unreadable.append((job_id, str(e)))
    return message
