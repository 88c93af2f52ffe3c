"""`kvserve bench sweep`: block size x token budget on one workload, measured.

For every (block size, max_num_batched_tokens) setting a fresh engine runs
the same seeded workload (kvserve.bench.workloads): offline by default, all
requests at once (multi-turn follow-ups after their predecessor), or online
with `--rate` against a `kvserve serve` started per setting. Each setting's
row: prefix hit rate, req/s, TTFT mean/p95, ITL p95, peak KV memory used,
fragmentation, evictions/s, preemptions. The recommendation is the highest
req/s, ties (within 5%) going to the lower TTFT p95. Writes CSV, JSON and a
PNG (hit rate, TTFT and req/s against block size, one line per budget).

`--kv-tokens N` caps the KV cache at N tokens (N / block size blocks), the
way a deployment's memory caps it; without it the engine sizes the cache.
A model without a tokenizer (dummy weights) gets a word-level stand-in: each
word of the workload's text becomes one stable token id, so shared prefixes
stay shared and lengths stay close to BPE counts.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvserve.bench.workloads import WORKLOADS, WorkloadRequest, generate_workload

COLUMNS = ("block_size", "budget", "hit_rate", "req_per_s", "ttft_mean_ms", "ttft_p95_ms", "itl_p95_ms",
           "kv_used_gb", "kv_used_pct", "fragmentation", "evictions_per_s", "preemptions")
TIE_SHARE = 0.05


@dataclass
class SweepRow:
    block_size: int
    budget: int
    hit_rate: float
    req_per_s: float
    ttft_mean_ms: float
    ttft_p95_ms: float
    itl_p95_ms: float
    kv_used_gb: float
    kv_used_pct: float
    fragmentation: float
    evictions_per_s: float
    preemptions: int


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"{name} takes comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise ValueError(f"{name} needs integers >= 1, got {text!r}")
    return values


def word_token_ids(text: str, vocab_size: int) -> list[int]:
    """A stable id per word (skipping the 3 lowest ids, where special tokens live)."""
    import zlib
    return [3 + zlib.crc32(w.encode()) % (vocab_size - 3) for w in text.split()]


def tokenize_workload(requests: list[WorkloadRequest], tokenizer, vocab_size: int) -> list[list[int]]:
    if tokenizer is None:
        return [word_token_ids(r.prompt, vocab_size) for r in requests]
    return [list(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests]


# -- one setting, offline ----------------------------------------------------------------------
def engine_kwargs(a: argparse.Namespace, block_size: int, budget: int) -> dict[str, Any]:
    kwargs = dict(model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
                  block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=a.max_num_seqs,
                  max_model_len=a.max_model_len, enable_prefix_caching=a.enable_prefix_caching,
                  cpu_kv_cache_gb=a.cpu_kv_cache_gb, seed=a.seed)
    if a.kv_tokens:
        kwargs["num_kv_blocks"] = math.ceil(a.kv_tokens / block_size) + 1
    return kwargs


def run_offline(a: argparse.Namespace, block_size: int, budget: int) -> tuple[SweepRow, Any]:
    from kvserve.diagnose.drive import DriveRequest, run_recorded
    from kvserve.entrypoints.llm import LLM
    llm = LLM(**engine_kwargs(a, block_size, budget))
    engine = llm.engine
    max_len = engine.scheduler_config.max_model_len
    workload = generate_workload(a.workload, a.num_prompts, a.seed, a.scale, max_len)
    prompts = tokenize_workload(workload, engine.tokenizer, engine.model_config.vocab_size)
    requests = [DriveRequest(p[:max_len - 2], max(1, min(w.max_tokens, max_len - min(len(p), max_len - 2))), w.after)
                for p, w in zip(prompts, workload)]
    result = run_recorded(llm, requests)
    del llm, engine
    _release_device_memory()  # the next setting builds a new engine on the same device
    return row_from_record(block_size, budget, result.record, result.elapsed_s, result.itl_s), result.record


def _release_device_memory() -> None:
    import gc

    import torch
    gc.collect()  # engine parts reference each other: refcounting alone does not free them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pool_gb(cfg: dict[str, Any]) -> float:
    """KV pool size; NaN when the record lacks bytes per block (a server whose
    engine core runs in another process publishes block counts only)."""
    per_block = cfg.get("bytes_per_block")
    return cfg["num_blocks"] * per_block / 1e9 if per_block else float("nan")


def row_from_record(block_size: int, budget: int, record, elapsed_s: float, itl_s: list[float]) -> SweepRow:
    from kvserve.diagnose.window import Window
    window = Window(record.samples, record.config, record.requests)
    ev = window.evidence()
    ttft = np.asarray([s.ttft_s for s in window.splits]) * 1e3
    return SweepRow(block_size, budget, ev["hit_rate"], len(record.requests) / elapsed_s,
                    _stat(ttft, "mean"), _stat(ttft, 95), _stat(np.asarray(itl_s) * 1e3, 95),
                    ev["kv_usage_max"] * pool_gb(record.config), ev["kv_usage_max"], ev["fragmentation_mean"],
                    ev["evictions"] / elapsed_s, int(ev["preemptions"]))


def _stat(values: np.ndarray, which: Any) -> float:
    if values.size == 0:
        return float("nan")
    return float(values.mean() if which == "mean" else np.percentile(values, which))


# -- the sweep ---------------------------------------------------------------------------------
def recommend(rows: list[SweepRow]) -> tuple[SweepRow, str]:
    best_rate = max(r.req_per_s for r in rows)
    close = [r for r in rows if r.req_per_s >= (1 - TIE_SHARE) * best_rate]
    pick = min(close, key=lambda r: (r.ttft_p95_ms if not math.isnan(r.ttft_p95_ms) else math.inf, -r.req_per_s))
    worst = min(rows, key=lambda r: r.req_per_s)
    why = (f"block size {pick.block_size}, budget {pick.budget}: {pick.req_per_s:.2f} req/s "
           f"({pick.req_per_s / worst.req_per_s:.2f}x the slowest setting, {worst.block_size}/{worst.budget}), "
           f"TTFT p95 {pick.ttft_p95_ms:.0f} ms, hit rate {pick.hit_rate:.1%}, {pick.preemptions} preemptions")
    if len(close) > 1:
        why += f"; {len(close)} settings within {TIE_SHARE:.0%} of the best req/s, this one has the lowest TTFT p95"
    return pick, why


def format_table(rows: list[SweepRow]) -> str:
    head = (f"{'block':>6}{'budget':>8}{'hit rate':>10}{'req/s':>9}{'TTFT mean':>11}{'TTFT p95':>10}"
            f"{'ITL p95':>9}{'KV used':>14}{'frag':>7}{'evict/s':>9}{'preempt':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        used = ("n/a" if math.isnan(r.kv_used_gb) else f"{r.kv_used_gb:.2f}GB" if r.kv_used_gb >= 1
                else f"{r.kv_used_gb * 1e3:.1f}MB")
        kv = f"{used} {r.kv_used_pct:.0%}"
        lines.append(f"{r.block_size:>6}{r.budget:>8}{r.hit_rate:>10.1%}{r.req_per_s:>9.2f}{r.ttft_mean_ms:>11.1f}"
                     f"{r.ttft_p95_ms:>10.1f}{r.itl_p95_ms:>9.1f}{kv:>14}{r.fragmentation:>7.1%}"
                     f"{r.evictions_per_s:>9.2f}{r.preemptions:>9}")
    lines.append("(times in ms; KV used = peak usage of the pool)")
    return "\n".join(lines)


def write_outputs(rows: list[SweepRow], recommendation: tuple[SweepRow, str], prefix: str,
                  meta: dict[str, Any]) -> list[str]:
    paths = [f"{prefix}.csv", f"{prefix}.json", f"{prefix}.png"]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    with open(paths[1], "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows],
                   "recommended": {**asdict(recommendation[0]), "why": recommendation[1]}}, f, indent=2)
    plot(rows, paths[2], meta.get("workload", ""))
    return paths


def plot(rows: list[SweepRow], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("the sweep's plot needs matplotlib (pip install 'kvserve[bench]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("hit_rate", "prefix hit rate"), ("ttft_mean_ms", "TTFT mean (ms)"), ("req_per_s", "req/s"))
    for ax, (key, label) in zip(axes, panels):
        for budget in sorted({r.budget for r in rows}):
            line = sorted((r for r in rows if r.budget == budget), key=lambda r: r.block_size)
            ax.plot([r.block_size for r in line], [getattr(r, key) for r in line], marker="o", label=f"budget {budget}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"kvserve bench sweep: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_sweep_parser(kinds: Any) -> None:
    p = kinds.add_parser("sweep", help="block size x token budget table on a workload, with a recommendation")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS)
    p.add_argument("--block-sizes", default="8,16,32,64")
    p.add_argument("--max-num-batched-tokens", default="2048,8192,32768")
    p.add_argument("--kv-tokens", type=int, default=None, help="cap the KV cache at this many tokens")
    p.add_argument("--rate", type=float, default=None, help="online: Poisson req/s against a server per setting")
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's for the device")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every workload length by this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="sweep", help="prefix of the .csv, .json and .png files")
    p.add_argument("--save-records", default=None, metavar="DIR",
                   help="write each setting's diagnosis record (kvserve diagnose --offline)")
    p.set_defaults(func=run_sweep_cli)


def run_sweep_cli(a: argparse.Namespace) -> int:
    import os
    block_sizes = parse_int_list(a.block_sizes, "--block-sizes")
    budgets = parse_int_list(a.max_num_batched_tokens, "--max-num-batched-tokens")
    if a.num_prompts < 1 or (a.kv_tokens is not None and a.kv_tokens < 1):
        raise ValueError("--num-prompts and --kv-tokens must be >= 1")
    if a.rate is not None and not a.rate > 0:
        raise ValueError(f"--rate must be > 0, got {a.rate}")
    rows = []
    for block_size in block_sizes:
        for budget in budgets:
            if a.rate is None:
                row, record = run_offline(a, block_size, budget)
            else:
                from kvserve.bench.sweep_online import run_online
                row, record = run_online(a, block_size, budget)
            rows.append(row)
            print(f"block {block_size:>3} budget {budget:>6}: {row.req_per_s:.2f} req/s, hit {row.hit_rate:.1%}, "
                  f"TTFT p95 {row.ttft_p95_ms:.1f} ms", flush=True)
            if a.save_records:
                os.makedirs(a.save_records, exist_ok=True)
                record.save(os.path.join(a.save_records, f"record_bs{block_size}_budget{budget}.json"))
    recommendation = recommend(rows)
    mode = "offline" if a.rate is None else f"online @ {a.rate} req/s"
    print(f"\nworkload {a.workload} x{a.num_prompts} (scale {a.scale}), {mode}, model={a.model or 'embedded'}, "
          f"KV cap {a.kv_tokens or 'none'} tokens")
    print(format_table(rows))
    print(f"recommended: {recommendation[1]}")
    meta = {"workload": a.workload, "num_prompts": a.num_prompts, "scale": a.scale, "mode": mode,
            "model": a.model or "embedded", "kv_tokens": a.kv_tokens}
    print("wrote " + ", ".join(write_outputs(rows, recommendation, a.output, meta)))
    return 0
