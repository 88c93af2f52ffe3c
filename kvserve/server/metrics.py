"""Prometheus metrics of one server, vLLM-style names under `kvserve:`.

Gauges and counters are read from a snapshot of `LLMEngine.get_metrics()`
that the engine core ships with its step outputs (at most every 100 ms, and
when it goes idle), so a scrape never touches the engine. Counters come from
the engine's cumulative counts (exact and monotonic). Histograms are observed
on the API side as outputs arrive: inter-token latency per token, the rest
once per finished request from its timestamps.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# snapshot key -> (metric name, help); gauges then counters.
GAUGES = {
    "kv_cache_usage_perc": ("kvserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    "kv_cache_fragmentation": ("kvserve:kv_cache_fragmentation",
                               "Share of slots in held KV blocks that hold no token (0-1)."),
    "num_requests_running": ("kvserve:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("kvserve:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_host_usage_perc": ("kvserve:kv_host_usage_perc", "Fraction of host KV tier slots in use (0-1)."),
    "num_requests_swapped": ("kvserve:num_requests_swapped", "Requests whose KV is swapped out to host."),
}
COUNTERS = {
    "prefix_cache_queries": ("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("kvserve:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "kv_cache_evictions": ("kvserve:kv_cache_evictions",
                           "Cached blocks evicted to make room for new allocations."),
    "num_preemptions": ("kvserve:num_preemptions", "Requests preempted (KV freed, recomputed later)."),
    "num_kv_rotations": ("kvserve:num_kv_rotations",
                         "Preemptions made to rotate a KV-blocked request in (kv_rotation_interval)."),
    "num_generation_tokens": ("kvserve:generation_tokens", "Tokens generated."),
    "kv_host_hit_tokens": ("kvserve:kv_host_hit_tokens", "Prompt tokens whose KV was loaded from the host tier."),
    "kv_host_blocks_to_host": ("kvserve:kv_host_blocks_to_host", "KV blocks copied GPU -> host."),
    "kv_host_blocks_to_gpu": ("kvserve:kv_host_blocks_to_gpu", "KV blocks copied host -> GPU."),
    "kv_host_bytes_to_host": ("kvserve:kv_host_bytes_to_host", "KV bytes copied GPU -> host."),
    "kv_host_bytes_to_gpu": ("kvserve:kv_host_bytes_to_gpu", "KV bytes copied host -> GPU."),
    "kv_host_blocks_prefetched": ("kvserve:kv_host_blocks_prefetched",
                                  "KV blocks loaded host -> GPU a step ahead (load-ahead admission)."),
    "num_load_ahead_admissions": ("kvserve:num_load_ahead_admissions",
                                  "Requests admitted a step ahead so their host loads overlap a forward."),
    "num_prefix_overtakes": ("kvserve:num_prefix_overtakes",
                             "Admissions ahead of the queue head (scheduling_policy=prefix)."),
    "kv_host_load_wait_s": ("kvserve:kv_host_load_wait_seconds",
                            "Time the forward pass waited for GPU<->host KV copies."),
    "kv_host_swap_outs": ("kvserve:kv_host_swap_outs", "Preemptions that swapped a request's KV to host."),
    "kv_host_swap_ins": ("kvserve:kv_host_swap_ins", "Swapped requests resumed from host KV."),
    "kv_host_swap_drops": ("kvserve:kv_host_swap_drops",
                           "Swaps abandoned because their cached prefix left both tiers (recomputed)."),
    "kv_host_evictions": ("kvserve:kv_host_evictions", "Cached blocks evicted from the host tier."),
    "kv_host_write_backs": ("kvserve:kv_host_write_backs",
                            "Freed cached blocks copied to the host tier in the background."),
}


# vLLM's names for the same series (--enable-vllm-metrics), labelled model_name,
# so dashboards and autoscalers written for vLLM read this server unchanged.
VLLM_GAUGES = {"kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
               "num_requests_running": "vllm:num_requests_running",
               "num_requests_waiting": "vllm:num_requests_waiting"}
VLLM_COUNTERS = {"prefix_cache_queries": "vllm:prefix_cache_queries",
                 "prefix_cache_hits": "vllm:prefix_cache_hits",
                 "num_preemptions": "vllm:num_preemptions",
                 "num_generation_tokens": "vllm:generation_tokens"}
VLLM_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_prefill_time_seconds")


class ServerMetrics:
    def __init__(self, cache_info: dict[str, str], model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._snapshot: dict[str, Any] = {}
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.registry.register(_SnapshotCollector(self))
        info = Info("kvserve:cache_config", "KV cache configuration.", registry=self.registry)
        info.info({"model_name": model_name, **cache_info})
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=self.registry)
        self.request_success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=self.registry)
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between consecutive tokens.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = self._histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self._vllm = _VllmSeries(self.registry, model_name) if vllm_names else None

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(f"kvserve:{name}", doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    # -- engine thread ---------------------------------------------------------------
    def update(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = dict(snapshot)  # one reference swap: scrapes see a whole snapshot

    def count_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        if self._vllm is not None:
            self._vllm.prompt_tokens.inc(num_tokens)

    def observe_inter_token(self, seconds: float) -> None:
        self._observe("inter_token_latency_seconds", self.itl, seconds)

    def observe_finished(self, request, reason: str) -> None:
        self.request_success.labels(finished_reason=reason).inc()
        if self._vllm is not None:
            self._vllm.success.labels(model_name=self.model_name, finished_reason=reason).inc()
        if reason in ("abort", "error"):
            return
        arrival, scheduled = request.arrival_time, request.first_scheduled_time
        first, done = request.first_token_time, request.finished_time
        if first is not None:
            self._observe("time_to_first_token_seconds", self.ttft, first - arrival)
        if done is not None:
            self._observe("e2e_request_latency_seconds", self.e2e, done - arrival)
        if scheduled is not None:
            self._observe("request_queue_time_seconds", self.queue_time, scheduled - arrival)
            if first is not None:
                self._observe("request_prefill_time_seconds", self.prefill_time, first - scheduled)

    def _observe(self, name: str, histogram: Histogram, seconds: float) -> None:
        histogram.observe(seconds)
        if self._vllm is not None:
            self._vllm.histograms[name].labels(model_name=self.model_name).observe(seconds)

    # -- any thread ------------------------------------------------------------------
    @property
    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        snapshot = self.metrics.snapshot
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(snapshot.get(key, 0)))
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(snapshot.get(key, 0)))
        if self.metrics.vllm_names:
            yield from self._vllm_families(snapshot)

    def _vllm_families(self, snapshot: dict[str, Any]) -> Iterator[Any]:
        label = [self.metrics.model_name]
        for families, kind in ((VLLM_GAUGES, GaugeMetricFamily), (VLLM_COUNTERS, CounterMetricFamily)):
            for key, name in families.items():
                doc = (GAUGES.get(key) or COUNTERS.get(key))[1]
                family = kind(name, doc, labels=["model_name"])
                family.add_metric(label, float(snapshot.get(key, 0)))
                yield family


class _VllmSeries:
    """The vLLM-named counters and histograms observed by the engine thread."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.",
                                     ["model_name"], registry=registry).labels(model_name=model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=registry)
        self.histograms = {name: Histogram(f"vllm:{name}", name.replace("_", " "), ["model_name"],
                                           buckets=LATENCY_BUCKETS, registry=registry)
                           for name in VLLM_HISTOGRAMS}


def cache_info(engine) -> dict[str, str]:
    """Labels of the kvserve:cache_config info metric."""
    kv, sched = engine.kv_cache, engine.scheduler_config
    groups = "; ".join(f"{i}:{g.spec.describe()}x{len(g.layer_ids)}" for i, g in enumerate(kv.groups))
    return {"block_size": str(kv.block_size), "num_blocks": str(kv.pool.num_blocks),
            "num_groups": str(len(kv.groups)), "groups": groups,
            "enable_prefix_caching": str(kv.enable_prefix_caching).lower(),
            "max_model_len": str(sched.max_model_len),
            "max_num_batched_tokens": str(sched.max_num_batched_tokens),
            "max_num_seqs": str(sched.max_num_seqs)}
