"""Engine wiring for DeepSeek V4: model, per-group V4 KV layout in one block
pool, KV capacity, and a runner whose forward reads and writes the pages
(`PagedSequenceKV`). The scheduler, cache manager, sampler and step loop are
the generic ones; only the layout and the forward differ from Llama's."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

import kvserve.cache.compressed_managers  # noqa: F401 (registers the V4 managers)
from kvserve.cache import KVCacheManager
from kvserve.cache.v4_specs import V4KVLayout, v4_kv_layout
from kvserve.config import EngineArgs
from kvserve.model.deepseek_v4.config import CSA, HCA, DeepseekV4Config, is_deepseek_v4
from kvserve.model.deepseek_v4.loader import DUMMY_CONFIGS, DUMMY_PREFIX, dummy_config, load_deepseek_v4
from kvserve.model.deepseek_v4.paged import PagedSequenceKV
from kvserve.runner.batch import ModelInputs, upload
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.sampler import Sampler
from kvserve.scheduler import PreemptionCosts, Scheduler

logger = logging.getLogger(__name__)
CPU_DEFAULT_MAX_BYTES = 2 * 1024**3


def is_v4_model(model: str | None) -> bool:
    if model is None:
        return False
    if model.startswith(DUMMY_PREFIX):
        return model.removeprefix(DUMMY_PREFIX) in DUMMY_CONFIGS
    config = Path(model) / "config.json"
    return config.is_file() and is_deepseek_v4(json.loads(config.read_text()))


class V4Layout:
    """What the generic runner code reads from a layout (block size, groups)."""

    def __init__(self, kv: V4KVLayout, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv, self.num_blocks, self.dtype = kv, num_blocks, dtype
        self.block_size, self.num_groups = kv.block_size, len(kv.groups)
        self.bytes_per_block = kv.unit * torch.finfo(dtype).bits // 8


class V4Runner(ModelRunner):
    """ModelRunner with V4 pages: one storage tensor [num_blocks, unit].
    Attention: the Triton kernels on the whole batch ("triton") or the torch
    path per sequence through `PagedSequenceKV` ("torch")."""

    def __init__(self, model, layout: V4Layout, device: torch.device, seed: int,
                 attention_backend: str = "torch") -> None:
        self.model, self.layout, self.device = model, layout, device
        self.attention_backend = attention_backend
        self.sampler = Sampler(seed, device)
        self.kv_storage = torch.zeros(layout.num_blocks, layout.kv.unit, dtype=layout.dtype, device=device)
        self.graphs, self.kv_transfer, self.num_eager_forwards = None, None, 0
        config: DeepseekV4Config = model.config
        self.rates = {"csa": config.compress_rate(CSA), "hca": config.compress_rate(HCA)}

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        raise ValueError("CUDA graphs are not supported for DeepSeek V4 yet; use enforce_eager=True")

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        self.num_eager_forwards += 1
        meta, host = inputs.meta, inputs.host
        if self.attention_backend == "triton":
            from kvserve.model.deepseek_v4.kernels import V4PagedBatch
            batch = V4PagedBatch(self.kv_storage, self.layout.kv, meta.block_tables,
                                 upload(host.seq_idx.to(torch.int32), self.device), inputs.positions,
                                 meta.max_seq_len)
            return self.model.forward_tokens(inputs.input_ids, inputs.positions, meta.query_lens_cpu, [], batch)
        starts = [s - q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
        stores = [PagedSequenceKV(self.kv_storage, self.layout.kv, [t[i] for t in meta.block_tables], start,
                                  self.rates) for i, start in enumerate(starts)]
        return self.model.forward_tokens(inputs.input_ids, inputs.positions, meta.query_lens_cpu, stores)


def build_v4_engine_parts(args: EngineArgs):
    from kvserve.engine.builder import EngineParts, _check_one_request_fits, _device_memory, resolve_device
    from kvserve.model.loaders import resolve_dtype
    device = resolve_device(args.device)
    config = _config(args.model, args.hf_overrides)
    sched = args.scheduler_config(config.max_position_embeddings, *_device_memory(device))
    cache = args.cache_config()
    if cache.cpu_kv_cache_gb:
        raise ValueError("the host KV tier (cpu_kv_cache_gb) is not supported for DeepSeek V4 yet")
    dtype = resolve_dtype(args.dtype, device)
    kv_layout = v4_kv_layout(config, cache.block_size)
    model = load_deepseek_v4(args.model, dtype, str(device), args.hf_overrides, args.seed)
    layout = V4Layout(kv_layout, 2, dtype)
    num_blocks = _num_blocks(cache, sched, layout, kv_layout)
    layout = V4Layout(kv_layout, num_blocks, dtype)
    kv_cache = KVCacheManager(kv_layout.kv_groups(), num_blocks, cache.block_size, cache.enable_prefix_caching,
                              eviction_policy=cache.eviction_policy)
    _check_one_request_fits(kv_cache, sched)
    runner = V4Runner(model, layout, device, args.seed, _attention_backend(args.attention_backend, device, config))
    log_layout(kv_layout, num_blocks, layout.bytes_per_block)
    costs = PreemptionCosts(cache.preemption_mode, cache.kv_copy_bandwidth_gbps * 1e9)
    return EngineParts(config, None, sched, kv_cache, Scheduler(sched, kv_cache, costs), runner,
                       frozenset(config.eos_token_ids))


def _attention_backend(requested: str | None, device: torch.device, config: DeepseekV4Config) -> str:
    """"triton" (the default on CUDA) or "torch" (the default elsewhere)."""
    if requested not in (None, "torch", "triton"):
        raise ValueError(f"DeepSeek V4 attention_backend must be 'torch' or 'triton', got {requested!r}")
    if requested == "torch" or (requested is None and device.type != "cuda"):
        return "torch"
    from kvserve.model.deepseek_v4.kernels import unsupported_reason
    reason = unsupported_reason(config)
    if reason is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        reason = f"they need a CUDA device (or TRITON_INTERPRET=1), got device {device}"
    if reason is None:
        return "triton"
    if requested == "triton":
        raise ValueError(f"the Triton DeepSeek V4 kernels cannot run this model: {reason}")
    logger.warning("DeepSeek V4 attention falls back to torch: the Triton kernels cannot run it (%s)", reason)
    return "torch"


def _config(model: str, overrides: dict[str, Any] | None) -> DeepseekV4Config:
    if model.startswith(DUMMY_PREFIX):
        return dummy_config(model.removeprefix(DUMMY_PREFIX), overrides)
    return DeepseekV4Config.from_hf_config(json.loads((Path(model) / "config.json").read_text()), overrides)


def _num_blocks(cache, sched, layout: V4Layout, kv_layout: V4KVLayout) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gb is not None:
        return max(2, int(cache.kv_cache_memory_gb * 1024**3 // layout.bytes_per_block))
    per_seq = sum(kv_layout.blocks_per_sequence(sched.max_model_len, sched.max_num_batched_tokens).values())
    return max(per_seq + 1, min(4 * per_seq, CPU_DEFAULT_MAX_BYTES // layout.bytes_per_block))


def log_layout(kv_layout: V4KVLayout, num_blocks: int, block_bytes: int) -> None:
    kinds: dict[str, int] = {}
    for g in kv_layout.groups:
        kinds[g.kind.name] = kinds.get(g.kind.name, 0) + 1
    per_token = kv_layout.long_run_bytes_per_token(block_bytes // kv_layout.unit)
    logger.info("V4 KV cache: %d blocks x %d tokens (%d bytes each), groups: %s; long-run KV bytes/token: %s",
                num_blocks, kv_layout.block_size, block_bytes,
                ", ".join(f"{n} x{c}" for n, c in kinds.items()),
                ", ".join(f"{n} {b:.0f}" for n, b in per_token.items()) or "none (sliding only)")
