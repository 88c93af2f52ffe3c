"""Engine configuration: frozen dataclasses validated at construction.

Each knob's error names the value and the limit, so a user can act on it.
Configs are never mutated after construction; derived values are computed
once by `EngineConfig.create`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_BLOCK_SIZE = 256
EVICTION_POLICIES = ("lru", "reuse")
PREEMPTION_MODES = ("auto", "swap", "recompute")
SCHEDULING_POLICIES = ("fcfs", "prefix")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 0.0
    eviction_policy: str = "reuse"
    preemption_mode: str = "auto"
    kv_copy_bandwidth_gbps: float = 25.0

    def __post_init__(self) -> None:
        if self.cpu_kv_cache_gb < 0:
            raise ValueError(f"cpu_kv_cache_gb must be >= 0 (0 turns the host KV tier off), "
                             f"got {self.cpu_kv_cache_gb}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.cpu_kv_cache_gb == 0:
            raise ValueError("preemption_mode='swap' needs a host KV tier: set cpu_kv_cache_gb > 0")
        if self.kv_copy_bandwidth_gbps <= 0:
            raise ValueError(f"kv_copy_bandwidth_gbps must be > 0, got {self.kv_copy_bandwidth_gbps}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the reserved null block), "
                             f"got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    # > 0: while the head of the queue waits for KV space, every this many
    # steps the running request furthest ahead is preempted to let it in
    # (time-slicing the KV cache; see scheduler.py). 0 turns it off.
    kv_rotation_interval: int = 0
    # "fcfs": admit strictly in arrival order. "prefix": a waiting request that
    # shares its first block with a running, prefilled request may go first
    # (its prefix costs no new blocks); see scheduler.py.
    scheduling_policy: str = "fcfs"
    # > 0: a request computes at most this many tokens a step (vLLM's
    # long_prefill_token_threshold): a long prompt's chunks stay short beside
    # the decodes they share a step with. 0: only the step's budget bounds them.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.kv_rotation_interval < 0:
            raise ValueError(f"kv_rotation_interval must be >= 0, got {self.kv_rotation_interval}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got "
                             f"{self.long_prefill_token_threshold}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineArgs:
    """Everything `LLM(...)` and the CLI accept, before the model is known."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None  # None: vLLM's default for the device
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    seed: int = 0
    hf_overrides: dict[str, Any] | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    cpu_kv_cache_gb: float = 0.0
    eviction_policy: str = "reuse"
    preemption_mode: str = "auto"
    kv_copy_bandwidth_gbps: float = 25.0
    kv_rotation_interval: int = 0
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    # Ranks (GPUs of one host) each holding a shard of the model; 1: no
    # tensor parallelism, no extra process (kvserve/distributed/).
    tensor_parallel_size: int = 1
    # Who drives the engine: "llm" (offline batches) or "server"; picks the
    # default token budget, as vLLM's usage context does.
    usage: str = "llm"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.usage not in USAGES:
            raise ValueError(f"usage must be one of {', '.join(USAGES)}, got {self.usage!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config fields, got {self.hf_overrides!r}")
        self._check_tensor_parallel()
        # Validate cache knobs early, before any model loading.
        self.cache_config()

    def _check_tensor_parallel(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.cpu_kv_cache_gb > 0:
            raise ValueError(f"the host KV tier (cpu_kv_cache_gb={self.cpu_kv_cache_gb}) is not supported with "
                             f"tensor_parallel_size={self.tensor_parallel_size} yet; set cpu_kv_cache_gb=0")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                           num_kv_blocks=self.num_kv_blocks, kv_cache_memory_gb=self.kv_cache_memory_gb,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           cpu_kv_cache_gb=self.cpu_kv_cache_gb, eviction_policy=self.eviction_policy,
                           preemption_mode=self.preemption_mode,
                           kv_copy_bandwidth_gbps=self.kv_copy_bandwidth_gbps)

    def scheduler_config(self, model_max_len: int, device_memory_bytes: int = 0,
                         device_name: str = "") -> SchedulerConfig:
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum context "
                             f"length {model_max_len}")
        budget = self.max_num_batched_tokens or default_token_budget(
            self.usage, device_memory_bytes, device_name)
        max_num_seqs = (default_max_num_seqs(device_memory_bytes, device_name)
                        if self.max_num_seqs is None else self.max_num_seqs)
        return SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len,
                               kv_rotation_interval=self.kv_rotation_interval,
                               scheduling_policy=self.scheduling_policy,
                               long_prefill_token_threshold=self.long_prefill_token_threshold)


USAGES = ("llm", "server")


def default_max_num_seqs(device_memory_bytes: int, device_name: str = "") -> int:
    """vLLM's default for `max_num_seqs`: 1024 on a GPU of >= 70 GiB (not an
    A100), offline and served alike; 256 elsewhere. Under overload a server
    then admits long prompts instead of queueing them behind 256 long decodes."""
    return 1024 if _large_gpu(device_memory_bytes, device_name) else 256


def _large_gpu(device_memory_bytes: int, device_name: str) -> bool:
    return device_memory_bytes >= 70 * 2**30 and "a100" not in device_name.lower()


def default_token_budget(usage: str, device_memory_bytes: int, device_name: str = "") -> int:
    """vLLM's defaults for `max_num_batched_tokens`: on a GPU of >= 70 GiB
    (not an A100) 16384 for offline batches and 8192 for a server, where long
    prefill chunks would stall running streams; 8192 offline elsewhere
    (CPU included: the budget is the chunked-prefill size, not a memory size)."""
    if _large_gpu(device_memory_bytes, device_name):
        return 16384 if usage == "llm" else 8192
    return 8192
