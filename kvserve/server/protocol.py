"""OpenAI / vLLM request schemas (validated by pydantic) and the errors the API returns.

Types are strict: "16" is not a max_tokens. Every optional field accepts
`null` as "the default", as OpenAI's API does. Every numeric field is bounded,
so a value that passes here cannot make the engine raise. A field the server
does not implement is typed `null`-only (so the published schema says so) and
an unknown field is rejected: nothing is silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, ValidatorFunctionWrapHandler, WrapValidator, field_validator,
                      model_validator)

from kvserve.inputs import LONE_SURROGATE, content_error, flat_content, surrogate_error

INT32_MAX = 2 ** 31 - 1
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1



def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer, so the API does too (never "3")."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]
# The published schema's maximum is the model's vocabulary (app._openapi fills it in).
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX, json_schema_extra={"x-token-id": True})]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Unsupported = Annotated[None, Field(description="Not supported by this server: only null is accepted.")]


class APIError(Exception):
    """An error with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class FieldError(ValueError):
    """A cross-field check that names the field at fault (becomes `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _surrogate_at(body: Any) -> tuple[str | None, str, str] | None:
    """(top-level field, path, string) of the first string or key in a JSON body
    that holds a lone UTF-16 surrogate (`kvserve.inputs.surrogate_error`). A key
    is named by the object holding it (the key itself cannot be printed)."""
    stack: list[tuple[str | None, str, Any]] = [(None, "", body)]
    while stack:
        field, path, value = stack.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return field, path, value
            continue
        if isinstance(value, list) and value and isinstance(value[0], (int, float)):
            continue   # numbers (a token-id prompt is thousands); a string among them fails the schema
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):
            name = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            stack.append((field or name, name, item))
            if isinstance(key, str) and LONE_SURROGATE.search(key):
                stack.append((field or path or None, f"a key of {path or 'the body'}", key))
    return None


class _Request(_Strict):
    """A request body: its text must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        found = _surrogate_at(body)
        if found:
            field, path, text = found
            raise FieldError(field, path + surrogate_error(text))
        return body


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False
    continuous_usage_stats: Unsupported = None


# -- structured output ---------------------------------------------------------------
class JsonSchemaFormat(_Strict):
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format", "response_format.json_schema is required when type is json_schema")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[NonEmptyStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


# -- tools ------------------------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: NonEmptyStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


