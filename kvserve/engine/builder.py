"""Engine wiring: model config -> KV groups -> KV capacity -> model -> runner.

Kept apart from `LLMEngine` so the step loop reads without start-up detail,
and so the GPU path can replace capacity planning without touching the loop.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kvserve.attention.backend import AttentionBackend, get_backend
from kvserve.cache import KVCacheManager, make_kv_cache_groups
from kvserve.cache.groups import group_size, layer_to_group, layer_to_slot
from kvserve.cache.host_tier import HostTier
from kvserve.config import CacheConfig, EngineArgs, SchedulerConfig
from kvserve.model.config import ModelConfig
from kvserve.model.loaders import ResolvedModel, build_model, resolve_dtype, resolve_model
from kvserve.runner.cuda_wait import set_cuda_wait
from kvserve.runner.memory import kv_budget_bytes, profile_peak_bytes
from kvserve.runner.model_runner import KVLayout, ModelRunner
from kvserve.scheduler import PreemptionCosts, Scheduler

if TYPE_CHECKING:
    from kvserve.cache.groups import KVCacheGroup
    from kvserve.distributed.group import TPGroup
    from kvserve.distributed.launcher import TPDriver

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
    set_cuda_wait(resolve_device(args.device))   # before anything starts the GPU's context
    if is_v4_model(args.model):  # per-group V4 pages and its own runner
        if args.tensor_parallel_size > 1:
            raise ValueError(f"DeepSeek V4 is not supported with tensor parallelism yet "
                             f"(tensor_parallel_size={args.tensor_parallel_size}); use 1")
        return build_v4_engine_parts(args)
    device = resolve_device(args.device)
    resolved = resolve_model(args.model, args.load_format, args.hf_overrides, args.tokenizer)
    if args.tensor_parallel_size == 1:
        return _build_driver(args, resolved, device, None)
    from kvserve.distributed.launcher import start_workers
    workers = start_workers(args, resolved.config, device)
    try:
        return _build_driver(args, resolved, workers.group.device, workers)
    except BaseException as error:
        workers.close()
        workers.raise_worker_error(error)
        raise


def _build_driver(args: EngineArgs, resolved: ResolvedModel, device: torch.device,
                  workers: "TPDriver | None") -> EngineParts:
    """Rank 0 (the only rank without tensor parallelism): its model shard, plus
    the KV cache manager and the scheduler, which exist once."""
    rank = build_rank_model(args, resolved, device, workers.group if workers is not None else None)
    cache_config, sched_config, layout = rank.cache_config, rank.sched_config, rank.layout
    host_tier = plan_host_tier(cache_config, layout)
    num_host_blocks = host_tier.num_blocks if host_tier is not None else 0
    kv_cache = KVCacheManager(rank.groups, layout.num_blocks, cache_config.block_size,
                              cache_config.enable_prefix_caching, eviction_policy=cache_config.eviction_policy,
                              host_tier=host_tier,
                              max_table_width=-(-sched_config.max_model_len // cache_config.block_size))
    _check_one_request_fits(kv_cache, sched_config)
    runner = build_runner(args, rank, num_host_blocks, step_channel=workers)
    if workers is not None:
        workers.start_serving()
    costs = PreemptionCosts(cache_config.preemption_mode, cache_config.kv_copy_bandwidth_gbps * 1e9)
    logger.info("KV cache: %d blocks x %d tokens, %d group(s): %s", layout.num_blocks, cache_config.block_size,
                len(rank.groups), ", ".join(g.spec.describe() for g in rank.groups))
    config = resolved.config
    eos = set(config.eos_token_ids)
    tokenizer = resolved.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return EngineParts(config, tokenizer, sched_config, kv_cache, Scheduler(sched_config, kv_cache, costs),
                       runner, frozenset(eos))


@dataclass
class RankModel:
    """What every tensor-parallel rank builds alike, in lockstep: its model
    shard and the KV layout of its share of the heads."""
    sched_config: SchedulerConfig
    cache_config: CacheConfig
    groups: list[KVCacheGroup]
    backend: AttentionBackend
    model: torch.nn.Module
    layout: KVLayout
    device: torch.device


def build_rank_model(args: EngineArgs, resolved: ResolvedModel, device: torch.device,
                     group: "TPGroup | None") -> RankModel:
    config = resolved.config
    sched_config = args.scheduler_config(config.max_position_embeddings, *_device_memory(device))
    cache_config = args.cache_config()
    groups = make_kv_cache_groups(list(config.layer_specs))
    dtype = resolve_dtype(args.dtype, device)
    backend = get_backend(args.attention_backend or default_backend(device))
    model = build_model(config, backend, layer_to_group(groups), dtype, device, group)
    resolved.weights.load_into(model)
    layout = KVLayout(num_blocks=2, block_size=cache_config.block_size, group_size=group_size(groups),
                      num_groups=len(groups), layer_to_slot=tuple(layer_to_slot(groups)),
                      num_kv_heads=model.shard.num_local_kv_heads, head_dim=config.head_dim, dtype=dtype)
    num_blocks = plan_num_blocks(cache_config, sched_config, model, layout, device, group)
    return RankModel(sched_config, cache_config, groups, backend, model, replace(layout, num_blocks=num_blocks),
                     device)


def build_runner(args: EngineArgs, rank: RankModel, num_host_blocks: int = 0,
                 step_channel: "TPDriver | None" = None) -> ModelRunner:
    """The rank's runner: KV tensors, host tier, CUDA graphs (captured in lockstep on every rank)."""
    runner = ModelRunner(rank.model, rank.layout, rank.device, args.seed, step_channel)
    if num_host_blocks:
        runner.attach_host_tier(num_host_blocks)
    sched = rank.sched_config
    if rank.device.type == "cuda" and not args.enforce_eager:
        runner.capture_graphs(sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens,
                              mixed=rank.backend.name == "triton")
    if rank.device.type == "cuda" and rank.backend.name == "triton":
        warm_eager_attention_variants(rank)
    if rank.device.type == "cuda" and step_channel is None:   # workers compute logits in lockstep: not warmed
        runner.warm_logits(sched.max_num_seqs)
    return runner


