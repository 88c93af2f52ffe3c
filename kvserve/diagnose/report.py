"""Diagnosis output: text for people, JSON for scripts, and the worst requests
(by TTFT and end to end) with the reasons each was slow."""
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
                ("requests_with_timeline", "requests (timelines)", "{:.0f}"),
                ("prefill_chunks_mean", "prefill chunks/prompt", "{:.1f}"),
                ("prompts_chunked_share", "prompts chunked", "{:.0%}"),
                ("host_mb_per_s_to_gpu", "host->GPU MB/s", "{:.1f}"))


def slow_reasons(s: RequestSplit, cfg: dict[str, Any], end_to_end: bool = False) -> list[tuple[str, str]]:
    """Why one request was slow, as (tag, numbers): preempted, queued long,
    chunked into many steps, cache miss (and long decode, end to end); its
    largest TTFT part when none applies."""
    ttft_ms = s.ttft_s * 1e3
    reasons = []
    if s.num_preemptions:
        reasons.append(("preempted", f"{s.num_preemptions}x, {s.lost_tokens} tokens recomputed"))
    if s.queue_s >= 0.5 * s.ttft_s:
        reasons.append(("queued long", f"{s.queue_s * 1e3:.0f} ms of {ttft_ms:.0f} ms TTFT"))
    if s.num_chunks > 1:
        reasons.append(("chunked into many steps", f"{s.prompt_tokens}-token prompt in {s.num_chunks} chunks "
                        f"(budget {cfg.get('max_num_batched_tokens')}), {s.prefill_s * 1e3:.0f} ms"))
    if 2 * s.cached_tokens < s.prompt_tokens:
        off = "" if cfg.get("enable_prefix_caching", True) else ", prefix caching off"
        reasons.append(("cache miss", f"{s.cached_tokens}/{s.prompt_tokens} prompt tokens from cache{off}"))
    decode_s = (s.e2e_s or 0.0) - s.ttft_s
    if end_to_end and decode_s > s.ttft_s:
        reasons.append(("long decode", f"{s.output_tokens} tokens in {decode_s * 1e3:.0f} ms"))
    if not reasons:
        parts = {"queued": s.queue_s, "prefill": s.prefill_s, "first decode": s.first_decode_s}
        top = max(parts, key=parts.get)
        reasons.append((top, f"{parts[top] * 1e3:.0f} ms of {ttft_ms:.0f} ms TTFT"))
    return reasons


def _worst_entry(s: RequestSplit, cfg: dict[str, Any], end_to_end: bool) -> dict[str, Any]:
    reasons = slow_reasons(s, cfg, end_to_end)
    return {"request_id": s.request_id, "ttft_ms": round(s.ttft_s * 1e3, 2),
            "e2e_ms": None if s.e2e_s is None else round(s.e2e_s * 1e3, 2),
            "queue_ms": round(s.queue_s * 1e3, 2), "prefill_ms": round(s.prefill_s * 1e3, 2),
            "first_decode_ms": round(s.first_decode_s * 1e3, 2), "prefill_chunks": s.num_chunks,
            "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "reasons": [tag for tag, _ in reasons], "why": "; ".join(f"{tag}: {text}" for tag, text in reasons)}


def worst_requests(window: Window, n: int = 5) -> dict[str, list[dict[str, Any]]]:
    """The n slowest requests by TTFT and by end-to-end latency."""
    by_ttft = sorted(window.splits, key=lambda s: -s.ttft_s)[:n]
    by_e2e = sorted((s for s in window.splits if s.e2e_s is not None), key=lambda s: -s.e2e_s)[:n]
    return {"ttft": [_worst_entry(s, window.config, False) for s in by_ttft],
            "e2e": [_worst_entry(s, window.config, True) for s in by_e2e]}


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
    worst = result["worst_requests"]
    for key, title in (("ttft", "slowest requests (TTFT):"), ("e2e", "slowest requests (end to end):")):
        if worst[key]:
            lines += ["", title]
            lines += [f"  {w['request_id']:>8}  {w[key + '_ms']:>9.1f} ms  {w['why']}" for w in worst[key]]
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)


__all__ = ["Finding", "analyze", "format_json", "format_text", "worst_requests"]
