"""Property-based fuzz of the HTTP API from its own OpenAPI schema
(schemathesis, every default check: no 5xx, documented status codes, content
types, headers and response bodies, invalid data rejected), against the
embedded model. Bounded: a fixed number of examples per operation and
max_tokens capped at 4, so it runs in CI in well under a minute.
"""
from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.server.app import build_app  # noqa: E402
from kvserve.server.protocol import INT32_MAX  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 4
EXAMPLES = 12


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine(EngineArgs(max_model_len=512))
    with LiveServer(build_app(engine, MODEL)) as server:
        yield server


def _cap_generation(body) -> None:
    """Keep generation short: a valid large max_tokens becomes MAX_TOKENS; an
    invalid one (the point of a negative case) is left alone."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value <= INT32_MAX:
            body[key] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS


def _operations(live):
    loaded = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_api_conforms_to_its_schema(live, mode):
    """Every operation, valid and invalid data, every default check but one.
    The schemathesis pytest plugin is not used (it does not load under pytest 9):
    each operation's case strategy runs under hypothesis here.

    Left out: "schema-valid data is accepted" (positive_data_acceptance). Some
    limits are not expressible in JSON Schema: prompt + max_tokens within
    max_model_len, min_tokens <= max_tokens, logit_bias keys (strings) within
    the vocabulary, a regex / grammar / JSON schema that compiles. Those answer
    400, and every 400 must name the field at fault in `param` (checked here)."""
    from schemathesis.specs.openapi.checks import positive_data_acceptance
    components = httpx.get(f"{live.url}/openapi.json").json()["components"]["schemas"]
    fields = {name for schema in components.values() for name in schema.get("properties", {})}
    for operation in _operations(live):
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(case=strategy)
        def check(case):
            if case.method.upper() == "POST":
                _cap_generation(case.body)
            response = case.call_and_validate(base_url=live.url, excluded_checks=[positive_data_acceptance])
            if response.status_code == 400 and isinstance(case.body, dict):
                param = response.json()["error"]["param"]
                assert param is None or param in case.body or param in fields, (param, case.body)
                assert param is not None or "JSON" in response.json()["error"]["message"], response.text

        try:
            check()
        except Unsatisfiable:
            # Nothing to make invalid: an operation without parameters or body.
            assert mode == "negative" and operation.method.upper() == "GET", operation.label
