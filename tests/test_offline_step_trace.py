"""benchmarks/offline_scenarios.py's `--step-trace`: the offline engine's steps as the
served core's step trace has them (kvserve/engine/step_trace.py), one line a step."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine import step_trace
from tests.tiny_models import save_tiny_checkpoint

spec = importlib.util.spec_from_file_location(
    "offline_scenarios", Path(__file__).resolve().parents[1] / "benchmarks" / "offline_scenarios.py")
offline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline)


def test_each_step_is_a_line_with_its_rows_and_prompt_tokens(tmp_path):
    """Two prompts (40 and 10 tokens, in chunks of 16, 16, 8 + 8 and 2: none of one token,
    which the trace counts as no prompt), 5 tokens each: the lines' prompt tokens sum to
    the 50 computed, their sampling rows to the 10 tokens sampled."""
    llm = LLM(str(save_tiny_checkpoint("llama", tmp_path / "ckpt")), dtype="float32", device="cpu",
              max_model_len=256, max_num_batched_tokens=16)
    path = tmp_path / "steps.tsv"
    trace = offline.trace_steps(llm.engine, str(path))
    traced, calls = llm.engine.step, []
    llm.engine.step = lambda *a, **k: calls.append(1) or traced(*a, **k)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3] * 40}, {"prompt_token_ids": [4] * 10}], [params, params], use_tqdm=False)
    trace.close()
    steps = step_trace.read(str(path))
    assert len(steps) == len(calls) > 0
    assert sum(s["prompt_tokens"] for s in steps) == 50
    assert sum(s["rows"] for s in steps) == 10


def test_also_takes_name_at_seed_and_names_what_it_wants():
    assert offline.seeded_scenario("ide-completion@2") == (2, "ide-completion")
    for bad in ("ide@1", "ide-completion", "ide-completion@x", "qa@-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME@SEED"):
            offline.seeded_scenario(bad)


def test_a_scenario_and_seed_asked_for_twice_is_named():
    assert offline.repeated_runs([0], ["qa", "ide-completion"], [(1, "ide-completion")]) == []
    assert offline.repeated_runs([0, 1], ["ide-completion"], [(1, "ide-completion"), (0, "qa")]) == \
        ["ide-completion@1"]
    assert offline.repeated_runs([0], ["qa"], [(2, "qa"), (2, "qa")]) == ["qa@2"]
