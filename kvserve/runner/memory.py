"""GPU memory planning: profile the peak of a max-size dummy step, give the
rest of `gpu_memory_utilization` x device memory to KV blocks.

Explicit device allocations only (the caching allocator's cudaMalloc); no
managed memory, so the paged cache never pays hidden page faults (SPEC).
"""
from __future__ import annotations

import logging

import torch

from kvserve.request import Request
from kvserve.runner.batch import pad_tables
from kvserve.runner.model_runner import KVLayout, ModelRunner
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# Head-room for CUDA graphs' pool and allocator fragmentation.
GRAPH_RESERVE_BYTES = 1 * 1024**3


def profile_peak_bytes(model: torch.nn.Module, layout: KVLayout, num_tokens: int, max_model_len: int,
                       max_num_seqs: int, device: torch.device) -> int:
    """Peak allocated bytes of one step of `num_tokens` prompt tokens (KV excluded)."""
    lengths = _dummy_lengths(num_tokens, max_model_len, max_num_seqs)
    needed_blocks = sum(-(-n // layout.block_size) for n in lengths) * layout.num_groups + 1
    tmp_layout = KVLayout(**{**layout.__dict__, "num_blocks": needed_blocks})
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, tmp_layout, device, seed=0)
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    scheduled, block_ids, next_block = [], [], 1
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1))
        scheduled.append(ScheduledRequest(request, n, 0))
        blocks = list(range(next_block, next_block + -(-n // layout.block_size)))
        next_block += len(blocks)
        block_ids.append([blocks] * layout.num_groups)
    runner.execute(SchedulerOutput(scheduled), [pad_tables([ids[g] for ids in block_ids])
                                                for g in range(layout.num_groups)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    del runner
    torch.cuda.empty_cache()
    return peak


def _dummy_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Split the token budget into as many sequences as can be scheduled at once,
    so both the longest attention and the widest sampling are exercised."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    lengths = [min(base + (i < extra), max_model_len - 1) for i in range(num_seqs)]
    return [n for n in lengths if n > 0]


def kv_budget_bytes(utilization: float, peak_bytes: int, device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    # Memory held outside PyTorch's allocator (CUDA context, other processes).
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - non_torch - peak_bytes - GRAPH_RESERVE_BYTES
    logger.info("GPU memory: total %.1f GiB, peak step %.2f GiB, non-torch %.2f GiB -> KV %.1f GiB",
                total / 1024**3, peak_bytes / 1024**3, non_torch / 1024**3, budget / 1024**3)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} of {total / 1024**3:.1f} GiB leaves no room "
                         f"for the KV cache after weights and a peak step of {peak_bytes / 1024**3:.2f} GiB; "
                         f"raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget
