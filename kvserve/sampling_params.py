"""SamplingParams: vLLM's surface, validated at construction.

Every numeric field is bounded here, so nothing a client sends can make the
batched sampler raise inside an engine step (a seed past int64 once did).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_TOP_K = 2 ** 31 - 1
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> additive bias on the logit, in [-100, 100] (OpenAI's range).
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    # Logprobs of each prompt token given the ones before it, with the top n
    # (None: not computed). Such a request computes its whole prompt: it takes
    # no prefix-cache hit (a hit skips the positions), as in vLLM.
    prompt_logprobs: int | None = None
    # A compiled-grammar request (kvserve/structured): JSON schema, regex, choice...
    structured: Any = None
    n: int = 1
    # Derived: stop strings as a tuple, never None.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(_is_int(self.max_tokens), f"max_tokens must be an integer, got {self.max_tokens!r}")
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check(_is_real(self.temperature) and 0.0 <= self.temperature <= 1e4,
               f"temperature must be in [0, 10000], got {self.temperature!r}")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K),
               f"top_k must be -1 or 0 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        self._check_penalties()
        _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20),
                   f"{name} must be an integer between 0 and 20, got {value!r}")
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer of at least 1, got {self.n!r}")
        _check(self.stop_token_ids is None or all(map(_is_token_id, self.stop_token_ids)),
               f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        stops = self.stop if self.stop is not None else ()
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        _check(all(isinstance(s, str) and s for s in stops),
               f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_strings", stops)

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_real(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for token, bias in (self.logit_bias or {}).items():
            _check(_is_token_id(token), f"logit_bias key {token!r} is not a token id")
            _check(_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_logits_processing(self) -> bool:
        """True when logits change before sampling (penalties, bias, min_tokens, grammar)."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.structured is not None)

    def with_max_tokens(self, max_tokens: int) -> "SamplingParams":
        return replace(self, max_tokens=max_tokens)

    def choices(self) -> list["SamplingParams"]:
        """One request's params per choice of `n`: n = 1 each, choice i seeded `child_seed(seed, i)`
        so seeded samples differ (vLLM's seed + i)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=child_seed(self.seed, i)) for i in range(self.n)]


def child_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: seed + i, wrapped into int64 as two's complement does, so a seed at the
    edge with n > 1 stays a seed the sampler takes (no error about a value nobody sent)."""
    if seed is None or i == 0:
        return seed
    return (seed + i - INT64_MIN) % 2 ** 64 + INT64_MIN


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= INT64_MAX


def _is_real(value: Any) -> bool:
    """An int or a float (numpy's float64 is one), not a bool: a string or None would
    otherwise fail the bound's comparison with a TypeError that names no field."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
