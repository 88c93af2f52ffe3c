"""Step trace: where a serving engine core's time goes, step by step.

`KVSERVE_STEP_TRACE=FILE kvserve serve ...` makes the core append one line per
step to FILE (tab-separated, flushed every FLUSH_EVERY steps, so a killed
server keeps nearly all of it):

    start_s  step_ms  wait_ms  out_ms  rows  prompt_tokens  eager  gc_ms  jit_ms  dev_allocs  alloc_syncs

- `step_ms`: `LLMEngine.step` (schedule, launch of step N+1, wait for step N,
  output processing);
- `wait_ms`: the part of it spent waiting for step N's sampled ids. Steps are
  pipelined one deep, so a step whose wait is near zero was bound by the host:
  the device had finished before the host asked;
- `out_ms`: building and sending the step's output message;
- `rows`, `prompt_tokens`: the launched step's sampling rows (the requests it
  gives a token) and prompt tokens (chunks of more than one token); `eager`: 1
  when it ran without a CUDA graph. A line that launched nothing has zeros;
- `gc_ms`: Python's cyclic garbage collector's time inside the step (a full
  collection stalls the host); `jit_ms`: Triton compiling (or loading from its
  disk cache) a kernel variant first used in the step. Traces written before
  these columns read as NaN. A compile of more than SLOW_JIT_MS is also logged
  with the kernel's name, and written to FILE.jit (`JIT_SUFFIX`: the step's
  start_s, the kernel, its ms and its variant, a line each), so the trace
  names it even where the log was not kept;
- `dev_allocs`: device memory calls PyTorch's caching allocator made in the
  step (cudaMalloc and cudaFree, or their cuMem counterparts); `alloc_syncs`:
  its cache flushes (a failed cudaMalloc retried, or all streams synchronised
  to free cached blocks). A cudaFree waits for the device, so a step launched
  while its predecessor runs stalls for it. NaN without CUDA; traces written
  before these columns read as NaN too.

`python -m kvserve.engine.step_trace FILE` prints percentiles per kind of
launched step (decode only or mixed, graph or eager): the pipeline's time on
it (what a stream's inter-token latency is made of; `with_periods` says how it
is read off the lines), the host's time to launch it, the wait, the output,
and the steps with the longest host time, each with the device's idle time
before it (what the launch cost: ~0 where it blocked on the device's full
launch queue while the step before ran). A stall names itself: garbage
collection in `gc_ms`, a kernel compile in `jit_ms`, else a hidden
synchronisation, which the allocator's columns may name, or a library kernel's
first launch in the process: docs/DIAGNOSING.md, section 5.

`KVSERVE_CORE_PROFILE=FILE` adds a cProfile of every step of the core's
(`LLMEngine.step` and the output message), rewritten to FILE every
PROFILE_EVERY steps and at exit: where a step's host time goes.
`KVSERVE_SYNC_CHECK=1` makes a CUDA core warn, once per call site and with its
line, at every operation that waits for the device (torch's sync debug mode):
a launch that waits for the step before it serialises the pipeline.
"""
from __future__ import annotations

import cProfile
import gc
import gzip
import logging
import math
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

logger = logging.getLogger(__name__)

ENV = "KVSERVE_STEP_TRACE"
PROFILE_ENV = "KVSERVE_CORE_PROFILE"
SYNC_CHECK_ENV = "KVSERVE_SYNC_CHECK"
FLUSH_EVERY = 256
PROFILE_EVERY = 2000
SLOW_JIT_MS = 50.0
JIT_SUFFIX = ".jit"   # the slow compiles' side file, beside the trace
JIT_HEADER = "start_s\tkernel\tms\tvariant\n"
HEADER = ("start_s\tstep_ms\twait_ms\tout_ms\trows\tprompt_tokens\teager\tgc_ms\tjit_ms"
          "\tdev_allocs\talloc_syncs\tprev_gpu_ms\n")
GPU_HEADER = HEADER.replace("\tprev_gpu_ms", "")                # traces written before the device span
ALLOC_HEADER = GPU_HEADER.replace("\tdev_allocs\talloc_syncs", "")   # ... and before the allocator's columns
OLD_HEADER = ALLOC_HEADER.replace("\tgc_ms\tjit_ms", "")        # ... and before gc and jit


