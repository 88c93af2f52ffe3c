"""Tensor parallelism on 2 GPUs (NCCL; skipped with fewer): float32 greedy
tokens with tensor_parallel_size=2 equal one GPU's, eager and with CUDA
graphs (decode and mixed graphs capture the all-reduces and replay on both
ranks in lockstep), for split and for replicated KV heads; and a bf16 model
sized by memory profiling on both ranks decodes through its graphs."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]
NEW_TOKENS = 24
LENGTHS = [5, 17, 30, 41, 58, 63, 120, 7]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _llm(path, tp: int, eager: bool) -> LLM:
    # A 64-token budget chunks the prompts, so steps mix prefill and decode.
    return LLM(str(path), dtype="float32", device="cuda", max_model_len=256, kv_cache_memory_gb=1,
               max_num_batched_tokens=64, max_num_seqs=16, enforce_eager=eager, tensor_parallel_size=tp)


@pytest.mark.parametrize("kind,kv_heads", [("llama", 2), ("qwen3", 1), ("qwen3-hybrid", 2)])
def test_two_gpus_equal_one_gpu_eager_and_graphs(tmp_path, kind, kv_heads):
    path = save_tiny_checkpoint(kind, tmp_path / kind, num_key_value_heads=kv_heads)
    prompts = random_prompts(LENGTHS)
    expected = _greedy(_llm(path, 1, eager=True), prompts)
    for eager in (True, False):
        llm = _llm(path, 2, eager)
        runner = llm.engine.runner
        try:
            assert _greedy(llm, prompts) == expected, f"eager={eager}"
            if not eager:  # both graph kinds replayed (the worker replays the same ones)
                assert sum(runner.graphs.num_replays.values()) > 0
                assert sum(runner.mixed_graphs.num_replays.values()) > 0
        finally:
            runner.step_channel.close()


def test_profiled_bf16_model_decodes_through_graphs_on_two_gpus():
    llm = LLM("dummy:tiny-qwen3", dtype="bfloat16", device="cuda", max_model_len=512, gpu_memory_utilization=0.3,
              tensor_parallel_size=2)
    runner = llm.engine.runner
    try:
        outs = _greedy(llm, random_prompts([20, 40, 60, 80], vocab=256))
        assert [len(o) for o in outs] == [NEW_TOKENS] * 4
        assert sum(runner.graphs.num_replays.values()) > 0
        free, total = torch.cuda.mem_get_info(1)  # the worker's GPU holds its share of the KV cache too
        assert total - free > 0.2 * total
    finally:
        runner.step_channel.close()
