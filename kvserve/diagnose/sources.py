"""Samples from a live server: `/debug/kvserve` (full metrics, configuration,
recent timelines) every `period_s` for `duration_s`, or until `min_requests`
requests finished inside the window; a server without that route is read
from its Prometheus `/metrics` instead (counters and gauges only: no
reusable-prefix counters, no timelines). The window's requests are those
whose timelines first appear after the first poll."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from kvserve.diagnose.record import Record, config_from_labels

# /metrics names whose snapshot key is not the name minus "kvserve:" and "_total".
PROMETHEUS_RENAMES = {"generation_tokens": "num_generation_tokens", "prompt_tokens": "prompt_tokens_arrived",
                      "kv_host_load_wait_seconds": "kv_host_load_wait_s"}


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def sample_server(url: str, duration_s: float, period_s: float = 1.0, min_requests: int | None = None) -> Record:
    if duration_s <= 0 or period_s <= 0:
        raise ValueError(f"--duration and the sample period must be > 0, got {duration_s} and {period_s}")
    url = url.rstrip("/")
    try:
        first = json.loads(_get(f"{url}/debug/kvserve"))
        read = lambda: json.loads(_get(f"{url}/debug/kvserve"))  # noqa: E731
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        first, read = _from_prometheus(url), lambda: _from_prometheus(url)  # noqa: E731
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach {url}: {e.reason}") from e
    polls = [first]
    end = time.monotonic() + duration_s
    while time.monotonic() < end and not _enough(polls, min_requests):
        time.sleep(min(period_s, max(end - time.monotonic(), 0)))
        polls.append(read())
    return _to_record(polls)


def _enough(polls: list[dict[str, Any]], min_requests: int | None) -> bool:
    if min_requests is None or len(polls) < 2:
        return False
    finished = [p["metrics"].get("num_requests_finished", 0) for p in (polls[0], polls[-1])]
    return finished[1] - finished[0] >= min_requests


def _to_record(polls: list[dict[str, Any]]) -> Record:
    """Samples from every poll; requests that finished during the window."""
    before = {r["request_id"] for r in polls[0]["requests"]}
    finished: dict[str, dict[str, Any]] = {}
    for poll in polls[1:]:
        for r in poll["requests"]:
            if r["request_id"] not in before:
                finished[r["request_id"]] = r
    samples = [{"t": p["t"], "metrics": p["metrics"]} for p in polls]
    return Record(polls[-1]["config"], samples, list(finished.values()))


def _from_prometheus(url: str) -> dict[str, Any]:
    from kvserve.bench.serve import parse_prometheus
    values = parse_prometheus(_get(f"{url}/metrics").decode())
    metrics = {}
    for name, value in values.items():
        if not name.startswith("kvserve:") or "{" in name:
            continue
        key = name.removeprefix("kvserve:").removesuffix("_total")
        metrics[PROMETHEUS_RENAMES.get(key, key)] = value
    return {"t": time.monotonic(), "config": _prometheus_config(values), "metrics": metrics, "requests": []}


def _prometheus_config(values: dict[str, float]) -> dict[str, Any]:
    """The kvserve:cache_config_info labels."""
    for name in values:
        if name.startswith("kvserve:cache_config_info{"):
            labels = dict(part.split("=", 1) for part in name[name.index("{") + 1:-1].split('",'))
            labels = {k: v.strip('"') for k, v in labels.items()}
            return config_from_labels(labels)
    raise ValueError("the server's /metrics has no kvserve:cache_config_info: is it a kvserve server?")
