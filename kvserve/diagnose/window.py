"""Evidence from a window of metric samples and request timelines.

A sample is `{"t": seconds, "metrics": LLMEngine.get_metrics()}`; counters
are cumulative, so a rate is (last - first) / duration. Gauges (KV usage,
queue depth, fragmentation) are averaged over the samples; the queue's trend
is a least-squares slope. Request timelines (`Request.timeline()`) give the
TTFT split: queueing (arrival -> first scheduled), prefill (-> the last
prompt chunk before the first token) and first decode (-> the first token's
read-back), and the number of chunks each prompt took.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestSplit:
    """One request's TTFT split and what happened to it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    first_decode_s: float
    num_chunks: int
    num_preemptions: int
    lost_tokens: int      # KV computed then dropped by preemptions
    e2e_s: float | None

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.first_decode_s


def split_request(record: dict[str, Any]) -> RequestSplit | None:
    """None for a request that never produced a token."""
    events = record["timeline"]
    times = {e["event"]: e["t"] for e in reversed(events)}  # first occurrence wins
    if "first_token" not in times or "scheduled" not in times:
        return None
    arrival, scheduled, first = times["arrival"], times["scheduled"], times["first_token"]
    chunks = [e for e in events if e["event"] == "prefill" and e["t"] <= first]
    last_chunk = chunks[-1]["t"] if chunks else scheduled
    lost = sum(e["tokens"] for e in events if e["event"] == "preempted")
    finish = times.get("finish")
    return RequestSplit(record["request_id"], record["prompt_tokens"], record["output_tokens"],
                        record["cached_tokens"], scheduled - arrival, max(last_chunk - scheduled, 0.0),
                        max(first - last_chunk, 0.0), len(chunks), record["num_preemptions"], lost,
                        None if finish is None else finish - arrival)


