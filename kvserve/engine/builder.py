"""Engine wiring: model config -> KV groups -> KV capacity -> model -> runner.

Kept apart from `LLMEngine` so the step loop reads without start-up detail,
and so the GPU path can replace capacity planning without touching the loop.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvserve.attention.backend import get_backend
from kvserve.cache import KVCacheManager, make_kv_cache_groups
from kvserve.cache.groups import group_size, layer_to_group, layer_to_slot
from kvserve.cache.host_tier import HostTier
from kvserve.config import CacheConfig, EngineArgs, SchedulerConfig
from kvserve.model.config import ModelConfig
from kvserve.model.loaders import build_model, resolve_dtype, resolve_model
from kvserve.runner.memory import kv_budget_bytes, profile_peak_bytes
from kvserve.runner.model_runner import KVLayout, ModelRunner
from kvserve.scheduler import PreemptionCosts, Scheduler

logger = logging.getLogger(__name__)

# CPU default: room for this many max-length sequences, within this budget.
CPU_DEFAULT_SEQUENCES = 4
CPU_DEFAULT_MAX_BYTES = 2 * 1024**3


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: Any | None
    scheduler_config: SchedulerConfig
    kv_cache: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    eos_token_ids: frozenset[int]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return dev


def _device_memory(device: torch.device) -> tuple[int, str]:
    """(total bytes, name) of a CUDA device; (0, "") elsewhere."""
    if device.type != "cuda":
        return 0, ""
    props = torch.cuda.get_device_properties(device)
    return props.total_memory, props.name


def build_engine_parts(args: EngineArgs) -> EngineParts:
    from kvserve.model.deepseek_v4.engine import build_v4_engine_parts, is_v4_model
    if is_v4_model(args.model):  # per-group V4 pages and its own runner
        return build_v4_engine_parts(args)
    device = resolve_device(args.device)
    resolved = resolve_model(args.model, args.load_format, args.hf_overrides, args.tokenizer)
    config = resolved.config
    sched_config = args.scheduler_config(config.max_position_embeddings, *_device_memory(device))
    cache_config = args.cache_config()
    groups = make_kv_cache_groups(list(config.layer_specs))
    dtype = resolve_dtype(args.dtype, device)
    backend = get_backend(args.attention_backend or default_backend(device))
    model = build_model(config, backend, layer_to_group(groups), dtype, device)
    resolved.weights.load_into(model)
    layout = KVLayout(num_blocks=2, block_size=cache_config.block_size, group_size=group_size(groups),
                      num_groups=len(groups), layer_to_slot=tuple(layer_to_slot(groups)),
                      num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype)
    num_blocks = plan_num_blocks(cache_config, sched_config, model, layout, device)
    layout = replace(layout, num_blocks=num_blocks)
    num_host_blocks = plan_num_host_blocks(cache_config, layout)
    host_tier = HostTier(num_host_blocks, layout.bytes_per_block) if num_host_blocks else None
    kv_cache = KVCacheManager(groups, num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                              eviction_policy=cache_config.eviction_policy, host_tier=host_tier)
    _check_one_request_fits(kv_cache, sched_config)
    runner = ModelRunner(model, layout, device, args.seed)
    if host_tier is not None:
        runner.attach_host_tier(num_host_blocks)
        logger.info("host KV tier: %d blocks (%.2f GiB)", num_host_blocks,
                    num_host_blocks * layout.bytes_per_block / 1024**3)
    costs = PreemptionCosts(cache_config.preemption_mode, cache_config.kv_copy_bandwidth_gbps * 1e9)
    if device.type == "cuda" and not args.enforce_eager:
        runner.capture_graphs(sched_config.max_model_len, sched_config.max_num_seqs,
                              sched_config.max_num_batched_tokens, mixed=backend.name == "triton")
    logger.info("KV cache: %d blocks x %d tokens, %d group(s): %s", num_blocks, cache_config.block_size,
                len(groups), ", ".join(g.spec.describe() for g in groups))
    eos = set(config.eos_token_ids)
    tokenizer = resolved.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return EngineParts(config, tokenizer, sched_config, kv_cache, Scheduler(sched_config, kv_cache, costs),
                       runner, frozenset(eos))


def default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import kvserve.attention.triton_backend  # noqa: F401
            return "triton"
        except ImportError:
            logger.warning("Triton is not importable; using the torch reference attention on CUDA")
    return "torch"


def plan_num_blocks(cache: CacheConfig, sched: SchedulerConfig, model: torch.nn.Module, layout: KVLayout,
                    device: torch.device) -> int:
    """Blocks for the KV cache: explicit count, explicit memory, or a device default."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = layout.bytes_per_block
    if cache.kv_cache_memory_gb is not None:
        budget = cache.kv_cache_memory_gb * 1024**3
    elif device.type == "cuda":
        peak = profile_peak_bytes(model, layout, sched.max_num_batched_tokens, sched.max_model_len,
                                  sched.max_num_seqs, device)
        budget = kv_budget_bytes(cache.gpu_memory_utilization, peak, device)
    else:
        budget = _cpu_default_budget(sched, per_block, cache.block_size, layout.num_groups)
    num_blocks = int(budget // per_block)
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget ({budget / 1024**3:.3f} GiB) holds {num_blocks} block(s) of "
                         f"{per_block} bytes; at least 2 are needed")
    return num_blocks


def plan_num_host_blocks(cache: CacheConfig, layout: KVLayout) -> int:
    """Host-tier blocks in `cpu_kv_cache_gb` GiB (0: no host tier)."""
    if cache.cpu_kv_cache_gb == 0:
        return 0
    num_blocks = int(cache.cpu_kv_cache_gb * 1024**3 // layout.bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"cpu_kv_cache_gb={cache.cpu_kv_cache_gb} holds no KV block of "
                         f"{layout.bytes_per_block} bytes; raise it or set 0 to turn the host tier off")
    return num_blocks


def _check_one_request_fits(kv_cache: KVCacheManager, sched: SchedulerConfig) -> None:
    needed = kv_cache.num_blocks_needed(sched.max_model_len, sched.max_num_batched_tokens)
    if needed > kv_cache.num_usable_blocks:
        raise ValueError(f"max_model_len={sched.max_model_len} needs {needed} KV blocks per request but the "
                         f"cache holds {kv_cache.num_usable_blocks}; lower max_model_len or give the KV cache "
                         f"more memory (num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization)")


def _cpu_default_budget(sched: SchedulerConfig, per_block: int, block_size: int, num_groups: int) -> float:
    blocks_per_seq = num_groups * math.ceil(sched.max_model_len / block_size)
    wanted = CPU_DEFAULT_SEQUENCES * blocks_per_seq * per_block
    return max(min(wanted, CPU_DEFAULT_MAX_BYTES), (blocks_per_seq + 1) * per_block)
