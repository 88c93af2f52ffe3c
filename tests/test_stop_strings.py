"""Stop strings, in the in-process engine (`LLMEngine._hit_stop_string`) and on the API side
(`ChoiceOutput`), against a brute-force definition (vLLM's): after each output token past
min_tokens, the first stop string (in the request's order) with an occurrence that ends in the
text that token added; the output is cut where that occurrence begins. A character tokenizer
makes the text of n tokens exactly n characters."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvserve.engine.llm_engine import LLMEngine
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.server.output_processor import ChoiceOutput

ALPHABET = "abcde"


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(ALPHABET[i] for i in ids)


def reference(tokens: list[int], stops: list[str], min_tokens: int) -> tuple[int, str, str] | None:
    """(tokens taken, text kept, the stop) or None."""
    text = "".join(ALPHABET[t] for t in tokens)
    for k in range(min_tokens + 1, len(tokens) + 1):
        for stop in stops:
            starts = [a for a in range(k - len(stop) + 1) if text[a:a + len(stop)] == stop and a + len(stop) > k - 1]
            if starts:
                return k, text[:starts[0]], stop
    return None


def _engine_stop(tokens, stops, min_tokens):
    params = SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=max(len(tokens), min_tokens, 1))
    request = Request("r", [1], params)
    engine = SimpleNamespace(output_text_so_far=lambda r: CharTokenizer().decode(r.output_token_ids))
    for k, token in enumerate(tokens, start=1):
        request.output_token_ids.append(token)
        if LLMEngine._hit_stop_string(engine, request):
            return k, request.output_text, request.stop_reason
    return None


def _api_stop(tokens, stops, min_tokens):
    output = ChoiceOutput(CharTokenizer(), tuple(stops), False, min_tokens)
    for k, token in enumerate(tokens, start=1):
        if output.append([token], None):
            return k, output.stop_text, output.stop_string
    return None


@pytest.mark.parametrize("stop_of", [_engine_stop, _api_stop], ids=["engine", "api"])
def test_stop_strings_match_the_definition(stop_of):
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        tokens = [rng.randrange(len(ALPHABET)) for _ in range(rng.randint(1, 14))]
        stops = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        min_tokens = rng.choice([0, 0, 1, 3, 6])
        want = reference(tokens, stops, min_tokens)
        assert stop_of(tokens, stops, min_tokens) == want, (tokens, stops, min_tokens)
        hits += want is not None
    assert 100 < hits < 390   # both outcomes are exercised


@pytest.mark.parametrize("stop_of", [_engine_stop, _api_stop], ids=["engine", "api"])
def test_no_stop_string_ends_inside_the_first_min_tokens(stop_of):
    """vLLM's test: "e" inside the first min_tokens tokens does not stop; the next one does."""
    tokens = [4, 0, 4, 1, 4]   # e a e b e
    assert stop_of(tokens, ["e"], 0) == (1, "", "e")
    assert stop_of(tokens, ["e"], 2) == (3, "ea", "e")
    assert stop_of(tokens, ["ab", "e"], 3) == (5, "eaeb", "e")
    assert stop_of(tokens, ["e"], 5) is None
