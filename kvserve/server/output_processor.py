"""The API side's view of one engine request's output: token ids and logprobs
as the engine core reports them, text by incremental detokenization, and
stop strings (the core never sees text; a hit here ends the choice, and the
caller aborts the request in the core).

Text semantics match the in-process engine's: a streamed delta holds back an
incomplete UTF-8 character and a tail that could still grow into a stop
string; the final text is the full decode, or the text cut at the stop string.
Prompt logprobs arrive once, with the first output, and leave with the
first delta.
"""
from __future__ import annotations

import logging
from typing import Any

from kvserve import detokenizer
from kvserve.detokenizer import DetokenizerState
from kvserve.outputs import PromptLogprobRow

logger = logging.getLogger(__name__)


class ChoiceOutput:
    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...], want_logprobs: bool,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.min_tokens = min_tokens   # stop strings count from the token after these (vLLM's rule)
        self.want_logprobs = want_logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self._detokenizer = DetokenizerState()
        self._stop_checked_chars = 0
        self.stop_text: str | None = None      # the output cut where a stop string began
        self.stop_string: str | None = None
        self.num_sent_tokens = 0
        self.sent_text = ""
        self._prompt_logprobs: list[PromptLogprobRow | None] | None = None

    def append(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
               prompt_logprobs: list[PromptLogprobRow | None] | None = None) -> bool:
        """Add tokens from the core; True when a stop string ended the output
        (tokens after the one that completed it are dropped)."""
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        for i, token in enumerate(token_ids):
            self.token_ids.append(token)
            if self.want_logprobs and logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.stop_strings and self._hit_stop_string():
                return True
        return False

    def _hit_stop_string(self) -> bool:
        """As the in-process engine's `_hit_stop_string`."""
        text = self.text_so_far()
        checked, self._stop_checked_chars = self._stop_checked_chars, len(text)
        at, stop = detokenizer.find_stop(text, checked, self.stop_strings, len(self.token_ids), self.min_tokens)
        if stop is not None:
            self.stop_text, self.stop_string = text[:at], stop
        return stop is not None

    def text_so_far(self) -> str:
        if self.tokenizer is None:
            return ""
        return detokenizer.advance(self.tokenizer, self._detokenizer, self.token_ids)

    # -- deltas ------------------------------------------------------------------------
    def next_delta(self) -> tuple[list[int], str, list[dict[int, float]] | None]:
        """Tokens, text and logprobs not yet sent, holding back text that may still change."""
        text = self.text_so_far()
        if self.stop_strings:
            text = text[:max(0, len(text) - max(len(s) for s in self.stop_strings) + 1)]
        # The text only grows, and so does its held-back prefix: what was sent is a prefix.
        new_text, self.sent_text = text[len(self.sent_text):], text
        return self._take_tokens_and_logprobs(new_text)

    def final_delta(self, aborted: bool) -> tuple[list[int], str, list[dict[int, float]] | None]:
        """Everything not yet sent. An aborted choice sends no more text."""
        if aborted:
            text = self.sent_text
        elif self.stop_text is not None:
            text = self.stop_text
        else:
            text = self._full_text()
        if text.startswith(self.sent_text):
            new_text = text[len(self.sent_text):]
        else:  # streamed text cannot be taken back; say so rather than drop it silently
            logger.warning("final text does not extend the streamed text; sending no final text")
            new_text = ""
        self.sent_text = text
        return self._take_tokens_and_logprobs(new_text)

    def take_prompt_logprobs(self) -> list[PromptLogprobRow | None] | None:
        """The prompt logprobs once (for the first delta), then None."""
        rows, self._prompt_logprobs = self._prompt_logprobs, None
        return rows

    def _full_text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _take_tokens_and_logprobs(self, new_text: str):
        start, self.num_sent_tokens = self.num_sent_tokens, len(self.token_ids)
        logprobs = self.logprobs[start:] if self.want_logprobs else None
        return self.token_ids[start:], new_text, logprobs
