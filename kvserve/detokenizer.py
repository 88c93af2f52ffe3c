"""Incremental detokenization: a request's output text grows by decoding only
the tokens added since the last call (plus the previous chunk as context),
not the whole output each time.

Stop-string checks and streamed deltas need the text after every token; a full
decode each time is quadratic in the output length and runs on the engine
thread. The window trick (as in vLLM and TGI): decode ids[prefix:read] and
ids[prefix:], and the new text is what the second adds to the first. Starting
both at the same token makes tokenizer quirks at a decode's start (a dropped
leading space) cancel. A window that ends in U+FFFD (an incomplete UTF-8
character split over byte tokens) is held back until more tokens complete it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerState:
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


def advance(tokenizer: Any, state: DetokenizerState, token_ids: list[int]) -> str:
    """The text of `token_ids` (which only ever grow) as far as it is final."""
    if state.read_offset >= len(token_ids):
        return state.text
    decode = decoder(tokenizer)
    prefix = decode(token_ids[state.prefix_offset:state.read_offset])
    full = decode(token_ids[state.prefix_offset:])
    if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
        state.text += full[len(prefix):]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
    return state.text


@lru_cache(maxsize=16)
def fast_backend(tokenizer: Any) -> Any:
    """A fast tokenizer's Rust backend where decoding from it gives transformers' text
    (no clean-up of tokenization spaces), else None: transformers' wrapper around that
    call cost ~3x the decode itself, twice per streamed token (benchmarks/api_stream_bench.py)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, from the Rust backend where it can."""
    backend = fast_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def find_stop(text: str, checked: int, stops: Sequence[str], num_tokens: int,
              min_tokens: int) -> tuple[int, str | None]:
    """Where the first of `stops` (in their order) begins in `text`, the text of `num_tokens`
    output tokens, counting only matches that end past the `checked` characters scanned before,
    as vLLM's check: (index, the stop string), or (-1, None). Also (-1, None) while num_tokens <=
    min_tokens: stop strings count from the token after those (vLLM's rule). The in-process
    engine and the API side both cut here."""
    if num_tokens <= min_tokens:
        return -1, None
    for stop in stops:
        at = text.find(stop, max(0, checked - len(stop) + 1))
        if at >= 0:
            return at, stop
    return -1, None