class GcClock:
    """Time spent in Python's cyclic garbage collections, read and reset by `take_ms`."""

    def __init__(self) -> None:
        self._ns = 0
        self._started = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self._ns += time.perf_counter_ns() - self._started
            self._started = 0

    def take_ms(self) -> float:
        ns, self._ns = self._ns, 0
        return ns / 1e6

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def build_variant(info: dict) -> str:
    """What tells a compile from Triton's JIT hooks apart from the kernel's other builds, i.e. what to
    warm up: its `repr` (argument types), and, where the hook gives them, its constexprs and
    specialised attributes (divisibility by 16, ints equal to 1): Triton 3.6's `repr` names only the
    first argument."""
    build = info.get("compile")
    extra = f" constants={build['constants']} attrs={build['configs']}" if build else ""
    return f"{info.get('repr', '')}{extra}"


class JitClock:
    """Time Triton spends compiling kernel variants, from its JIT hooks (called before and after
    each compile of a variant new to the process); earlier hooks keep being called."""

    def __init__(self) -> None:
        self._ns = 0
        self._started: dict[str, int] = {}
        self._slow: list[tuple[str, float, str]] = []   # (kernel, ms, variant) since the last take
        self._knobs = _triton_runtime_knobs()
        if self._knobs is not None:
            self._before, self._after = self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._on_start, self._on_done

    def _on_start(self, **info):
        self._started[info["key"]] = time.perf_counter_ns()
        return self._before(**info) if self._before else None   # a true result would skip the compile

    def _on_done(self, **info):
        ns = time.perf_counter_ns() - self._started.pop(info["key"], time.perf_counter_ns())
        self._ns += ns
        if ns / 1e6 > SLOW_JIT_MS:
            variant = build_variant(info)[:1200]
            self._slow.append((info["fn"].name, ns / 1e6, variant))
            logger.warning("Triton compiled a new variant of %s in %.0f ms, during serving: %s",
                           info["fn"].name, ns / 1e6, variant)
        return self._after(**info) if self._after else None

    def take_slow(self) -> list[tuple[str, float, str]]:
        """The compiles over SLOW_JIT_MS since the last take: (kernel, ms, variant)."""
        slow, self._slow = self._slow, []
        return slow

    def take_ms(self) -> float:
        if self._knobs is None:
            return math.nan
        ns, self._ns = self._ns, 0
        return ns / 1e6

    def close(self) -> None:
        if self._knobs is not None and self._knobs.jit_cache_hook == self._on_start:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._before, self._after


class AllocCounter:
    """The caching allocator's device calls and cache flushes since the last `take`, from
    `torch.cuda.memory_stats`' event counters (read only while a trace is on)."""

    CALLS = ("num_device_alloc", "num_device_free")
    FLUSHES = ("num_alloc_retries", "num_sync_all_streams")

    def __init__(self) -> None:
        import torch
        self._stats = torch.cuda.memory.memory_stats_as_nested_dict if torch.cuda.is_available() else None
        self._last = self._read()

    def _read(self) -> tuple[int, int]:
        if self._stats is None:
            return 0, 0
        stats = self._stats()
        return sum(stats.get(k, 0) for k in self.CALLS), sum(stats.get(k, 0) for k in self.FLUSHES)

    def take(self) -> tuple[float, float]:
        if self._stats is None:
            return math.nan, math.nan
        now, last = self._read(), self._last
        self._last = now
        return float(now[0] - last[0]), float(now[1] - last[1])


def _one_line(text: str) -> str:
    return " ".join(text.split())


def slow_compiles(path: str) -> list[str]:
    """FILE.jit's lines (header left out): the compiles over SLOW_JIT_MS; [] without the file."""
    try:
        with open(path + JIT_SUFFIX) as f:
            return f.read().splitlines()[1:]
    except FileNotFoundError:
        return []


def _triton_runtime_knobs():
    try:
        from triton import knobs
        return knobs.runtime
    except (ImportError, AttributeError):   # no Triton, or one without JIT hooks
        return None


