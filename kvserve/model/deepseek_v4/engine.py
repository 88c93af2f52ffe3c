"""Engine wiring for DeepSeek V4: model, per-group V4 KV layout in one block
pool, KV capacity (profiled on CUDA, planned per group), and a runner whose
forward reads and writes the pages (Triton kernels on the whole batch, under
CUDA graphs where captured: graphs.py; or `PagedSequenceKV` per sequence).
The scheduler, cache manager, sampler and step loop are the generic ones;
only the layout and the forward differ from Llama's."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import kvserve.cache.compressed_managers  # noqa: F401 (registers the V4 managers)
from kvserve.cache import KVCacheManager
from kvserve.cache.v4_specs import CompressedSpec, V4KVLayout, v4_kv_layout
from kvserve.config import EngineArgs
from kvserve.model.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config, is_deepseek_v4
from kvserve.model.deepseek_v4.graphs import V4Graphs, V4Step, capture_sizes, context_buckets
from kvserve.model.deepseek_v4.loader import DUMMY_CONFIGS, DUMMY_PREFIX, dummy_config, load_deepseek_v4
from kvserve.model.deepseek_v4.paged import PagedSequenceKV
from kvserve.request import Request
from kvserve.runner.batch import ModelInputs, pad_tables
from kvserve.runner.model_runner import EAGER_DRAIN_TOKENS, ModelRunner
from kvserve.runner.sampler import Sampler
from kvserve.runner.staging import upload
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import PreemptionCosts, ScheduledRequest, Scheduler, SchedulerOutput

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
    Attention: the Triton kernels on the whole batch ("triton"; replayed from
    CUDA graphs once captured) or the torch path per sequence through
    `PagedSequenceKV` ("torch")."""

    def __init__(self, model, layout: V4Layout, device: torch.device, seed: int,
                 attention_backend: str = "torch") -> None:
        self.model, self.layout, self.device = model, layout, device
        self.attention_backend = attention_backend
        self.sampler = Sampler(seed, device)
        self.kv_storage = torch.zeros(layout.num_blocks, layout.kv.unit, dtype=layout.dtype, device=device)
        self.graphs: V4Graphs | None = None
        self.mixed_graphs = None  # the generic runner's; V4 graphs serve mixed steps themselves
        self.kv_transfer, self.num_eager_forwards = None, 0
        self.drain_above_tokens = EAGER_DRAIN_TOKENS if device.type == "cuda" else None  # as ModelRunner's
        config: DeepseekV4Config = model.config
        self.rates = {"csa": config.compress_rate(CSA), "hca": config.compress_rate(HCA)}
        model.place_rope_tables(device)

    def logits_weight(self) -> torch.Tensor:
        return self.model.head.weight

    def block_major_kv(self) -> torch.Tensor:
        """A block is one page, a row of the storage: the host tier's copies move rows
        (a [1, 1, num_blocks, unit, 1, 1] view)."""
        return self.kv_storage.view(1, 1, *self.kv_storage.shape, 1, 1)

    def static_graphs(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                      mixed: bool = True, sizes: list[int] | None = None,
                      bounds: list[int] | None = None) -> V4Graphs:
        """Static buffers and batches of every bucket, nothing captured: the
        padded forward the graphs replay (on the CPU, run eagerly)."""
        if self.attention_backend != "triton":
            raise ValueError("DeepSeek V4 CUDA graphs need the Triton attention backend")
        return V4Graphs(self.model, self.kv_storage, self.layout.kv,
                        sizes or capture_sizes(max_num_seqs, max_num_batched_tokens, mixed),
                        bounds or context_buckets(max_model_len), max_num_seqs, mixed)

    def capture_graphs(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                       mixed: bool = True) -> None:
        """CUDA graphs for decode and (with `mixed`) mixed steps, in one pool.
        A forward that synchronises the host cannot be captured: graphs then
        stay off, with a warning, and every step runs eagerly."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        graphs = self.static_graphs(max_model_len, max_num_seqs, max_num_batched_tokens, mixed)
        reason = graphs.host_sync_reason()
        if reason is not None:
            logger.warning("DeepSeek V4 runs without CUDA graphs: its forward synchronises the host (%s)", reason)
            return
        graphs.capture(torch.cuda.graph_pool_handle())
        self.graphs = graphs

    def forward_step(self, step: V4Step) -> torch.Tensor:
        """Hidden states [T, hidden] of a step on the kernel path: replayed
        from its graph when one holds it, else eager."""
        key = self.graphs.bucket_for(step) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run(step, key)
        self.num_eager_forwards += 1
        from kvserve.model.deepseek_v4.kernels import V4PagedBatch
        batch = V4PagedBatch(self.kv_storage, self.layout.kv, step.block_tables, step.seq_idx, step.positions,
                             step.max_seq_len)
        return self.model.forward_tokens(step.input_ids, step.positions, [], [], batch)

    def _forward(self, inputs: ModelInputs, drain: Callable[[], None] | None = None) -> torch.Tensor:
        if drain is not None:   # before the whole launch: V4's forward has no per-layer launch point
            drain()
        if self.attention_backend == "triton":
            return self.forward_step(self._step(inputs))
        self.num_eager_forwards += 1
        meta = inputs.meta
        starts = [s - q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
        stores = [PagedSequenceKV(self.kv_storage, self.layout.kv, [t[i] for t in meta.block_tables], start,
                                  self.rates) for i, start in enumerate(starts)]
        return self.model.forward_tokens(inputs.input_ids, inputs.positions, meta.query_lens_cpu, stores)

    def _step(self, inputs: ModelInputs) -> V4Step:
        meta = inputs.meta
        return V4Step(inputs.input_ids, inputs.positions, upload(inputs.host.seq_idx.to(torch.int32), self.device),
                      meta.block_tables, meta.num_seqs, meta.max_seq_len)


def build_v4_engine_parts(args: EngineArgs):
    from kvserve.engine.builder import (EngineParts, _check_one_request_fits, _device_memory, plan_host_tier,
                                        resolve_device)
    from kvserve.model.loaders import resolve_dtype
    device = resolve_device(args.device)
    config = _config(args.model, args.hf_overrides)
    sched = args.scheduler_config(config.max_position_embeddings, *_device_memory(device))
    cache = args.cache_config()
    dtype = resolve_dtype(args.dtype, device)
    kv_layout = v4_kv_layout(config, cache.block_size)
    model = load_deepseek_v4(args.model, dtype, str(device), args.hf_overrides, args.seed)
    backend = _attention_backend(args.attention_backend, device, config)
    graphs = device.type == "cuda" and not args.enforce_eager and backend == "triton"
    layout = V4Layout(kv_layout, 2, dtype)
    num_blocks = _num_blocks(cache, sched, layout, model, device, backend, graphs)
    layout = V4Layout(kv_layout, num_blocks, dtype)
    host_tier = plan_host_tier(cache, layout)
    kv_cache = KVCacheManager(kv_layout.kv_groups(), num_blocks, cache.block_size, cache.enable_prefix_caching,
                              eviction_policy=cache.eviction_policy, host_tier=host_tier)
    _check_one_request_fits(kv_cache, sched)
    runner = V4Runner(model, layout, device, args.seed, backend)
    if host_tier is not None:
        runner.attach_host_tier(host_tier.num_blocks)
    log_layout(kv_layout, num_blocks, layout.bytes_per_block)
    log_plan(plan_v4_memory(num_blocks * layout.bytes_per_block, kv_layout, layout.bytes_per_block // kv_layout.unit),
             config)
    if device.type == "cuda" and backend == "triton":
        _warm_kernels(config, runner, sched.max_model_len, sched.max_num_batched_tokens)
    if graphs:
        runner.capture_graphs(sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens)
    if device.type == "cuda":
        runner.warm_logits(sched.max_num_seqs)
    costs = PreemptionCosts(cache.preemption_mode, cache.kv_copy_bandwidth_gbps * 1e9)
    return EngineParts(config, None, sched, kv_cache, Scheduler(sched, kv_cache, costs), runner,
                       frozenset(config.eos_token_ids))


def _warm_kernels(config: DeepseekV4Config, runner: V4Runner, max_model_len: int, max_tokens: int) -> None:
    """Build now, not in a served step, what a growing context or a step's size asks for
    (`kernels/warmup.py`): the indexer's top-k for every context up to max_model_len, the attention's
    prefill config, the Gluon attention's key bounds, the routed experts' kernels up to max_tokens."""
    from kvserve.model.deepseek_v4.kernels import warmup
    start = time.perf_counter()
    top_k = 0
    if CSA in config.layer_types:
        top_k = warmup.warm_top_k(runner.device, max_model_len, config.compress_rate(CSA), config.index_topk)
    batch = warmup.padding_batch(runner.kv_storage, runner.layout.kv, max_model_len)
    layers, heads, window = _compressed_layers(config, batch), config.num_attention_heads, config.sliding_window
    attention = warmup.warm_prefill_attention(batch, layers, heads, config.head_dim, window)
    small = warmup.warm_small_step_attention(batch, layers + _sliding_layer(config, batch), heads, config.head_dim,
                                             window)
    gluon = warmup.warm_gluon_attention(batch, layers, heads, config.head_dim, window)
    routed = warmup.warm_moe(runner.model.layers[0].ffn, max_tokens, runner.device)
    logger.info("built %d top-k, %d prefill attention, %d small-step attention, %d Gluon attention and %d "
                "routed-expert kernel sets (contexts up to %d tokens, steps up to %d) in %.1f s", top_k, attention,
                small, gluon, routed, max_model_len, max_tokens, time.perf_counter() - start)


def _sliding_layer(config: DeepseekV4Config, batch) -> list:
    """The first sliding-only layer's pages in `batch` (`warmup.AttentionPages`), if there is one."""
    from kvserve.model.deepseek_v4.kernels.warmup import AttentionPages
    if SLIDING not in config.layer_types:
        return []
    return [AttentionPages(batch.page("sliding", config.layer_types.index(SLIDING)), None, 0, None)]


