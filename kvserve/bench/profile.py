"""`kvserve profile`: the kernel layer of the evidence chain.

Runs random-token prompts (the anchor shape by default: 256 x 512 in / 128
out) under torch.profiler and prints per-kernel time share, calls per step
and launches per step (device kernels on a GPU, CPU ops elsewhere), the decode
attention's achieved GB/s against the minimum bytes it must read, and writes
a Chrome/Perfetto trace.

Decode attention is found two ways: device kernels whose name matches
`--attention-kernel` (the Triton decode kernel), and a profiler range
`kvserve::decode_attention` put around every attention call of a decode-only
batch (the torch reference backend has no single kernel). Its minimum bytes
are each one-query row's visible keys and values, once per layer, counted
from the scheduler's output: on a GPU every step's one-query rows (the Triton
backend attends them with the decode kernel in mixed steps too), on the CPU
the decode-only steps the range times. Under CUDA graphs the range is not
entered (a replay does not call Python), so on a GPU the kernel pattern is
what times it.
"""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

DECODE_RANGE = "kvserve::decode_attention"


@dataclass
class DecodeBytes:
    """Minimum K/V bytes decode attention must read: each one-query row's
    visible keys and values, once per layer. Counted from the scheduler's
    output (host integers), so replayed CUDA graphs count too. `mixed_rows`:
    also the one-query rows of mixed steps (the Triton backend gives them to
    the decode kernel too); else decode-only steps alone (what the profiler
    range times)."""

    specs: tuple
    bytes_per_token: int          # K and V of one token in one layer
    bytes: int = 0
    steps: int = 0                # steps with a counted row
    mixed_rows: bool = False

    def observe(self, out) -> None:
        rows = [s for s in out.scheduled if s.num_new_tokens == 1]
        if not rows or (len(rows) < len(out.scheduled) and not self.mixed_rows):
            return
        lengths = [s.start_pos + 1 for s in rows]
        self.bytes += self.bytes_per_token * sum(_visible_keys(spec, n) for spec in self.specs for n in lengths)
        self.steps += 1


def _visible_keys(spec, seq_len: int) -> int:
    start = spec.visible_start(seq_len - 1)
    return seq_len - start + min(getattr(spec, "sink", 0), start)


def _count_decode_bytes(engine) -> DecodeBytes:
    """Tally every step the scheduler hands out from now on."""
    layout = engine.runner.layout
    per_token = 2 * layout.num_kv_heads * layout.head_dim * torch.finfo(layout.dtype).bits // 8
    tally = DecodeBytes(tuple(engine.model_config.layer_specs), per_token,
                        mixed_rows=engine.runner.device.type == "cuda")
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        tally.observe(out)
        return out
    engine.scheduler.schedule = counted
    return tally


class _TimedBackend:
    """Wraps an attention backend so decode-only calls run inside a named
    profiler range (CPU: the torch reference has no single decode kernel)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, getattr(inner, "name", "backend")

    def forward(self, q, k, v, kv_cache, layer, meta):
        if not meta.is_decode_only:
            return self.inner.forward(q, k, v, kv_cache, layer, meta)
        with torch.profiler.record_function(DECODE_RANGE):
            return self.inner.forward(q, k, v, kv_cache, layer, meta)


def _wrap_attention(model: torch.nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "backend") and hasattr(module.backend, "forward"):
            module.backend = _TimedBackend(module.backend)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    from kvserve.cli import add_engine_args
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--trace", default="kvserve_trace.json", help="Chrome/Perfetto trace file to write")
    p.add_argument("--top", type=int, default=15, help="kernels to list")
    p.add_argument("--attention-kernel", default="decode", help="regex naming the decode attention kernel")
    p.set_defaults(func=run_profile_cli)


def run_profile_cli(a: argparse.Namespace) -> int:
    if min(a.num_prompts, a.input_len, a.output_len) < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    from kvserve.bench.throughput import random_prompts
    from kvserve.cli import engine_kwargs
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    llm = LLM(**engine_kwargs(a))
    engine = llm.engine
    prompts = random_prompts(a.num_prompts, a.input_len, engine.model_config.vocab_size, seed=a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], params.with_max_tokens(2), use_tqdm=False)
    _wrap_attention(engine.runner.model)
    tally = _count_decode_bytes(engine)
    steps_before = engine.stats.num_steps
    prof, elapsed = profiled_run(llm, prompts, params)
    prof.export_chrome_trace(a.trace)
    report = profile_report(prof, engine.stats.num_steps - steps_before, tally, engine.runner.device,
                            a.attention_kernel, elapsed)
    print(f"workload: {a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, "
          f"model={a.model or 'embedded'}, device={engine.runner.device}")
    print(format_report(report, a.top))
    print(f"trace: {a.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def profiled_run(llm, prompts, params):
    """`llm.generate` of token-id prompts under torch's profiler (CPU, and CUDA where there is
    one): (the profile, the wall seconds). kvserve's and vLLM's `LLM` both fit."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return prof, elapsed


# Device kernels by kind, from their names (first match wins; vLLM's FA3 kernels say "flash").
KERNEL_KINDS = (("attention", ("_prefill", "_decode", "attn", "fmha", "flash")),
                ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
                ("memset/copy", ("memset", "memcpy", "copy", "fill")))


def kernel_kind(name: str, kinds=KERNEL_KINDS) -> str:
    """The kind of `kinds` whose words `name` holds; "other" for none."""
    return next((kind for kind, words in kinds if any(w in name.lower() for w in words)), "other")