class StepTrace:
    """Collects step lines in memory and appends them to `path` in batches."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines: list[str] = []
        self._num_eager = 0   # the runner's count of forwards run without a graph, at the last step
        self._gc, self._jit, self._alloc = GcClock(), JitClock(), AllocCounter()
        with open(path, "w") as f:
            f.write(HEADER)
        if os.path.exists(path + JIT_SUFFIX):   # an earlier trace's compiles are not this one's
            os.remove(path + JIT_SUFFIX)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def record(self, start: float, step_s: float, wait_s: float, out_s: float, engine) -> None:
        launched = engine._in_flight
        rows, prompt = (len(launched.rows), engine.stats.last_prompt_tokens) if launched is not None else (0, 0)
        num_eager, self._num_eager = self._num_eager, engine.runner.num_eager_forwards
        eager = int(self._num_eager > num_eager)
        allocs, syncs = self._alloc.take()
        self._lines.append(f"{start:.6f}\t{step_s * 1e3:.3f}\t{wait_s * 1e3:.3f}\t{out_s * 1e3:.3f}\t{rows}\t"
                           f"{prompt}\t{eager}\t{self._gc.take_ms():.3f}\t{self._jit.take_ms():.3f}\t"
                           f"{allocs:.0f}\t{syncs:.0f}\t{engine.last_gpu_ms:.3f}\n")
        if len(self._lines) >= FLUSH_EVERY:
            self.flush()
        self._write_slow_compiles(start)

    def _write_slow_compiles(self, start: float) -> None:
        """The step's compiles over SLOW_JIT_MS into FILE.jit, at once (they are rare)."""
        slow = self._jit.take_slow()
        if not slow:
            return
        path = self.path + JIT_SUFFIX
        with open(path, "a") as f:
            if f.tell() == 0:
                f.write(JIT_HEADER)
            f.writelines(f"{start:.6f}\t{name}\t{ms:.1f}\t{_one_line(variant)}\n" for name, ms, variant in slow)

    def flush(self) -> None:
        with open(self.path, "a") as f:
            f.writelines(self._lines)
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._gc.close()
        self._jit.close()


class StepProfile:
    """A cProfile over the core's steps, written out every PROFILE_EVERY steps."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.profiler = cProfile.Profile()
        self.num_steps = 0

    @classmethod
    def from_env(cls) -> "StepProfile | None":
        path = os.environ.get(PROFILE_ENV)
        return cls(path) if path else None

    def __enter__(self) -> None:
        self.profiler.enable()

    def __exit__(self, *exc) -> None:
        self.profiler.disable()
        self.num_steps += 1
        if self.num_steps % PROFILE_EVERY == 0:
            self.flush()

    def flush(self) -> None:
        """The text summary at `path`, the raw stats beside it (`path`.pstats: callers and callees)."""
        self.profiler.dump_stats(self.path + ".pstats")
        with open(self.path, "w") as f:
            f.write(f"{self.num_steps} steps\n")
            stats = pstats.Stats(self.profiler, stream=f)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(30)


def now() -> float:
    return time.perf_counter()


def enable_sync_check_from_env() -> bool:
    """With KVSERVE_SYNC_CHECK=1 on a CUDA machine: warn at each synchronising call (first per site).
    Any value but unset, 0 or 1 is an error: a misspelt switch must not pass for "off"."""
    import torch
    value = os.environ.get(SYNC_CHECK_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SYNC_CHECK_ENV} must be 0 or 1, got {value!r}")
    if value != "1" or not torch.cuda.is_available():
        return False
    torch.cuda.set_sync_debug_mode("warn")
    return True


# -- the summary ------------------------------------------------------------------------
def read(path: str) -> list[dict[str, float]]:
    """The trace's lines; a file that is not one is a ValueError naming it."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:   # stage 4 gzips its trace
        names = f.readline().split()
        if names not in (HEADER.split(), GPU_HEADER.split(), ALLOC_HEADER.split(), OLD_HEADER.split()):
            raise ValueError(f"{path} is not a step trace: its header is {names}, expected {HEADER.split()}")
        missing = dict.fromkeys(("gc_ms", "jit_ms", "dev_allocs", "alloc_syncs", "prev_gpu_ms"), math.nan)
        return [{**missing, **_parse(path, number, names, line)}
                for number, line in enumerate(f, 2) if line.strip()]


def _parse(path: str, number: int, names: list[str], line: str) -> dict[str, float]:
    fields = line.split()
    try:
        if len(fields) != len(names):
            raise ValueError(f"{len(fields)} fields, expected {len(names)}")
        return dict(zip(names, map(float, fields)))
    except ValueError as e:
        raise ValueError(f"{path} line {number}: {e}") from None