def _compressed_layers(config: DeepseekV4Config, batch) -> list:
    """The first CSA and the first HCA layer's pages in `batch` (`warmup.AttentionPages`)."""
    from kvserve.model.deepseek_v4.kernels.warmup import AttentionPages
    layers = []
    for kind, layer_type in (("csa", CSA), ("hca", HCA)):
        if layer_type in config.layer_types:
            i = config.layer_types.index(layer_type)
            topk = config.index_topk if layer_type == CSA else None
            layers.append(AttentionPages(batch.page("sliding", i), batch.page(f"{kind}_entries", i),
                                         config.compress_rate(layer_type), topk))
    return layers


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


def _num_blocks(cache, sched, layout: V4Layout, model, device: torch.device, backend: str,
                graphs: bool) -> int:
    """An explicit count or memory, the CPU default, or on CUDA what
    `gpu_memory_utilization` leaves after weights and a profiled peak step."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gb is not None:
        return max(2, int(cache.kv_cache_memory_gb * 1024**3 // layout.bytes_per_block))
    if device.type == "cuda":
        from kvserve.runner.memory import kv_budget_bytes
        peak = profile_peak_bytes(model, layout, sched, device, backend, graphs)
        return max(2, kv_budget_bytes(cache.gpu_memory_utilization, peak, device) // layout.bytes_per_block)
    kv_layout = layout.kv
    per_seq = sum(kv_layout.blocks_per_sequence(sched.max_model_len, sched.max_num_batched_tokens).values())
    return max(per_seq + 1, min(4 * per_seq, CPU_DEFAULT_MAX_BYTES // layout.bytes_per_block))


def profile_peak_bytes(model, layout: V4Layout, sched, device: torch.device, backend: str, graphs: bool) -> int:
    """Device bytes (KV excluded) at the peak of the largest step: a prompt
    chunk of max_num_batched_tokens over as many sequences as run at once,
    sampled. With graphs, plus the static buffers and what the largest
    graph's forward allocates at the max_model_len bound (both stay held)."""
    lengths = _profile_lengths(sched.max_num_batched_tokens, sched.max_model_len, sched.max_num_seqs)
    scheduled, tables = _profile_step(lengths, layout.kv)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_blocks = 1 + sum(int((t > 0).sum()) for t in tables)
    runner = V4Runner(model, V4Layout(layout.kv, num_blocks, layout.dtype), device, 0, backend)
    kv_bytes = runner.kv_storage.numel() * runner.kv_storage.element_size()
    runner.execute(SchedulerOutput(scheduled), tables)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    if graphs:
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        static = runner.static_graphs(sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens)
        with torch.inference_mode():
            static.forward(static.keys()[0])  # all padding: writes no page
        torch.cuda.synchronize(device)
        peak += torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak


