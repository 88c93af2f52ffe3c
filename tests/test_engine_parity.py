"""Engine-level parity: kvserve greedy generation is token-identical to HF
transformers `generate` (float32) for every supported architecture, and stays
identical under block sizes, prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.tiny_models import hf_greedy, random_prompts, save_tiny_checkpoint

KINDS = ["llama", "qwen2", "qwen3", "qwen3-hybrid", "mistral"]
LENGTHS = [5, 17, 30, 41, 58, 63]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    prompts = random_prompts(LENGTHS)
    out = {}
    for kind in KINDS:
        path = save_tiny_checkpoint(kind, root / kind)
        out[kind] = (path, hf_greedy(path, prompts, NEW_TOKENS))
    return prompts, out


def _generate(path, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf(checkpoints, kind):
    prompts, refs = checkpoints
    path, expected = refs[kind]
    got, _ = _generate(path, prompts)
    assert got == expected


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("kind", ["qwen3-hybrid", "llama"])
def test_same_outputs_under_chunking_and_preemption(checkpoints, kind, block_size, prefix_caching):
    prompts, refs = checkpoints
    path, expected = refs[kind]
    # Repeat prompts so prefix hits happen when caching is on.
    twice = prompts + prompts[:3]
    # A pool of ~2.5 peak-size requests forces preemption; a 24-token budget
    # forces every prompt longer than 24 tokens to prefill in chunks.
    max_len = max(LENGTHS) + NEW_TOKENS
    probe = LLM(str(path), dtype="float32", device="cpu", block_size=block_size, max_model_len=max_len)
    per_request = probe.engine.kv_cache.num_blocks_needed(max_len)
    got, metrics = _generate(path, twice, block_size=block_size, enable_prefix_caching=prefix_caching,
                             max_num_batched_tokens=24, num_kv_blocks=1 + (5 * per_request) // 2,
                             max_model_len=max_len)
    assert got == expected + expected[:3]
    assert metrics["num_preemptions"] > 0
    assert metrics["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("kind", ["qwen3-hybrid", "llama"])
def test_long_prefill_token_threshold_keeps_hf_parity(checkpoints, kind):
    """vLLM's long_prefill_token_threshold: every prompt computes at most 7 tokens a step (the
    budget would take them whole), so each prompt over 7 tokens prefills in chunks beside the
    others' decodes; the outputs stay HF's, and the chunks were that short."""
    prompts, refs = checkpoints
    path, expected = refs[kind]
    llm = LLM(str(path), dtype="float32", device="cpu", long_prefill_token_threshold=7)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def logged():
        out = schedule()
        steps.append(max((item.num_new_tokens for item in out.scheduled), default=0))
        return out
    llm.engine.scheduler.schedule = logged
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(steps) == 7


@pytest.mark.parametrize("kind", ["llama", "qwen3-hybrid"])
def test_staggered_finishes_keep_hf_parity(checkpoints, kind, monkeypatch):
    """Requests that finish one after another in the middle of steady decode
    (each its own max_tokens): the decode streak goes on without them, each
    remaining row's pending token taken from its row of the step in flight
    (`SchedulerOutput.previous_rows`, an index uploaded with the step). Each
    output is the first max_tokens of HF's greedy continuation, and that path ran."""
    from kvserve.runner import model_runner
    prompts, refs = checkpoints
    path, expected = refs[kind]
    kept_steps = []
    fill_pending = model_runner.ModelRunner._fill_pending

    def counted(self, inputs, *args):   # the kept rows' index reached the step's inputs
        kept_steps.append(inputs.kept_rows is not None)
        return fill_pending(self, inputs, *args)
    monkeypatch.setattr(model_runner.ModelRunner, "_fill_pending", counted)
    limits = [24, 9, 21, 12, 18, 15]   # rows leave from the middle first: a prefix of the rows would not do
    llm = LLM(str(path), dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in limits]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e[:n] for e, n in zip(expected, limits)]
    assert sum(kept_steps) >= 3, kept_steps
