"""SamplingParams: vLLM's surface, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    # Derived: stop strings as a tuple, never None.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               f"max_tokens must be an integer, got {self.max_tokens!r}")
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1,
               f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20,
               f"logprobs must be between 0 and 20, got {self.logprobs}")
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        stops = self.stop if self.stop is not None else ()
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        _check(all(isinstance(s, str) and s for s in stops),
               f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_strings", stops)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def with_max_tokens(self, max_tokens: int) -> "SamplingParams":
        from dataclasses import replace
        return replace(self, max_tokens=max_tokens)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
