"""Engine counters against figures worked out by hand (CPU, tiny random Llama:
4 layers, 2 KV heads of dim 16, float32), not against the objects that
produced them: prefix-cache queries and hits in tokens, and host-tier bytes
from the model's KV shape."""
from __future__ import annotations

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# K and V x 4 layers x 4 tokens per block x 2 KV heads x head dim 16 x 4 bytes.
BLOCK_BYTES = 2 * 4 * 4 * 2 * 16 * 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-metrics"))


def _generate(llm: LLM, prompt: list[int], params: SamplingParams = PARAMS):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def test_prefix_hits_in_tokens(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", block_size=8, max_model_len=128)
    prompt = random_prompts([40], seed=9)[0]
    steps = [
        (prompt, 0),                         # cold
        (prompt, 32),                        # 5 full blocks cached; capped at 39 tokens -> 4 blocks
        (prompt[:20] + [7, 8, 9, 10, 11], 16),  # shares blocks 0-1; block 2 differs from token 20 on
    ]
    for tokens, hit in steps:
        before = llm.get_metrics()
        out = _generate(llm, tokens)
        after = llm.get_metrics()
        assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(tokens)
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == hit
        assert out.num_cached_tokens == hit


def test_host_bytes_from_the_kv_shape(llama):
    """One request at a time; B needs every usable block, so it evicts all of A
    to the host, and A's rerun loads its 9 hittable blocks (36 of 39 tokens)."""
    llm = LLM(str(llama), dtype="float32", device="cpu", block_size=4, max_model_len=52,
              num_kv_blocks=14, max_num_seqs=1, cpu_kv_cache_gb=0.001)
    a, b = random_prompts([40, 44], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)  # B: 52 tokens, 13 blocks
    _generate(llm, a, params)
    _generate(llm, b, params)
    before = llm.get_metrics()
    assert _generate(llm, a, params).num_cached_tokens == 36
    after = llm.get_metrics()
    assert after["kv_host_blocks_to_gpu"] - before["kv_host_blocks_to_gpu"] == 9
    assert after["kv_host_bytes_to_gpu"] - before["kv_host_bytes_to_gpu"] == 9 * BLOCK_BYTES
    assert after["kv_host_bytes_to_host"] == after["kv_host_blocks_to_host"] * BLOCK_BYTES > 0
