"""Findings: evidence -> ranked (code, severity, evidence, fix).

Each rule is a small function of the window's evidence and the engine's
configuration that returns a Finding or None. Codes are stable (scripts and
tests match on them). A fix names the flag, the value and the effect to
expect. Ranking: critical, then warning, then `healthy` (emitted only when
nothing is critical or a warning), then info; within a severity the larger
`score` (the size of the problem) comes first.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

SEVERITY_RANK = {"critical": 3, "warning": 2, "ok": 1.5, "info": 1}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    evidence: dict[str, Any]
    fix: str
    score: float = 0.0

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"severity must be one of {', '.join(SEVERITY_RANK)}, got {self.severity!r}")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("score")
        return out


Rule = Callable[[dict[str, Any], dict[str, Any]], "Finding | None"]


def _round(ev: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: (round(ev[k], 4) if isinstance(ev[k], float) else ev[k]) for k in keys if k in ev}


def _ceil_to(value: float, multiple: int) -> int:
    return int(math.ceil(max(value, 1) / multiple) * multiple)


def _tokens_per_request(ev: dict[str, Any]) -> float:
    return max(ev["mean_prompt_tokens"] + ev["mean_output_tokens"], 1.0)


def _gb(num_blocks: int, cfg: dict[str, Any]) -> str:
    per_block = cfg.get("bytes_per_block")
    return f" (--kv-cache-memory-gb {num_blocks * per_block / 1e9:.2f})" if per_block else ""


def kv_cache_capacity(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    """Preemption storm with the KV pool pinned near full."""
    finished = max(ev["requests_finished"], 1.0)
    per_request = ev["preemptions"] / finished
    if ev["preemptions"] < 2 or per_request < 0.1 or ev["kv_usage_max"] < 0.9:
        return None
    block, blocks = cfg["block_size"], cfg["num_blocks"]
    per_seq = _tokens_per_request(ev)
    fits = max(int((blocks - 1) * block // per_seq), 1)
    want = max(int(ev["running_max"]), fits + 1)
    need = _ceil_to(want * per_seq / block * 1.1, 1) + 1
    fix = (f"--num-kv-blocks {need}{_gb(need, cfg)}: room for {want} concurrent requests of ~{per_seq:.0f} "
           f"tokens (now {fits}); or --max-num-seqs {fits} to stop preempting. Expected: preemptions "
           f"{ev['preemptions']:.0f} -> ~0 and ~{ev.get('recomputed_tokens', 0):.0f} recomputed tokens saved")
    evidence = _round({**ev, "preemptions_per_request": per_request, "requests_that_fit": fits},
                      "preemptions", "preemptions_per_s", "preemptions_per_request", "kv_usage_max",
                      "kv_usage_mean", "kv_usage_full_share", "running_max", "requests_that_fit",
                      "recomputed_tokens", "waiting_mean")
    return Finding("kv_cache_capacity", "critical" if per_request >= 0.25 else "warning", evidence, fix,
                   score=per_request)


def _lost_reuse(ev: dict[str, Any]) -> float:
    return ev["reusable_fraction"] - ev["hit_rate"]


def prefix_cache_thrash(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    """Hit rate far below the reusable fraction while cached blocks are evicted."""
    reusable = ev["reusable_fraction"]
    if (not cfg.get("enable_prefix_caching", True) or reusable < 0.2 or ev["evictions"] <= 0
            or ev["hit_rate"] >= 0.7 * reusable):
        return None
    unique_tokens = ev["mean_prompt_tokens"] * ev["requests_arrived"] * (1 - reusable)
    extra_blocks = _ceil_to(unique_tokens / cfg["block_size"], 1)
    per_block = cfg.get("bytes_per_block")
    if per_block and not cfg.get("cpu_kv_cache_gb"):
        fix = (f"--cpu-kv-cache-gb {max(extra_blocks * per_block / 1e9, 0.01):.2f} (a host tier holding the "
               f"{extra_blocks} blocks of distinct prompt content seen in the window), or --num-kv-blocks "
               f"{cfg['num_blocks'] + extra_blocks} or more")
    else:
        fix = (f"--num-kv-blocks {cfg['num_blocks'] + extra_blocks} or more (room for the distinct prompt "
               f"content seen in the window; a longer window gives a better bound)")
    fix += (f". Expected: hit rate {ev['hit_rate']:.0%} -> up to {reusable:.0%}, "
            f"~{_lost_reuse(ev) * ev['mean_prompt_tokens'] * ev['requests_arrived']:.0f} prompt tokens not recomputed")
    severity = "critical" if _lost_reuse(ev) >= 0.3 else "warning"
    evidence = _round(ev, "hit_rate", "reusable_fraction", "evictions", "evictions_per_s", "kv_usage_mean",
                      "host_hit_tokens")
    return Finding("prefix_cache_thrash", severity, evidence, fix, score=_lost_reuse(ev))


def prefix_caching_disabled(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    reusable = ev["reusable_fraction"]
    if cfg.get("enable_prefix_caching", True) or reusable < 0.1:
        return None
    saved = reusable * ev["mean_prompt_tokens"] * ev["requests_arrived"]
    fix = (f"--enable-prefix-caching. Expected: up to {reusable:.0%} of prompt tokens "
           f"(~{saved:.0f} in this window) served from the cache instead of recomputed, with lower TTFT")
    evidence = _round({**ev, "enable_prefix_caching": False}, "enable_prefix_caching", "reusable_fraction",
                      "mean_prompt_tokens", "requests_arrived")
    return Finding("prefix_caching_disabled", "critical" if reusable >= 0.3 else "warning", evidence, fix,
                   score=reusable)


def recommended_budget(ev: dict[str, Any], cfg: dict[str, Any]) -> tuple[int, str]:
    """The sizing rule: mean sequence length x target concurrency x 1.5, with measured numbers."""
    per_seq = _tokens_per_request(ev)
    concurrency = max(min(ev["running_max"], cfg.get("max_num_seqs", 1 << 30)), 1.0)
    value = _ceil_to(per_seq * concurrency * 1.5, cfg["block_size"])
    value = max(value, _ceil_to(ev["mean_prompt_tokens"], cfg["block_size"]))
    return value, f"{per_seq:.0f} tokens x {concurrency:.0f} concurrent x 1.5"


def token_budget_too_small(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    """TTFT dominated by waiting while prompts are chunked into many steps."""
    chunks, ttft = ev.get("prefill_chunks_mean", 0.0), ev.get("ttft_mean_ms", 0.0)
    budget = cfg["max_num_batched_tokens"]
    waiting_ms = ev.get("ttft_queue_ms", 0.0) + ev.get("ttft_prefill_ms", 0.0)
    if chunks < 3 or ttft <= 0 or waiting_ms < 0.5 * ttft or ev["mean_prompt_tokens"] < 2 * budget:
        return None
    value, rule = recommended_budget(ev, cfg)
    fix = (f"--max-num-batched-tokens {value} ({rule}). Expected: a prompt of ~{ev['mean_prompt_tokens']:.0f} "
           f"tokens prefilled in {math.ceil(ev['mean_prompt_tokens'] / value)} step(s) instead of "
           f"~{chunks:.0f}, cutting the {waiting_ms / ttft:.0%} of TTFT spent queued and chunking")
    evidence = _round({**ev, "max_num_batched_tokens": budget, "waiting_share_of_ttft": waiting_ms / ttft},
                      "max_num_batched_tokens", "mean_prompt_tokens", "prefill_chunks_mean",
                      "prompts_chunked_share", "ttft_mean_ms", "ttft_queue_ms", "ttft_prefill_ms",
                      "ttft_first_decode_ms", "waiting_share_of_ttft")
    return Finding("token_budget_too_small", "critical" if chunks >= 8 else "warning", evidence, fix,
                   score=chunks / 10)


def block_size_mismatch(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    """Hit granularity or fragmentation says another block size fits the traffic."""
    block, by_size = cfg["block_size"], ev.get("reusable_fraction_by_block_size", {})
    here = by_size.get(block, ev["reusable_fraction"])
    smaller = {b: f for b, f in by_size.items() if b < block}
    if cfg.get("enable_prefix_caching", True) and smaller:
        best = max(smaller, key=lambda b: (smaller[b], b))
        gain = smaller[best] - here
        if gain >= 0.05 and smaller[best] >= 1.15 * here:
            fix = (f"--block-size {best}. Expected: reusable prefix {here:.0%} -> {smaller[best]:.0%} of prompt "
                   f"tokens (shared prefixes end mid-block at {block})")
            evidence = _round({**ev, "block_size": block}, "block_size", "reusable_fraction_by_block_size",
                              "hit_rate", "fragmentation_mean")
            return Finding("block_size_mismatch", "warning", evidence, fix, score=gain)
    if ev["fragmentation_mean"] >= 0.3 and block >= 16:
        fix = (f"--block-size {block // 2}. Expected: fragmentation {ev['fragmentation_mean']:.0%} -> about half, "
               f"freeing KV for more concurrent requests")
        evidence = _round({**ev, "block_size": block}, "block_size", "fragmentation_mean", "mean_prompt_tokens")
        return Finding("block_size_mismatch", "warning", evidence, fix, score=ev["fragmentation_mean"])
    return None


def engine_overloaded(ev: dict[str, Any], cfg: dict[str, Any]) -> Finding | None:
    """The queue grows while requests keep arriving at a steady rate."""
    arrivals, finished = ev["arrival_period_arrivals_per_s"], ev["arrival_period_finished_per_s"]
    growth = ev["waiting_slope_per_s"] * ev["arrival_window_s"]
    steady = ev["arrival_samples"] >= 4 and ev["largest_burst_share"] <= 0.5
    if (not steady or ev["requests_arrived"] < 5 or growth < max(3.0, 0.2 * ev["running_mean"])
            or finished >= 0.9 * arrivals):
        return None
    replicas = math.ceil(arrivals / max(finished, 1e-9))
    fix = (f"arrivals {arrivals:.2f} req/s exceed completions {finished:.2f} req/s: send at most "
           f"{finished:.2f} req/s per replica, or run {replicas} replicas")
    if ev["running_max"] >= cfg.get("max_num_seqs", 1 << 30) and ev["kv_usage_max"] < 0.8:
        fix += f"; KV is not full, so --max-num-seqs {2 * cfg['max_num_seqs']} may also raise completions"
    fix += ". Expected: the queue stops growing and queueing delay stops rising"
    evidence = _round(ev, "arrival_period_arrivals_per_s", "arrival_period_finished_per_s", "arrival_window_s",
                      "largest_burst_share", "waiting_first", "waiting_last",
                      "waiting_slope_per_s", "running_mean", "kv_usage_mean", "ttft_queue_ms")
    return Finding("engine_overloaded", "critical", evidence, fix, score=1 - finished / max(arrivals, 1e-9))


RULES: tuple[Rule, ...] = (kv_cache_capacity, prefix_cache_thrash, prefix_caching_disabled,
                           token_budget_too_small, block_size_mismatch, engine_overloaded)
# Findings that slow completions down themselves: with one of them, a growing
# queue is its symptom, and adding replicas would pay for the misconfiguration.
OVERLOAD_CAUSES = ("kv_cache_capacity", "token_budget_too_small")


def _symptom_after_cause(findings: list[Finding]) -> list[Finding]:
    causes = [f.code for f in findings if f.code in OVERLOAD_CAUSES]
    if not causes:
        return findings
    return [dataclasses.replace(f, severity="warning", score=-1.0, fix=f"apply the {' and '.join(causes)} fix "
                                f"first (it slows completions), then re-check; if the queue still grows: {f.fix}")
            if f.code == "engine_overloaded" else f for f in findings]


def diagnose(ev: dict[str, Any], cfg: dict[str, Any]) -> list[Finding]:
    """All findings, most severe first; `healthy` when nothing is a problem."""
    if ev["requests_arrived"] <= 0 and ev["requests_finished"] <= 0 and ev.get("requests_with_timeline", 0) == 0:
        return [Finding("no_traffic", "info", _round(ev, "window_s"), "send traffic during the window")]
    findings = _symptom_after_cause([f for f in (rule(ev, cfg) for rule in RULES) if f is not None])
    if not any(SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] for f in findings):
        evidence = _round(ev, "hit_rate", "reusable_fraction", "kv_usage_max", "preemptions", "evictions_per_s",
                          "ttft_mean_ms", "waiting_slope_per_s")
        findings.append(Finding("healthy", "ok", evidence, "no change needed"))
    return sorted(findings, key=lambda f: (-SEVERITY_RANK[f.severity], -f.score))
