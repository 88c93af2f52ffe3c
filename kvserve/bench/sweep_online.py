"""One online sweep setting: start `kvserve serve` with the setting, send the
workload at `--rate` req/s (kvserve.bench.serve's client), and read the
server's `/debug/kvserve` before, during and after for the diagnosis record."""
from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from kvserve.bench.sweep import SweepRow, engine_kwargs, pool_gb
from kvserve.bench.workloads import generate_workload
from kvserve.diagnose.record import Record

START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(a: argparse.Namespace, block_size: int, budget: int, port: int) -> list[str]:
    kw = engine_kwargs(a, block_size, budget)
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--block-size", str(block_size), "--max-num-batched-tokens", str(budget),
           "--load-format", a.load_format, "--dtype", a.dtype,
           "--device", a.device, "--cpu-kv-cache-gb", str(a.cpu_kv_cache_gb), "--seed", str(a.seed),
           "--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching"]
    for flag, key in (("--model", "model"), ("--max-model-len", "max_model_len"), ("--num-kv-blocks", "num_kv_blocks"),
                      ("--max-num-seqs", "max_num_seqs")):
        if kw.get(key) is not None:
            cmd += [flag, str(kw[key])]
    return cmd


def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with code {process.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"kvserve serve was not healthy after {START_TIMEOUT_S:.0f} s")


def run_online(a: argparse.Namespace, block_size: int, budget: int) -> tuple[SweepRow, Record]:
    if a.load_format == "dummy" or (a.model or "").startswith("dummy:"):
        raise ValueError("an online sweep sends text: it needs a model with a tokenizer (not dummy weights)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(_server_command(a, block_size, budget, port))
    try:
        _wait_healthy(url, process)
        return asyncio.run(_measure(a, url, block_size, budget))
    finally:
        process.terminate()
        process.wait(timeout=60)


async def _measure(a: argparse.Namespace, url: str, block_size: int, budget: int) -> tuple[SweepRow, Record]:
    import json

    from kvserve.bench.serve import BenchClient, run_benchmark
    client = BenchClient(url, "", ignore_eos=True, timeout_s=3600.0)
    try:
        card = (await client.http.get(f"{url}/v1/models")).json()["data"][0]
        client.model = card["id"]
        requests = generate_workload(a.workload, a.num_prompts, a.seed, a.scale, card["max_model_len"])
        first = json.loads((await client.http.get(f"{url}/debug/kvserve")).content)
        results, duration, _, _, kv_samples = await run_benchmark(client, requests, a.rate, None, a.seed,
                                                                 progress=False)
        last = json.loads((await client.http.get(f"{url}/debug/kvserve")).content)
    finally:
        await client.close()
    record = Record(last["config"], [{"t": p["t"], "metrics": p["metrics"]} for p in (first, last)],
                    last["requests"][-len(requests):])
    return _row(block_size, budget, record, results, duration, kv_samples), record


def _row(block_size: int, budget: int, record: Record, results, duration: float, kv_samples) -> SweepRow:
    """Latencies from the client; hit rate, evictions, preemptions from the
    record's counters; KV usage and fragmentation from /metrics samples taken
    during the run (the record's two ends are idle)."""
    from kvserve.diagnose.window import Window
    ev = Window(record.samples, record.config, record.requests).evidence()
    ok = [r for r in results if r.ok]
    ttft = np.asarray([r.ttft for r in ok]) * 1e3
    itl = np.asarray([x for r in ok for x in r.itl]) * 1e3
    pct = lambda v, q: float(np.percentile(v, q)) if v.size else float("nan")  # noqa: E731
    peak = max((s.usage for s in kv_samples), default=ev["kv_usage_max"])
    frag = float(np.mean([s.fragmentation for s in kv_samples])) if kv_samples else ev["fragmentation_mean"]
    return SweepRow(block_size, budget, ev["hit_rate"], len(ok) / duration,
                    float(ttft.mean()) if ttft.size else float("nan"), pct(ttft, 95), pct(itl, 95),
                    peak * pool_gb(record.config), peak, frag, ev["evictions"] / duration, int(ev["preemptions"]))
