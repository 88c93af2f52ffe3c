"""Grammar-constrained decoding with xgrammar.

`GrammarCompilerPool` compiles a constraint (JSON schema, any JSON object,
regex, choice, EBNF) once per request on the HTTP side, off the engine's step
path; the compiled grammar rides in `SamplingParams.structured`. On a
request's first sample the sampler makes it a `GrammarMatcher`, which follows
the request's tokens and fills its row of a token bitmask each step;
`apply_masks` applies every constrained row's mask in one op on the device.

With pipelined steps the token a matcher must accept before the next mask is
still on the device when the next step is launched, so a step with
constrained rows reads those ids back first (one sync per such step; steps
without constrained rows are untouched).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # optional dependency
        raise ValueError("structured output needs the xgrammar package: "
                         "pip install 'kvserve[structured]'") from e
    return xgrammar


@dataclass(eq=False)
class StructuredSpec:
    """A compiled constraint; `kind` and `source` say what it was made from.

    The compiled grammar does not pickle: it crosses to the engine core as
    xgrammar's JSON (kvserve/engine/core_protocol.py, a millisecond each way)."""
    kind: str
    source: str
    compiled: Any = None

    def new_matcher(self) -> "GrammarMatcher":
        if self.compiled is None:
            raise ValueError("the grammar was not loaded against the engine's tokenizer")
        return GrammarMatcher(_xgr().GrammarMatcher(self.compiled))


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> Any:
    """xgrammar's view of a tokenizer (vocabulary as byte strings, stop tokens)."""
    return _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                 stop_token_ids=sorted(stop_token_ids))


def _xgrammar_reason(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[05:58:23] /project/cpp/json_schema_converter.cc:5082: "):
    the client is told what is wrong with its schema, not where in xgrammar's sources."""
    return re.sub(r"^\[[0-9:.]+\] \S+:\d+: ", "", str(error).strip())


class GrammarCompilerPool:
    """One xgrammar compiler (with its cache) for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.compiler = _xgr().GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_token_ids),
                                               max_threads=2)

    def compile(self, kind: str, value: Any) -> StructuredSpec:
        """Raises ValueError when the constraint does not compile."""
        try:
            compiled = self._compile(kind, value)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError on bad schemas / grammars
            raise ValueError(f"the {kind} constraint does not compile: {_xgrammar_reason(e)}") from e
        source = value if isinstance(value, str) else json.dumps(value)
        return StructuredSpec(kind, source, compiled)

    def _compile(self, kind: str, value: Any):
        if kind == "json_schema":
            schema = value if isinstance(value, str) else json.dumps(value)
            return self.compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "choice":
            return self.compiler.compile_regex("|".join(f"(?:{re.escape(c)})" for c in value))
        if kind == "grammar":
            return self.compiler.compile_grammar(value)
        raise ValueError(f"unknown constraint kind {kind!r}")


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self._last: tuple[torch.Tensor, int] | None = None   # (device ids, row) not yet accepted

    def sampled(self, ids: torch.Tensor, row: int) -> None:
        self._last = (ids, row)

    def catch_up(self) -> None:
        """Accept the token sampled last step (reads it from the device)."""
        if self._last is None:
            return
        ids, row = self._last
        self._last = None
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(ids[row]))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.catch_up()
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)


class RowsFailed(Exception):
    """Batch rows whose matcher raised (the sampler names their requests)."""

    def __init__(self, rows: list[int], cause: BaseException) -> None:
        super().__init__(f"grammar rows {rows} failed: {cause}")
        self.rows, self.cause = rows, cause


class GrammarMasks:
    """Applies constrained rows' masks; owns one reused host bitmask (allocating
    a pinned one per step cost more than filling it)."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GrammarMatcher]]) -> None:
        """Mask every constrained row's disallowed tokens to -inf, in place, in one op
        (the bitmask has a row per batch row; only the constrained ones are applied)."""
        xgr = _xgr()
        batch, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < batch or self._bitmask.shape[1] * 32 < vocab:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 8), vocab)
        bitmask = self._bitmask[:batch]
        bitmask.fill_(-1)   # all allowed
        failed, cause = [], None
        for i, matcher in rows:
            try:
                matcher.fill(bitmask, i)
            except Exception as e:  # this row's grammar: its request fails alone
                failed.append(i)
                cause = e
        if failed:
            raise RowsFailed(failed, cause)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=vocab, indices=[i for i, _ in rows])