# -- the shared sampling fields ----------------------------------------------------------
class _SamplingFields(_Request):
    """Fields shared by both endpoints."""

    model: StrictStr
    max_tokens: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: Int | None = Field(default=None, ge=1, le=64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Int | None = Field(default=None, ge=0, le=INT32_MAX)
    user: StrictStr | None = None
    cache_salt: NonEmptyStr | None = None   # vLLM's: only requests with the same salt share cached prefixes
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[NonEmptyStr] | None = Field(default=None, min_length=1)
    guided_grammar: StrictStr | None = None
    skip_special_tokens: Literal[True] | None = None
    spaces_between_special_tokens: Literal[True] | None = None
    include_stop_str_in_output: Literal[False] | None = None
    priority: Literal[0] | None = None
    # vLLM's: each prompt token's logprob and the top n (non-streaming responses only).
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=20)
    logits_processors: Unsupported = None
    bad_words: Unsupported = None
    truncate_prompt_tokens: Unsupported = None

    @field_validator("logit_bias")
    @classmethod
    def _check_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or int(key) > INT32_MAX:
                raise FieldError("logit_bias", f"logit_bias keys must be token ids (digits), got {key!r}")
        return value

    @model_validator(mode="after")
    def _check_fields(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs is not available when stream is true")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise FieldError("stop", f"stop accepts at most 4 sequences, got {len(self.stop)}")
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise FieldError("stop", "stop sequences must not be empty")
        constraints = [name for name in ("response_format", "structured_outputs", "guided_json",
                                         "guided_regex", "guided_choice", "guided_grammar")
                       if getattr(self, name) is not None
                       and not (name == "response_format" and self.response_format.type == "text")]
        if len(constraints) > 1:
            raise FieldError(constraints[1], f"give one output constraint, got {', '.join(constraints)}")
        return self

    @property
    def num_choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    def sampling_kwargs(self, logprobs: int | None, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """SamplingParams keyword arguments (max_tokens and n are the job's):
        the model's generation defaults, then every field the client set."""
        kwargs = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        kwargs.update(stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
                      ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                      prompt_logprobs=self.num_prompt_logprobs)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.top_k == 0:
            kwargs["top_k"] = -1
        if self.logit_bias:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return kwargs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


def _token_id_error(value: Any) -> str | None:
    """What is wrong with `value` as a token id (None: nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):
        return f"a token id is a non-negative integer, got {value!r}"
    if not 0 <= value <= INT32_MAX:
        return f"token id {int(value)} is outside [0, {INT32_MAX}]"
    return None


def _prompt_item_error(item: Any, kind: type | tuple[type, ...]) -> str | None:
    """What is wrong with one item of a list prompt whose first item is a `kind`
    (None: nothing); an error inside a token-id list starts with its index."""
    if not isinstance(item, kind):
        return ": a list prompt holds strings, token ids or token-id lists, one kind throughout"
    if isinstance(item, str):
        return " is an empty string" if not item else None
    if isinstance(item, list):
        if not item:
            return " is an empty token list"
        return next((f"[{j}]: {e}" for j, e in enumerate(map(_token_id_error, item)) if e), None)
    error = _token_id_error(item)
    return f": {error}" if error else None


def _prompt_shape(value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
    """A prompt that pydantic's union refuses gets an error saying what is wrong
    and where; the union's own would name its first member only ("prompt.
    constrained-str: Input should be a valid string" for a negative token id).
    The diagnosis runs only then: a valid 8K-token prompt pays nothing for it."""
    try:
        return validate(value)
    except ValidationError:
        if value == "" or value == []:
            raise FieldError("prompt", "prompt must not be empty") from None
        if isinstance(value, list):
            kind = list if isinstance(value[0], list) else str if isinstance(value[0], str) else (int, float)
            for i, item in enumerate(value):
                error = _prompt_item_error(item, kind)
                if error:
                    raise FieldError("prompt", f"prompt[{i}]{error}") from None
        raise


Prompt = Annotated[Union[NonEmptyStr, Annotated[list[TokenId], Field(min_length=1)],
                         Annotated[list[NonEmptyStr], Field(min_length=1)],
                         Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]],
                   WrapValidator(_prompt_shape)]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool | None = None
    best_of: Literal[1] | None = None
    suffix: Unsupported = None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` echoes the prompt's logprobs too (vLLM's rule:
        an explicit `prompt_logprobs` wins)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One turn. Extra keys a client echoes back from a response (refusal,
    annotations, audio: all null here) are dropped; they carry no instruction."""
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)] | None = None   # [] is refused, as OpenAI does
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = [part.model_dump() for part in self.content] if isinstance(self.content, list) else self.content
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": flat_content(content)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _messages_content(messages: Any) -> Any:
    """Each message's content checked before the models validate it, so the
    error names the message and the part (pydantic's union error would say
    "messages.content.str: Input should be a valid string" for an image part)."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        error = content_error(message) if isinstance(message, dict) else None
        if error:
            raise FieldError("messages", f"messages[{i}]{error}")
    return messages


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1), BeforeValidator(_messages_content)]
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Literal[True] | None = None   # false (one call at most) is not enforced
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Literal[True] | None = None
    store: Literal[False] | None = None
    metadata: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    modalities: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    service_tier: Unsupported = None
    reasoning_effort: Unsupported = None
    web_search_options: Unsupported = None
    echo: Unsupported = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names `{self.tool_choice.function.name}`, "
                                                f"which is not among tools {names}")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages_content)] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise FieldError("add_generation_prompt", "add_generation_prompt applies to messages only")
        if self.messages is not None and self.add_special_tokens:   # vLLM's default for chat: false
            raise FieldError("add_special_tokens", "add_special_tokens applies to prompt only: the chat "
                                                   "template writes its own special tokens")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[TokenId]


def _json_or_text(arguments: str) -> Any:
    """Chat templates expect tool-call arguments as an object (they serialize it)."""
    import json
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
