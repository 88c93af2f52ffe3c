"""DeepSeek V4 on a GPU at real per-layer dims (`dummy:deepseek-v4-flash-l8`,
bf16, torch attention): the paged engine path runs and matches the dense-state
decoding of the same weights token for token. (The Triton kernel path, the
default on CUDA, is checked in test_deepseek_v4_kernels.py.)"""
from __future__ import annotations

import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.model.deepseek_v4.generate import greedy_generate
from kvserve.sampling_params import SamplingParams


@pytest.mark.gpu
def test_flash_l8_engine_runs_on_gpu():
    llm = LLM("dummy:deepseek-v4-flash-l8", device="cuda", dtype="bfloat16", max_model_len=2048,
              kv_cache_memory_gb=4, block_size=16, max_num_batched_tokens=512, attention_backend="torch")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 129000, (n,), generator=g).tolist() for n in (37, 700)]
    for prompt in prompts:  # one at a time: the engine's chunks are then the dense run's chunks
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert list(out) == greedy_generate(llm.engine.runner.model, [prompt], 16, chunk_size=512)[0]
