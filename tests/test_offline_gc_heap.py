"""The offline LLM freezes its start-up heap once built, as vLLM's engine core does, so that a
run's first full collection does not walk the model and the block pool in the middle of its
steps; it thaws the heap when it goes, so that a process building several frees each one."""
from __future__ import annotations

import gc

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _llm() -> LLM:
    return LLM("dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=64,
               max_model_len=64)


def test_the_start_up_heap_is_frozen_while_the_llm_lives(thawed):
    llm = _llm()
    frozen = gc.get_freeze_count()
    blocks = llm.engine.kv_cache.pool.blocks
    assert frozen > len(blocks)   # the block pool's blocks among what start-up built
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_heap_thaws_when_the_llm_goes(thawed):
    llm = _llm()
    assert gc.get_freeze_count() > 0
    del llm
    assert gc.get_freeze_count() == 0
