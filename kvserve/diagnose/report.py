"""Diagnosis output: text for people, JSON for scripts, and the worst requests
with the reason each was slow."""
from __future__ import annotations

import json
from typing import Any

from kvserve.diagnose.rules import Finding, diagnose
from kvserve.diagnose.window import RequestSplit, Window

SUMMARY_KEYS = (("hit_rate", "prefix hit rate", "{:.1%}"), ("reusable_fraction", "reusable prefix", "{:.1%}"),
                ("kv_usage_mean", "KV usage mean", "{:.1%}"), ("kv_usage_max", "KV usage max", "{:.1%}"),
                ("evictions_per_s", "evictions/s", "{:.2f}"), ("preemptions_per_s", "preemptions/s", "{:.2f}"),
                ("arrivals_per_s", "arrivals/s", "{:.2f}"), ("finished_per_s", "finished/s", "{:.2f}"),
                ("waiting_mean", "queue depth mean", "{:.1f}"), ("waiting_slope_per_s", "queue trend /s", "{:+.2f}"),
                ("fragmentation_mean", "fragmentation", "{:.1%}"), ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"),
                ("ttft_queue_ms", " queueing ms", "{:.1f}"), ("ttft_prefill_ms", " prefill ms", "{:.1f}"),
                ("ttft_first_decode_ms", " first decode ms", "{:.1f}"),
                ("prefill_chunks_mean", "prefill chunks/prompt", "{:.1f}"),
                ("host_mb_per_s_to_gpu", "host->GPU MB/s", "{:.1f}"))


def why_slow(s: RequestSplit, cfg: dict[str, Any]) -> str:
    """The dominant part of one request's TTFT, in words with numbers."""
    parts = {"queued": s.queue_s, "prefill": s.prefill_s, "first decode": s.first_decode_s}
    top = max(parts, key=parts.get)
    reasons = [f"{top} {parts[top] * 1e3:.0f} ms of {s.ttft_s * 1e3:.0f} ms TTFT"]
    if s.num_chunks > 1:
        reasons.append(f"prompt {s.prompt_tokens} tokens in {s.num_chunks} chunks "
                       f"(budget {cfg.get('max_num_batched_tokens')})")
    if s.num_preemptions:
        reasons.append(f"preempted {s.num_preemptions}x, {s.lost_tokens} tokens recomputed")
    reasons.append(f"cache hit {s.cached_tokens}/{s.prompt_tokens} prompt tokens")
    return "; ".join(reasons)


def worst_requests(window: Window, n: int = 5) -> list[dict[str, Any]]:
    worst = sorted(window.splits, key=lambda s: -s.ttft_s)[:n]
    return [{"request_id": s.request_id, "ttft_ms": round(s.ttft_s * 1e3, 2),
             "e2e_ms": None if s.e2e_s is None else round(s.e2e_s * 1e3, 2),
             "why": why_slow(s, window.config)} for s in worst]


def analyze(window: Window) -> dict[str, Any]:
    evidence = window.evidence()
    findings = diagnose(evidence, window.config)
    return {"findings": [f.as_dict() for f in findings], "evidence": evidence,
            "worst_requests": worst_requests(window), "config": window.config}


def format_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=str)


def format_text(result: dict[str, Any]) -> str:
    ev, cfg = result["evidence"], result["config"]
    lines = [f"kvserve diagnose: {ev['window_s']:.1f} s window, block {cfg['block_size']}, "
             f"{cfg['num_blocks']} KV blocks, budget {cfg['max_num_batched_tokens']}, "
             f"prefix caching {'on' if cfg.get('enable_prefix_caching') else 'off'}", ""]
    lines += [f"  {label:<24}{fmt.format(ev[key])}" for key, label, fmt in SUMMARY_KEYS if key in ev]
    lines += ["", "findings (most severe first):"]
    for i, f in enumerate(result["findings"], 1):
        shown = ", ".join(f"{k}={_short(v)}" for k, v in f["evidence"].items())
        lines += [f"{i}. [{f['severity']}] {f['code']}", f"   evidence: {shown}", f"   fix: {f['fix']}"]
    if result["worst_requests"]:
        lines += ["", "slowest requests (TTFT):"]
        lines += [f"  {w['request_id']:>8}  {w['ttft_ms']:>9.1f} ms  {w['why']}" for w in result["worst_requests"]]
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)


__all__ = ["Finding", "analyze", "format_json", "format_text", "worst_requests"]