def _profile_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    return [n for n in (min(base + (i < extra), max_model_len - 1) for i in range(num_seqs)) if n > 0]


def _profile_step(lengths: list[int], kv_layout: V4KVLayout) -> tuple[list[ScheduledRequest], list[torch.Tensor]]:
    """Prompt steps of `lengths` tokens, every table slot its own block (ids from 1)."""
    scheduled = [ScheduledRequest(Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1)), n, 0)
                 for i, n in enumerate(lengths)]
    slots = [-(-n // kv_layout.block_size) for n in lengths]
    next_id, tables = 1, []
    for _ in kv_layout.groups:
        rows = []
        for count in slots:
            rows.append(list(range(next_id, next_id + count)))
            next_id += count
        tables.append(pad_tables(rows))
    return scheduled, tables


# The context the plan reports concurrency at (the bench's long-context load).
PLAN_CONTEXT = 32768


@dataclass(frozen=True)
class V4MemoryPlan:
    """The KV pool and how it splits over the page kinds when it is full of
    sequences of `context` tokens. The pool is shared (a block serves any
    group), so the split is the picture of that load, not a partition."""
    num_blocks: int
    block_bytes: int
    context: int
    blocks_per_seq: dict[str, int]  # per page kind, one decoding sequence of `context` tokens
    windows: dict[str, int]         # per window kind (sliding, state): tokens it keeps a sequence
    num_seqs: int                   # sequences of `context` tokens that fit at once
    max_context_tokens: int         # tokens of context the pool holds when windows are negligible

    @property
    def kind_blocks(self) -> dict[str, int]:
        """Blocks each page kind holds at `num_seqs` sequences."""
        return {kind: n * self.num_seqs for kind, n in self.blocks_per_seq.items()}


def plan_v4_memory(kv_bytes: int, layout: V4KVLayout, dtype_bytes: int,
                   context: int = PLAN_CONTEXT) -> V4MemoryPlan:
    """The plan of a pool of `kv_bytes` (block 0 is the null block). Decode
    steady state: window groups hold their window plus the one new token."""
    block_bytes = layout.unit * dtype_bytes
    num_blocks = kv_bytes // block_bytes
    usable = max(0, num_blocks - 1)
    per_seq = layout.blocks_per_sequence(context)
    windows = {g.kind.name: g.kind.spec.window for g in layout.groups if not isinstance(g.kind.spec, CompressedSpec)}
    # Blocks per token of context of the growing kinds (each group of a kind pages every token).
    per_token = sum(1 / max(layout.block_size, g.kind.spec.rate) for g in layout.groups
                    if isinstance(g.kind.spec, CompressedSpec))
    return V4MemoryPlan(num_blocks, block_bytes, context, per_seq, windows, usable // sum(per_seq.values()),
                        int(usable / per_token) if per_token else 0)


def log_plan(plan: V4MemoryPlan, config: DeepseekV4Config) -> None:
    usable = max(1, plan.num_blocks - 1)
    parts = []
    for kind, blocks in plan.kind_blocks.items():
        share = f"{blocks / usable:.1%} of the pool"
        if kind in plan.windows:
            parts.append(f"{kind}: window only ({plan.windows[kind]} tokens a sequence, {share})")
        else:
            parts.append(f"{kind}: {plan.num_seqs * plan.context:,} tokens ({share})")
    if "csa_entries" in plan.kind_blocks:
        index_share = config.index_head_dim / (config.head_dim + config.index_head_dim)
        parts.append(f"indexer: its keys are {index_share:.0%} of the csa_entries pages (same tokens)")
    logger.info("V4 KV plan: %d blocks of %.0f KiB (%.2f GiB); at %d-token contexts %d sequences fit "
                "(%s); windows aside the pool holds %s tokens of context", plan.num_blocks,
                plan.block_bytes / 1024, plan.num_blocks * plan.block_bytes / 1024**3, plan.context, plan.num_seqs,
                "; ".join(parts), f"{plan.max_context_tokens:,}")


def log_layout(kv_layout: V4KVLayout, num_blocks: int, block_bytes: int) -> None:
    kinds: dict[str, int] = {}
    for g in kv_layout.groups:
        kinds[g.kind.name] = kinds.get(g.kind.name, 0) + 1
    per_token = kv_layout.long_run_bytes_per_token(block_bytes // kv_layout.unit)
    logger.info("V4 KV cache: %d blocks x %d tokens (%d bytes each), groups: %s; long-run KV bytes/token: %s",
                num_blocks, kv_layout.block_size, block_bytes,
                ", ".join(f"{n} x{c}" for n, c in kinds.items()),
                ", ".join(f"{n} {b:.0f}" for n, b in per_token.items()) or "none (sliding only)")
