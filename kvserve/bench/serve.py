"""`kvserve bench serve`: online latency benchmark against a running server
(like `vllm bench serve`).

Requests from `kvserve.bench.workloads` are sent with Poisson arrivals (or all
at once with --request-rate inf), optionally capped at --max-concurrency,
each as a streaming /v1/completions call. Client side: TTFT, TPOT, ITL, E2E
percentiles, throughput, goodput. Server side: /metrics is scraped before,
during (every 0.5 s) and after the run for prefix-cache hit rate, evictions,
preemptions, KV usage and fragmentation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from kvserve.bench.serve_processes import LEAD_S, send_in_processes
from kvserve.bench.workloads import WORKLOADS, WorkloadRequest, generate_workload

SAMPLE_PERIOD_S = 0.5


@dataclass
class RequestResult:
    scenario: str
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    sent: float = 0.0   # seconds from the run's start until the request was sent
    due: float | None = None   # when the arrival schedule said to send it (None: a follow-up turn)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class KVSample:
    t: float
    usage: float
    fragmentation: float
    running: float
    waiting: float


# -- the client --------------------------------------------------------------------------
class BenchClient:
    def __init__(self, url: str, model: str, ignore_eos: bool, timeout_s: float) -> None:
        import httpx
        self.url, self.model, self.ignore_eos, self.timeout_s = url.rstrip("/"), model, ignore_eos, timeout_s
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(timeout=timeout_s, limits=limits)

    async def warm_up(self) -> None:
        """One request that costs the server nothing (`/v1/models`), before the timed ones: a
        client process's first request pays its own HTTP stack's set-up, 30-90 ms on this
        project's CPU (a second client's first request, on a new connection, reads as the later
        ones do), which the run would otherwise count in the TTFT of its first request. The
        single-process run scrapes `/metrics` first."""
        (await self.http.get(f"{self.url}/v1/models")).raise_for_status()

    async def metrics(self) -> dict[str, float]:
        response = await self.http.get(f"{self.url}/metrics")
        response.raise_for_status()
        return parse_prometheus(response.text)

    async def complete(self, request: WorkloadRequest) -> RequestResult:
        result = RequestResult(request.scenario)
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": self.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk, now = json.loads(line[6:]), time.perf_counter()
                    if chunk.get("choices"):
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                    if chunk.get("usage"):
                        _read_usage(result, chunk["usage"])
            result.e2e, result.ok = time.perf_counter() - start, True
        except Exception as e:  # a failed request is a result, not a crash of the run
            result.error = f"{type(e).__name__}: {e}"
        return result

    async def close(self) -> None:
        await self.http.aclose()


def _read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage["prompt_tokens"]
    result.output_tokens = usage["completion_tokens"]
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


SERVER_PREFIXES = ("kvserve:", "vllm:")   # our /metrics, and vLLM's OpenAI server's (the peer the bench compares)


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {name{labels}: value}; enough for our own /metrics."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


def server_metric(m: dict[str, float], name: str) -> float:
    """`name` (unprefixed, e.g. "prefix_cache_hits_total") summed over its label sets, under
    either server's prefix: vLLM labels every series (model_name, engine), kvserve few."""
    names = {prefix + name for prefix in SERVER_PREFIXES}
    return sum(v for key, v in m.items() if key.partition("{")[0] in names)


# -- the run -----------------------------------------------------------------------------
async def run_benchmark(client: BenchClient, requests: list[WorkloadRequest], request_rate: float,
                        max_concurrency: int | None, seed: int, progress: bool = True, processes: int = 1):
    """Send `requests` on their Poisson schedule; with `processes` > 1 the sends and the stream
    reading are split over that many client processes (one event loop parses ~10^4 chunks a
    second before it falls behind its schedule). Metrics are scraped from this process."""
    from tqdm.auto import tqdm
    due = arrival_times(len(requests), request_rate, random.Random(seed))
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress or processes > 1)
    samples: list[KVSample] = []
    before = await client.metrics()
    start = time.perf_counter() + (LEAD_S if processes > 1 else 0.0)
    sampler = asyncio.ensure_future(_sample_kv(client, samples, start))
    if processes > 1:
        results = await send_in_processes(client, requests, due, max_concurrency, processes, start)
    else:
        results = await send_on_schedule(client, requests, due, max_concurrency, start, bar.update)
    for result, request, at in zip(results, requests, due):
        result.due = at if request.after is None else None
    duration = time.perf_counter() - start
    sampler.cancel()
    after = await client.metrics()
    bar.close()
    return list(results), duration, before, after, samples