def with_periods(steps: list[dict[str, float]], max_idle_ms: float = 500.0) -> list[dict[str, float]]:
    """Each line (named by the step it launched) gets:
    - `host_ms`: its step less the wait, the host's time to launch this step
      (and to finish the one before);
    - `rest_ms`: to the next line's start, less step and output (input polling);
    - `device_ms`: the next line's period. The next line waits for this step,
      so when the device sets the pace its period is this step's device time;
    - `gpu_ms`: the step's device span, first kernel to last (timed runs: the
      next line, which resolves it, records it; NaN in traces without it), and
      `gap_ms` = device_ms - gpu_ms, the device's idle time around the step;
    - `idle_before_ms`: the line before's gap_ms (NaN where that line has
      none): what this line's host time cost the device. A launch that stalls
      (a collection, a compile, a hidden synchronisation) leaves the device
      idle once the step before is done; one that blocks on the device's full
      launch queue waits while the device works, and costs it nothing.
    A line without two successors, or followed by an idle core (no work for
    `max_idle_ms`), has none."""
    out, gaps = [], {}
    for i, (a, b, c) in enumerate(zip(steps, steps[1:], steps[2:])):
        period = (b["start_s"] - a["start_s"]) * 1e3
        rest = period - a["step_ms"] - a["out_ms"]
        device = (c["start_s"] - b["start_s"]) * 1e3
        if rest <= max_idle_ms and device - b["step_ms"] - b["out_ms"] <= max_idle_ms:
            gpu = b.get("prev_gpu_ms", math.nan)   # lines built by hand (tests) may lack the column
            gaps[i] = device - gpu
            out.append({**a, "host_ms": a["step_ms"] - a["wait_ms"], "rest_ms": rest, "device_ms": device,
                        "gpu_ms": gpu, "gap_ms": gaps[i], "idle_before_ms": gaps.get(i - 1, math.nan)})
    return out


def kind(step: dict[str, float]) -> str:
    mode = "eager" if step["eager"] else "graph"
    return f"{'mixed' if step['prompt_tokens'] else 'decode'}/{mode}"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(steps: list[dict[str, float]]) -> str:
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    for s in with_periods(steps):
        groups[kind(s)].append(s)
        groups["all"].append(s)
    cols = ("device_ms", "gpu_ms", "gap_ms", "host_ms", "wait_ms", "out_ms", "rest_ms")
    lines = [f"{'kind':<14}{'steps':>7}{'rows p50':>9}{'prompt p50':>11}"
             + "".join(f"{c[:-3] + ' p50/p90':>18}" for c in cols)]
    for name, group in sorted(groups.items()):
        head = (f"{name:<14}{len(group):>7}{statistics.median(s['rows'] for s in group):>9.0f}"
                f"{statistics.median(s['prompt_tokens'] for s in group):>11.0f}")
        cells = "".join(f"{percentile([s[c] for s in group], .5):>10.2f}/{percentile([s[c] for s in group], .9):<7.2f}"
                        for c in cols)
        lines.append(head + cells)
    host_bound = sum(s["wait_ms"] < 0.1 for s in groups["all"]) / max(len(groups["all"]), 1)
    lines.append(f"ms per kind of launched step. device: the pipeline's time on the step (the next line's "
                 f"period); gpu: the device's span on it, first kernel to last (nan: not timed); gap: device "
                 f"- gpu, the device idle around it; host: launching it; wait: for the step before it "
                 f"(< 0.1 ms: the host set the pace, {host_bound:.0%} of steps)")
    return "\n".join(lines + decode_by_rows(groups["decode/graph"]) + mixed_by_prompt(groups["mixed/graph"])
                     + short_chunk_cost(groups["decode/graph"], groups["mixed/graph"]) + longest_host(groups["all"]))


