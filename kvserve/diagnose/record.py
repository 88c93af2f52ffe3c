"""Diagnosis records: the engine's configuration, metric samples over time and
finished requests' timelines, as one JSON file `kvserve diagnose --offline`
reads. Written by `drive.run_recorded`, `kvserve bench sweep --save-records`,
or from any `LLM` with `MetricsRecorder`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

RECORD_KIND = "kvserve-diagnosis-record"
RECORD_VERSION = 1


def engine_config(engine) -> dict[str, Any]:
    """What the rules need to know about the engine's settings."""
    kv, sched = engine.kv_cache, engine.scheduler_config
    host = kv.host_tier
    return {"model": engine.args.model or "embedded", "block_size": kv.block_size,
            "num_blocks": kv.pool.num_blocks, "bytes_per_block": engine.runner.layout.bytes_per_block,
            "enable_prefix_caching": kv.enable_prefix_caching,
            "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
            "max_model_len": sched.max_model_len, "cpu_kv_cache_gb": engine.args.cpu_kv_cache_gb,
            "num_host_blocks": 0 if host is None else host.num_blocks,
            "eviction_policy": engine.args.eviction_policy}


def config_from_labels(labels: dict[str, str]) -> dict[str, Any]:
    """The same keys from the server's cache_config labels (all strings)."""
    return {"model": labels.get("model_name"), "block_size": int(labels["block_size"]),
            "num_blocks": int(labels["num_blocks"]),
            "enable_prefix_caching": str(labels.get("enable_prefix_caching")).lower() == "true",
            "max_num_batched_tokens": int(labels["max_num_batched_tokens"]),
            "max_num_seqs": int(labels["max_num_seqs"]), "max_model_len": int(labels["max_model_len"])}


@dataclass
class Record:
    config: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": RECORD_KIND, "version": RECORD_VERSION, "config": self.config,
                "samples": self.samples, "requests": self.requests}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


def load_record(path: str) -> Record:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND:
        raise ValueError(f"{path} is not a kvserve diagnosis record (expected kind={RECORD_KIND!r})")
    if data.get("version") != RECORD_VERSION:
        raise ValueError(f"{path}: record version {data.get('version')} is not supported "
                         f"(this kvserve reads version {RECORD_VERSION})")
    return Record(data["config"], data["samples"], data["requests"])


class MetricsRecorder:
    """Samples `llm.get_metrics()` at most every `period_s` (call `maybe_sample`
    from a step loop, or `sample` by hand) and builds a Record."""

    def __init__(self, llm, period_s: float = 0.1) -> None:
        self.engine = getattr(llm, "engine", llm)
        self.period_s = period_s
        self.record = Record(engine_config(self.engine))
        self._last = -float("inf")

    def sample(self) -> None:
        now = time.monotonic()
        self.record.samples.append({"t": now, "metrics": self.engine.get_metrics()})
        self._last = now

    def maybe_sample(self) -> None:
        if time.monotonic() - self._last >= self.period_s:
            self.sample()

    def finish(self, outputs=()) -> Record:
        """Last sample, plus the given outputs' timelines (else the engine's recent ones)."""
        self.sample()
        self.record.requests = ([_output_record(o) for o in outputs] if outputs
                                else self.engine.recorder.recent_requests())
        return self.record


def _output_record(output) -> dict[str, Any]:
    m = output.metrics
    return {"request_id": output.request_id, "prompt_tokens": len(output.prompt_token_ids),
            "output_tokens": len(output.outputs[0].token_ids), "cached_tokens": output.num_cached_tokens,
            "num_preemptions": m.num_preemptions, "timeline": m.timeline}