def kernel_rows(prof, on_gpu: bool) -> list[dict[str, Any]]:
    """(name, self time us, calls) per kernel: device kernels on a GPU, CPU ops (no ranges) on CPU."""
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        if on_gpu and _is_device_kernel(e) and device_us > 0:
            rows.append({"name": e.key, "us": device_us, "calls": e.count})
        elif not on_gpu and not e.key.startswith(("kvserve::", "ProfilerStep")) and e.self_cpu_time_total > 0:
            rows.append({"name": e.key, "us": e.self_cpu_time_total, "calls": e.count})
    return sorted(rows, key=lambda r: -r["us"])


def _is_device_kernel(e) -> bool:
    """A kernel on the device, not a CPU op or range: aten::mm and the `kvserve::` range also carry
    the device time of what they launched, and counting them too would count every kernel twice."""
    from torch.autograd import DeviceType
    return e.device_type != DeviceType.CPU and not e.key.startswith(("kvserve::", "ProfilerStep"))


def device_idle(prof, num_steps: int, top: int = 8) -> list[str]:
    """Where the device sat idle between kernels, per step: the idle time in all, by gap
    length, and the `top` kernel pairs with the most idle time between them. Under CUDA
    graphs the gaps inside a replay are launch latency; a gap at a step's edge is the host's."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if _is_device_kernel(e) and e.time_range.end > e.time_range.start)
    if not spans:
        return ["no device kernels profiled"]
    steps = max(num_steps, 1)
    gaps, pairs, busy_end, before = [], {}, spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_end:
            gaps.append(start - busy_end)
            key = (before[:38], name[:38])
            pairs[key] = pairs.get(key, 0.0) + start - busy_end
        if end >= busy_end:
            busy_end, before = end, name
    window = spans[-1][1] - spans[0][0]
    lines = [f"device idle {sum(gaps) / steps / 1e3:.3f} ms/step of {window / steps / 1e3:.3f} "
             f"({len(gaps) / steps:.0f} gaps a step)"]
    for lo, hi in ((0, 2), (2, 5), (5, 20), (20, 100), (100, float("inf"))):
        within = [g for g in gaps if lo <= g < hi]
        lines.append(f"  gaps {lo}-{hi} us: {len(within) / steps:6.1f} a step, {sum(within) / steps / 1e3:.3f} ms/step")
    for (a, b), us in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / steps / 1e3:.3f} ms/step  {a} -> {b}")
    return lines


def _range_us(prof, name: str) -> tuple[float, int]:
    for e in prof.key_averages():
        if e.key == name:
            return e.cpu_time_total, e.count
    return 0.0, 0


def profile_report(prof, num_steps: int, tally: DecodeBytes, device: torch.device, attention_kernel: str,
                   elapsed_s: float) -> dict[str, Any]:
    on_gpu = device.type == "cuda"
    rows = kernel_rows(prof, on_gpu)
    total_us = sum(r["us"] for r in rows) or 1.0
    steps = max(num_steps, 1)
    for r in rows:
        r["share"], r["calls_per_step"] = r["us"] / total_us, r["calls"] / steps
    if on_gpu:
        pattern = re.compile(attention_kernel)
        matched = [r for r in rows if pattern.search(r["name"])]
        attn_us, attn_calls, source = sum(r["us"] for r in matched), sum(r["calls"] for r in matched), "kernels"
    else:
        (attn_us, attn_calls), source = _range_us(prof, DECODE_RANGE), "range " + DECODE_RANGE
    report = {"steps": num_steps, "elapsed_s": elapsed_s, "kernels": rows, "total_us": total_us,
              "launches_per_step": sum(r["calls"] for r in rows) / steps, "on_gpu": on_gpu,
              "decode_attention": {"source": source, "time_us": attn_us, "calls": attn_calls,
                                   "min_bytes": tally.bytes, "decode_steps": tally.steps,
                                   "step_kind": ("steps with one-query rows" if tally.mixed_rows
                                                 else "decode-only steps"),
                                   "achieved_gb_s": tally.bytes / (attn_us * 1e-6) / 1e9 if attn_us else None}}
    if on_gpu:
        from kvserve.bench.device_limits import measure_device_limits
        report["device_copy_gb_s"] = measure_device_limits(device).copy_bytes_per_s / 1e9
    return report


def format_report(r: dict[str, Any], top: int) -> str:
    unit = "device kernels" if r["on_gpu"] else "CPU ops"
    lines = [f"{r['steps']} engine steps in {r['elapsed_s']:.2f} s; {unit}: {r['total_us'] / 1e3:.1f} ms self time, "
             f"{r['launches_per_step']:.1f} launches per step",
             f"{'kernel':<60}{'share':>8}{'ms':>10}{'calls':>8}{'/step':>8}"]
    for k in r["kernels"][:top]:
        lines.append(f"{k['name'][:59]:<60}{k['share']:>8.1%}{k['us'] / 1e3:>10.2f}{k['calls']:>8}"
                     f"{k['calls_per_step']:>8.1f}")
    d = r["decode_attention"]
    lines.append(f"decode attention ({d['source']}): {d['time_us'] / 1e3:.2f} ms over {d['calls']} calls; "
                 f"minimum K/V bytes {d['min_bytes'] / 1e6:.3g} MB over {d['decode_steps']} {d['step_kind']}")
    if d["achieved_gb_s"] is not None:
        line = f"  achieved {d['achieved_gb_s']:.3g} GB/s of the minimum bytes"
        if "device_copy_gb_s" in r:
            line += (f" = {d['achieved_gb_s'] / r['device_copy_gb_s']:.1%} of the measured copy limit "
                     f"{r['device_copy_gb_s']:.0f} GB/s")
        lines.append(line)
    else:
        lines.append("  no decode attention time found (pattern or range matched nothing)")
    return "\n".join(lines)