async def send_on_schedule(client: BenchClient, requests: list[WorkloadRequest], due: list[float],
                           max_concurrency: int | None, start: float,
                           on_done: Callable[[int], Any] = lambda n: None) -> list[RequestResult]:
    """Each request sent at `start + due[i]` (a follow-up turn once its predecessor is done)."""
    done = [asyncio.Event() for _ in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, request: WorkloadRequest) -> RequestResult:
        if request.after is not None:
            await done[request.after].wait()   # a multi-turn follow-up needs its predecessor
        try:
            if limit is None:
                return await _send(client, request, start)
            async with limit:
                return await _send(client, request, start)
        finally:
            done[i].set()
            on_done(1)

    tasks = []
    for i, request in enumerate(requests):
        # Sleep until the scheduled time, not for the gap: a client busy reading streams
        # would otherwise fall further behind with every request (a 768-request run at
        # 60 req/s sent its last request at 16.5 s instead of 12.7 s) and offer less load.
        await asyncio.sleep(max(0.0, start + due[i] - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(i, request)))
    return list(await asyncio.gather(*tasks))


def arrival_times(n: int, request_rate: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each of `n` requests is due: a Poisson
    process at `request_rate` (all at 0 when it is inf)."""
    if request_rate == float("inf"):
        return [0.0] * n
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(request_rate))
    return times


async def _send(client: BenchClient, request: WorkloadRequest, start: float) -> RequestResult:
    """`client.complete`, with the send time from the run's `start` recorded."""
    sent = time.perf_counter() - start
    result = await client.complete(request)
    result.sent = sent
    return result


def request_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request figures for --save-json, so a tail can be placed in time
    (a cold start, a burst) rather than only counted."""
    return [{"sent_s": round(r.sent, 4), "due_s": None if r.due is None else round(r.due, 4), "ok": r.ok,
             "ttft_ms": round(r.ttft * 1e3, 2), "e2e_ms": round(r.e2e * 1e3, 2), "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens} for r in results]


async def _sample_kv(client: BenchClient, samples: list[KVSample], start: float) -> None:
    while True:
        try:
            m = await client.metrics()
            samples.append(KVSample(time.perf_counter() - start, server_metric(m, "kv_cache_usage_perc"),
                                    server_metric(m, "kv_cache_fragmentation"),
                                    server_metric(m, "num_requests_running"),
                                    server_metric(m, "num_requests_waiting")))
        except Exception:
            pass  # a missed sample only thins the time series
        await asyncio.sleep(SAMPLE_PERIOD_S)


# -- the report ----------------------------------------------------------------------------
def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p95": float("nan"), "p99": float("nan")}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p95": float(np.percentile(ms, 95)), "p99": float(np.percentile(ms, 99))}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
    return r.ok and all(measured[k] * 1000.0 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, before: dict[str, float],
              after: dict[str, float], samples: list[KVSample], slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": sum(_meets(r, slos) for r in ok) / duration if slos else None,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        # How late the client sent scheduled requests: the load it really offered.
        "send_lag_ms": _stats_ms([r.sent - r.due for r in results if r.due is not None]),
    }
    summary["server"] = _server_summary(before, after, samples, duration)
    return summary


def _server_summary(before: dict[str, float], after: dict[str, float], samples: list[KVSample],
                    duration: float) -> dict[str, Any]:
    def delta(name: str) -> float:   # vLLM exports no evictions or fragmentation: they read 0
        return server_metric(after, name) - server_metric(before, name)
    queries = delta("prefix_cache_queries_total")
    return {"prefix_cache_hit_rate": delta("prefix_cache_hits_total") / queries if queries else 0.0,
            "evictions": delta("kv_cache_evictions_total"),
            "evictions_per_s": delta("kv_cache_evictions_total") / duration,
            "preemptions": delta("num_preemptions_total"),
            "peak_kv_usage": max((s.usage for s in samples), default=0.0),
            "mean_fragmentation": float(np.mean([s.fragmentation for s in samples])) if samples else 0.0,
            "peak_fragmentation": max((s.fragmentation for s in samples), default=0.0)}


def format_summary(s: dict[str, Any], title: str) -> str:
    lines = [f"{' ' + title + ' ':=^62}",
             f"{'Successful requests:':<40}{s['completed']:>22}",
             f"{'Failed requests:':<40}{s['failed']:>22}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:>22.2f}",
             f"{'Total input tokens (cached):':<40}{f'''{s['total_input_tokens']} ({s['cached_prompt_tokens']})''':>22}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']:>22}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:>22.2f}",
             f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>22.2f}",
             f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>22.2f}"]
    if s["goodput"] is not None:
        lines.append(f"{'Goodput (req/s):':<40}{s['goodput']:>22.2f}")
    lag = s["send_lag_ms"]
    lines.append(f"{'Send lag vs schedule, mean / p99 (ms):':<40}{lag['mean']:>13.1f} /{lag['p99']:>7.1f}")
    lines.append(f"{'latency (ms)':<14}{'mean':>12}{'median':>12}{'p95':>12}{'p99':>12}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        st = s[key]
        lines.append(f"{label:<14}{st['mean']:>12.1f}{st['median']:>12.1f}{st['p95']:>12.1f}{st['p99']:>12.1f}")
    srv = s["server"]
    lines += [f"{' server KV cache (from /metrics) ':-^62}",
              f"{'Prefix-cache hit rate:':<40}{srv['prefix_cache_hit_rate']:>22.1%}",
              f"{'Evictions (per s):':<40}{f'''{srv['evictions']:.0f} ({srv['evictions_per_s']:.2f})''':>22}",
              f"{'Preemptions:':<40}{srv['preemptions']:>22.0f}",
              f"{'Peak KV usage:':<40}{srv['peak_kv_usage']:>22.1%}",
              f"{'Fragmentation (mean / peak):':<40}"
              f"{f'''{srv['mean_fragmentation']:.1%} / {srv['peak_fragmentation']:.1%}''':>22}",
              "=" * 62]
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def plot(path: str, results: list[RequestResult], samples: list[KVSample], title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib (pip install 'kvserve[bench]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (label, values) in zip(axes[:2], (("TTFT (ms)", [r.ttft * 1e3 for r in ok]),
                                              ("ITL (ms)", [x * 1e3 for r in ok for x in r.itl]))):
        ax.hist(values, bins=40)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes[2]
    ax.plot([s.t for s in samples], [s.usage * 100 for s in samples], label="KV usage %")
    ax.plot([s.t for s in samples], [s.fragmentation * 100 for s in samples], label="fragmentation %")
    ax.set_xlabel("time (s)")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- the command ---------------------------------------------------------------------------
def add_serve_bench_parser(kinds: Any) -> None:
    p = kinds.add_parser("serve", help="online latency benchmark against a running `kvserve serve`")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--workload", default="qa", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s of Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--client-processes", type=int, default=1,
                   help="send and read streams from this many processes (one falls behind its schedule "
                        "past ~60 req/s of ide-completion); --max-concurrency is split among them")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every workload length by this")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + output token cap (default: the server's max_model_len)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2e)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir: send token-id prompts, so every engine gets the same ids "
                        "and none spends its time tokenizing")
    p.add_argument("--save-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG: latency histograms and KV usage over time")
    p.set_defaults(func=run_serve_bench_cli)


def token_id_prompts(requests: list[WorkloadRequest], tokenizer_dir: str) -> list[WorkloadRequest]:
    """The same requests with prompts as token ids (no special tokens added)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = tokenizer([r.prompt for r in requests], add_special_tokens=False)["input_ids"]
    return [replace(r, prompt=p) for r, p in zip(requests, ids)]


def run_serve_bench_cli(a: argparse.Namespace) -> int:
    if a.num_prompts < 1 or not a.request_rate > 0 or a.client_processes < 1:
        raise ValueError(f"--num-prompts and --client-processes must be >= 1 and --request-rate > 0, "
                         f"got {a.num_prompts}, {a.client_processes} and {a.request_rate}")
    return asyncio.run(_main(a))


async def _main(a: argparse.Namespace) -> int:
    slos = parse_goodput(a.goodput)
    client = BenchClient(a.url, a.model or "", a.ignore_eos, a.timeout)
    try:
        card = (await client.http.get(f"{client.url}/v1/models")).json()["data"][0]
        client.model = a.model or card["id"]
        max_len = a.max_len or card.get("max_model_len", 8192)
        requests = generate_workload(a.workload, a.num_prompts, a.seed, a.scale, max_len)
        if a.tokenizer:
            requests = token_id_prompts(requests, a.tokenizer)
        results, duration, before, after, samples = await run_benchmark(
            client, requests, a.request_rate, a.max_concurrency, a.seed, processes=a.client_processes)
    finally:
        await client.close()
    summary = summarize(results, duration, before, after, samples, slos)
    title = f"{a.workload} x{a.num_prompts} @ {a.request_rate} req/s, scale {a.scale}"
    print(format_summary(summary, title))
    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "func"}, "summary": summary,
                       "kv_samples": [asdict(s) for s in samples], "requests": request_rows(results)},
                      f, indent=2)
    if a.plot:
        plot(a.plot, results, samples, title)
    return 0