def warm_eager_attention_variants(rank: RankModel) -> None:
    """Compile the attention variants an eager step may pick now, not while serving."""
    from kvserve.attention.backend import AttentionLayerInfo
    from kvserve.attention.kernels.warmup import warm_eager_attention
    layers = [m.info for m in rank.model.modules() if isinstance(getattr(m, "info", None), AttentionLayerInfo)]
    start = time.perf_counter()
    launches = warm_eager_attention(layers, rank.layout.block_size, rank.layout.dtype, rank.device)
    logger.info("attention kernels: %d eager variants launched in %.1f s", launches, time.perf_counter() - start)


def default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import kvserve.attention.triton_backend  # noqa: F401
            return "triton"
        except ImportError:
            logger.warning("Triton is not importable; using the torch reference attention on CUDA")
    return "torch"


def plan_num_blocks(cache: CacheConfig, sched: SchedulerConfig, model: torch.nn.Module, layout: KVLayout,
                    device: torch.device, group: "TPGroup | None" = None) -> int:
    """Blocks for the KV cache: explicit count, explicit memory, or a device default.

    Under tensor parallelism every rank profiles its own shard (the same dummy
    step, so the forward's collectives line up) and all take the smallest
    count: one block id means the same slots on every rank."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = layout.bytes_per_block
    refusal = None
    if cache.kv_cache_memory_gb is not None:
        budget = cache.kv_cache_memory_gb * 1024**3
    elif device.type == "cuda":
        peak = profile_peak_bytes(model, layout, sched.max_num_batched_tokens, sched.max_model_len,
                                  sched.max_num_seqs, device)
        budget, refusal = _rank_budget(cache.gpu_memory_utilization, peak, device, group)
    else:
        budget = _cpu_default_budget(sched, per_block, cache.block_size, layout.num_groups)
    num_blocks = int(budget // per_block)
    if group is not None:
        num_blocks = group.host_min(num_blocks)
    if refusal is not None:
        raise refusal
    if num_blocks < 2:
        where = " on the tightest tensor-parallel rank" if group is not None else ""
        raise ValueError(f"the KV cache budget{where} holds {max(num_blocks, 0)} block(s) of {per_block} "
                         f"bytes (this rank: {budget / 1024**3:.3f} GiB); at least 2 are needed")
    return num_blocks


def _rank_budget(utilization: float, peak: int, device: torch.device,
                 group: "TPGroup | None") -> tuple[float, ValueError | None]:
    """(kv_budget_bytes, None), or (0, its refusal) under tensor parallelism: a
    rank without room still reaches the agreement, so all ranks fail together."""
    try:
        return kv_budget_bytes(utilization, peak, device), None
    except ValueError as error:
        if group is None:
            raise
        return 0, error


def plan_host_tier(cache: CacheConfig, layout) -> HostTier | None:
    """The host tier's slots for `cpu_kv_cache_gb` (None: no host tier); `layout`: any
    with `bytes_per_block` (a Llama-family `KVLayout`, DeepSeek V4's pages)."""
    num_blocks = plan_num_host_blocks(cache, layout)
    return HostTier(num_blocks, layout.bytes_per_block) if num_blocks else None


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