class Series:
    """Metric samples in time order: counter deltas and rates, gauges, trends."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    @property
    def duration_s(self) -> float:
        return max(self.samples[-1]["t"] - self.samples[0]["t"], 1e-9)

    def delta(self, key: str) -> float:
        return float(self.samples[-1]["metrics"].get(key, 0) - self.samples[0]["metrics"].get(key, 0))

    def rate(self, key: str) -> float:
        return self.delta(key) / self.duration_s

    def gauge(self, key: str) -> np.ndarray:
        return np.asarray([s["metrics"].get(key, 0.0) for s in self.samples], dtype=float)

    def slope_per_s(self, key: str) -> float:
        t = np.asarray([s["t"] for s in self.samples], dtype=float)
        if np.ptp(t) <= 0:
            return 0.0
        return float(np.polyfit(t - t[0], self.gauge(key), 1)[0])

    def until_last_arrival(self) -> "Series":
        """Samples up to the first one showing every arrival: queue growth means
        overload only while traffic keeps coming (an offline run ends with a drain)."""
        final = self.samples[-1]["metrics"].get("num_requests_arrived", 0)
        for i, s in enumerate(self.samples):
            if s["metrics"].get("num_requests_arrived", 0) >= final:
                return Series(self.samples[:max(i + 1, 2)])
        return self


@dataclass
class Window(Series):
    samples: list[dict[str, Any]]
    config: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.samples) < 2:
            raise ValueError(f"a diagnosis needs at least 2 metric samples, got {len(self.samples)}")
        self.splits = [s for s in map(split_request, self.requests) if s is not None]
        self.arriving = self.until_last_arrival()

    def evidence(self) -> dict[str, Any]:
        ev = {"window_s": round(self.duration_s, 3), **self._traffic(), **self._cache(), **self._queue()}
        ev.update(self._latency())
        return ev

    def _traffic(self) -> dict[str, Any]:
        arrived, finished = self.delta("num_requests_arrived"), self.delta("num_requests_finished")
        prompt_tokens = self.delta("prompt_tokens_arrived")
        mean_prompt = prompt_tokens / arrived if arrived else _mean([s.prompt_tokens for s in self.splits])
        mean_output = (self.delta("num_generation_tokens") / finished if finished
                       else _mean([s.output_tokens for s in self.splits]))
        return {"requests_arrived": arrived, "requests_finished": finished,
                "arrivals_per_s": arrived / self.duration_s, "finished_per_s": finished / self.duration_s,
                "mean_prompt_tokens": mean_prompt, "mean_output_tokens": mean_output}

    def _cache(self) -> dict[str, Any]:
        queries, prompt_tokens = self.delta("prefix_cache_queries"), self.delta("prompt_tokens_arrived")
        usage = self.gauge("kv_cache_usage_perc")
        reusable = {int(k.rsplit("bs", 1)[1]): self.delta(k) / prompt_tokens if prompt_tokens else 0.0
                    for k in self.samples[-1]["metrics"] if k.startswith("prefix_reusable_tokens_bs")}
        return {"hit_rate": self.delta("prefix_cache_hits") / queries if queries else 0.0,
                "reusable_fraction": self.delta("prefix_reusable_tokens") / prompt_tokens if prompt_tokens else 0.0,
                "reusable_fraction_by_block_size": reusable,
                "evictions": self.delta("kv_cache_evictions"), "evictions_per_s": self.rate("kv_cache_evictions"),
                "preemptions": self.delta("num_preemptions"), "preemptions_per_s": self.rate("num_preemptions"),
                "kv_usage_mean": float(usage.mean()), "kv_usage_max": float(usage.max()),
                "kv_usage_full_share": float((usage >= 0.95).mean()),
                "fragmentation_mean": float(self.gauge("kv_cache_fragmentation").mean()),
                "host_hit_tokens": self.delta("kv_host_hit_tokens"),
                "host_mb_per_s_to_gpu": self.rate("kv_host_bytes_to_gpu") / 1e6,
                "host_mb_per_s_to_host": self.rate("kv_host_bytes_to_host") / 1e6}

    def _queue(self) -> dict[str, Any]:
        """Queue depth over the whole window; its trend and the arrival and
        completion rates over the arrival period."""
        waiting, running, arriving = self.gauge("num_requests_waiting"), self.gauge("num_requests_running"), self.arriving
        return {"waiting_mean": float(waiting.mean()), "waiting_first": float(arriving.gauge("num_requests_waiting")[0]),
                "waiting_last": float(arriving.gauge("num_requests_waiting")[-1]),
                "waiting_slope_per_s": arriving.slope_per_s("num_requests_waiting"),
                "arrival_window_s": arriving.duration_s,
                "arrival_period_arrivals_per_s": arriving.rate("num_requests_arrived"),
                "arrival_period_finished_per_s": arriving.rate("num_requests_finished"),
                "arrival_samples": len(arriving.samples), "largest_burst_share": self._largest_burst(),
                "running_mean": float(running.mean()), "running_max": float(running.max())}

    def _largest_burst(self) -> float:
        """Largest share of all arrivals between two samples (1.0: one burst)."""
        arrived = self.arriving.gauge("num_requests_arrived")
        total = arrived[-1] - arrived[0]
        return float(np.diff(arrived).max() / total) if total > 0 else 1.0

    def _latency(self) -> dict[str, Any]:
        if not self.splits:
            return {"requests_with_timeline": 0}
        ttft = np.asarray([s.ttft_s for s in self.splits]) * 1e3
        return {"requests_with_timeline": len(self.splits),
                "ttft_mean_ms": float(ttft.mean()), "ttft_p95_ms": float(np.percentile(ttft, 95)),
                "ttft_queue_ms": _mean([s.queue_s for s in self.splits]) * 1e3,
                "ttft_prefill_ms": _mean([s.prefill_s for s in self.splits]) * 1e3,
                "ttft_first_decode_ms": _mean([s.first_decode_s for s in self.splits]) * 1e3,
                "prefill_chunks_mean": _mean([s.num_chunks for s in self.splits]),
                "prompts_chunked_share": _mean([s.num_chunks > 1 for s in self.splits]),
                "recomputed_tokens": sum(s.lost_tokens for s in self.splits)}


def _mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else 0.0