def decode_by_rows(steps: list[dict[str, float]], width: int = 8) -> list[str]:
    """Graph decode steps' device ms by running rows (bins of `width`) and the fitted ms a row:
    the slope is what each running sequence costs a step (its KV reads, sampling, bookkeeping),
    the intercept what a step costs with none (the weights' read)."""
    bins: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        bins[int(s["rows"]) // width * width].append(s["device_ms"])
    cells = [f"{lo}-{lo + width - 1}: {statistics.median(v):.2f} ({len(v)})" for lo, v in sorted(bins.items())]
    if len({s["rows"] for s in steps}) < 2:
        return [f"decode/graph device ms p50 by rows: {', '.join(cells)}"] if cells else []
    lines = [f"decode/graph device ms p50 by rows (steps): {', '.join(cells)}; {_fit(steps, 'device_ms')}"]
    if not any(math.isnan(s["gpu_ms"]) for s in steps):
        lines.append(f"decode/graph gpu span: {_fit(steps, 'gpu_ms')}")
    return lines


def mixed_by_prompt(steps: list[dict[str, float]]) -> list[str]:
    """Graph mixed steps' device ms by the prompt tokens they carry (doubling bins from 64) and
    the fitted ms a prompt token: what a chunk beside the running decodes adds to their step,
    and so to their inter-token gap (the tail of ITL under Poisson arrivals)."""
    bins: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        bins[max(64, 1 << (int(s["prompt_tokens"]) - 1).bit_length())].append(s["device_ms"])
    cells = [f"<={hi}: {statistics.median(v):.2f} ({len(v)})" for hi, v in sorted(bins.items())]
    if len({s["prompt_tokens"] for s in steps}) < 2:
        return [f"mixed/graph device ms p50 by prompt tokens: {', '.join(cells)}"] if cells else []
    return [f"mixed/graph device ms p50 by prompt tokens (steps): {', '.join(cells)}; "
            f"{_fit(steps, 'device_ms', 'prompt_tokens', 'prompt token')}"]


def short_chunk_cost(decode: list[dict[str, float]], mixed: list[dict[str, float]],
                     max_prompt: int = 32, width: int = 16, min_steps: int = 5) -> list[str]:
    """What a graph mixed step carrying a short chunk (<= max_prompt tokens, ~20 us a token of
    compute) costs over a graph decode step of as many rows: device ms p50 of each, by rows in
    bins of `width`, where both kinds have `min_steps` steps or more."""
    bins: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for s in decode:
        bins[int(s["rows"]) // width * width][0].append(s["device_ms"])
    for s in mixed:
        if s["prompt_tokens"] <= max_prompt:
            bins[int(s["rows"]) // width * width][1].append(s["device_ms"])
    cells = [f"{lo}-{lo + width - 1}: {statistics.median(m):.2f} - {statistics.median(d):.2f} = "
             f"{statistics.median(m) - statistics.median(d):+.2f}" for lo, (d, m) in sorted(bins.items())
             if min(len(d), len(m)) >= min_steps]
    return [f"mixed/graph (<= {max_prompt} prompt tokens) - decode/graph device ms p50 by rows: "
            + ", ".join(cells)] if cells else []


def _fit(steps: list[dict[str, float]], column: str, by: str = "rows", unit: str = "row") -> str:
    fit = statistics.linear_regression([s[by] for s in steps], [s[column] for s in steps])
    return f"fit {fit.intercept:.2f} ms + {fit.slope * 1e3:.1f} us a {unit}"


def longest_host(steps: list[dict[str, float]], count: int = 5) -> list[str]:
    """The steps whose launch took the host longest, with what that cost the device (its idle
    time before the step: `with_periods`' idle_before_ms), their garbage-collection and compile
    time and the allocator's device calls and flushes."""
    worst = sorted(steps, key=lambda s: -s["host_ms"])[:count]
    return ["longest host ms: " + ", ".join(
        f"{s['host_ms']:.1f} at {s['start_s']:.2f} s ({kind(s)}, {s['prompt_tokens']:.0f} prompt, "
        f"device idle {_ms(s['idle_before_ms'])}, gc {_ms(s['gc_ms'])}, jit {_ms(s['jit_ms'])}, "
        f"allocs {_count(s['dev_allocs'])}, flushes {_count(s['alloc_syncs'])})" for s in worst)] if worst else []


def _ms(value: float) -> str:
    return "not traced" if math.isnan(value) else f"{value:.1f}"


def _count(value: float) -> str:
    return "not traced" if math.isnan(value) else f"{value:.0f}"


def busy_segments(steps: list[dict[str, float]], min_idle_s: float = 1.0) -> list[list[dict[str, float]]]:
    """The trace cut where the core sat idle for `min_idle_s` or more: one
    segment per benchmark run when a server served several."""
    segments = [steps[:1]]
    for a, b in zip(steps, steps[1:]):
        if b["start_s"] - a["start_s"] - (a["step_ms"] + a["out_ms"]) / 1e3 >= min_idle_s:
            segments.append([])
        segments[-1].append(b)
    return segments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or argv[1:] not in ([], ["--segments"]):
        print(f"usage: python -m kvserve.engine.step_trace FILE [--segments]   (FILE written by {ENV}=FILE "
              "kvserve serve; --segments: one summary per busy stretch, e.g. per benchmark run)")
        return 2
    try:
        steps = read(argv[0])
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 1
    for i, segment in enumerate(busy_segments(steps) if argv[1:] else [steps]):
        if argv[1:]:
            span = segment[-1]["start_s"] - segment[0]["start_s"]
            print(f"-- segment {i + 1}: {len(segment)} steps over {span:.1f} s")
        print(summary(segment))
    compiles = slow_compiles(argv[0])
    if compiles:
        print(f"-- Triton compiles over {SLOW_JIT_MS:.0f} ms (start_s, kernel, ms, variant; {argv[0]}{JIT_SUFFIX}):")
        print("\n".join(line[:300] for line in compiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
