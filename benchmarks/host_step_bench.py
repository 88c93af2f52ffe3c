"""Host microseconds per engine step with N running decode requests.

Measures the host work a step does besides the model: the scheduler
(`schedule` + `update_after_step`), the engine's bookkeeping (block-id
gathering, output processing, stats: the rest of `LLMEngine.step`), a
metrics snapshot (`get_metrics`: timed every step, as the server once
published it; `kvserve serve`'s engine core now sends one at most every
`METRICS_INTERVAL_S`, so a served step costs the total less this part), and
input preparation (`prepare_inputs`: host batch, block tables, uploads).
"host total" is their sum, defined so since the first runs. "core_out" is
what `kvserve serve`'s engine core adds to every step: one `CoreOutput` per
request that got a token, encoded as the IPC sends it; printed beside the
total, not in it, so that the total stays comparable with earlier runs. The forward/sampling launch and the wait for the
step in flight are printed for context only: on CPU they are the model's
compute, on CUDA the launch is Python kernel launches (or a graph replay).
`--stub-forward` (CPU) replaces the transformer layers by zeros: the host
parts do not depend on them, and a busy 2-core machine then finishes the run.

    python benchmarks/host_step_bench.py --stub-forward      # CPU, tiny model
    python benchmarks/host_step_bench.py --model dummy:qwen3-8b --device cuda
    python benchmarks/host_step_bench.py --stub-forward --running 256 --parts

`--leave-per-step K` aborts K running requests (untimed) before every timed
step: the running set then changes every step, as it does in a server where
requests finish. The decode streak goes on without the rows that left (before
2026-12-05 the steps took the general paths instead).

`--finish-per-step K` gives the running requests staggered output limits once
they decode, so that K of them reach theirs and finish in every timed step,
inside it: the step's bookkeeping then pays what a server's does for a finish
(the request leaves the scheduler, its KV is freed), and the running set
changes as with `--leave-per-step`.

`--parts` also prints the callables inside those parts (`PARTS`), each's
microseconds per step (mean over the timed steps) and calls per step: where a
part's time goes, without a profiler's per-call overhead.

Each engine is set up as `kvserve serve`'s engine core sets up its own
(`set_up_as_served`: one torch CPU thread on CUDA, the start-up heap frozen
against the garbage collector); `--as-built` leaves it as built, as the
records before this set-up measured. `--wait-mode` sets how the engine's thread waits for the
GPU (`kvserve/runner/cuda_wait.py`; records before 2026-12-04 ran CUDA's default, "auto").

After the table a line says what else ran during each count's timed steps: this process's
involuntary context switches a step, the machine's steal time (a VM's vCPUs kept waiting), and
the core the engine's thread last ran on with its clock. The same code on the same H200 host has
read 989 and 1,448 us at 256 in two processes (docs/BENCHMARKS_HISTORY.md); these say which of those
causes, if any, differed.

Requests are staggered in prompt length so block-boundary allocations spread
over steps as they do in a server, and every timed step is a decode of all N.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import msgspec
import torch

from kvserve.config import EngineArgs
from kvserve.engine.core_process import EngineCore, limit_host_threads
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.llm_engine import LLMEngine
from kvserve.runner import batch, model_runner
from kvserve.runner.cuda_wait import DEFAULT_WAIT, WAIT_FLAGS
from kvserve.runner.model_runner import InFlightStep
from kvserve.sampling_params import SamplingParams

try:   # absent before the staging module existed (host_step_ab.py runs this file against older trees)
    from kvserve.runner import staging
except ImportError:
    staging = None

HOST_PARTS = ("schedule", "bookkeeping", "metrics", "input_prep")
ENCODER = msgspec.msgpack.Encoder()


class StepTimer:
    """Accumulates nanoseconds per part while `active`; wraps engine callables."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.active = False

    def wrap(self, part: str, fn: Callable[..., Any], count: bool = False) -> Callable[..., Any]:
        calls = "calls:" + part.removeprefix("part:")

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.ns[part] += time.perf_counter_ns() - start
                    if count:
                        self.ns[calls] += 1
        return timed

    def take(self) -> dict[str, int]:
        ns, self.ns = dict(self.ns), defaultdict(int)
        return ns


# (owner, attribute) of each callable `--parts` times; owner: an engine -> object.
PARTS = (
    (lambda e: e.scheduler, "_running_rows"), (lambda e: e.scheduler, "_allocate_running"),
    (lambda e: e.kv_cache, "_open_next_block"), (lambda e: e.kv_cache, "_open_run_blocks"),
    (lambda e: e.kv_cache, "free"), (lambda e: e.kv_cache, "_offer_deferred"),
    (lambda e: e.scheduler, "update_after_step"),
    (lambda e: e.kv_cache, "block_tables"), (lambda e: batch, "build_host_batch"),
    (lambda e: batch, "slot_mapping"), (lambda e: batch, "upload_packed"),
    (lambda e: getattr(staging, "StagingRing", None), "take"),
    (lambda e: getattr(staging, "StagingRing", None), "_lay_out"),
    (lambda e: getattr(staging, "StagingRing", None), "copied"), (lambda e: torch.cuda, "current_stream"),
    (lambda e: e.runner, "_fill_pending"), (lambda e: e.runner, "_forward"),
    (lambda e: e.runner.model, "compute_logits"), (lambda e: e.runner.sampler, "sample"),
    (lambda e: e, "_process"), (lambda e: e.stats, "record_step"), (lambda e: e, "_start_write_backs"),
)


def stub_forward(engine: LLMEngine) -> None:
    hidden = engine.model_config.hidden_size
    runner = engine.runner
    runner._forward = lambda inputs, *_: torch.zeros(inputs.meta.num_tokens, hidden, device=runner.device)


def instrument(engine: LLMEngine, timer: StepTimer) -> Callable[[], None]:
    """Wrap the timed callables; returns the undo for the module-level ones."""
    sched = engine.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_after_step = timer.wrap("schedule", sched.update_after_step)
    runner = engine.runner
    # The engine launches a step through `prepare` and `run` (a tree before them: `launch`);
    # either way "launch" is the step's input preparation, forward and sampling launch.
    for name in ("prepare", "run") if hasattr(runner, "prepare") else ("launch",):
        setattr(runner, name, timer.wrap("launch", getattr(runner, name)))
    prepare, resolve = model_runner.prepare_inputs, InFlightStep.resolve
    model_runner.prepare_inputs = timer.wrap("input_prep", prepare)
    InFlightStep.resolve = timer.wrap("wait", resolve)

    def undo() -> None:
        model_runner.prepare_inputs, InFlightStep.resolve = prepare, resolve
    return undo


def instrument_parts(engine: LLMEngine, timer: StepTimer) -> Callable[[], None]:
    """Wrap every `PARTS` callable (timed as "part:NAME", its calls as "calls:NAME")."""
    saved = []
    for owner_of, name in PARTS:
        owner = owner_of(engine)
        fn = getattr(owner, name, None)
        if fn is None:   # an older tree (host_step_ab.py) or another model's runner
            continue
        saved.append((owner, name, owner.__dict__.get(name, fn) if isinstance(owner, type) else fn))
        setattr(owner, name, timer.wrap(f"part:{name}", fn, count=True))

    def undo() -> None:
        for owner, name, fn in reversed(saved):
            if isinstance(owner, type) or owner in (batch, staging, torch.cuda):
                setattr(owner, name, fn)
            else:
                delattr(owner, name)   # the instance attribute hid the class's method
    return undo


def build_engine(a: argparse.Namespace, n: int) -> LLMEngine:
    overrides = json.loads(a.hf_overrides) if a.hf_overrides else None
    max_len = a.prompt_len + a.block_size + a.warmup + a.steps + 64
    num_blocks = a.num_kv_blocks
    if num_blocks is None and a.device == "cpu":  # the CPU default holds 4 sequences
        num_blocks = 2 * n * -(-max_len // a.block_size) + 1
    engine = LLMEngine(EngineArgs(
        model=a.model, device=a.device, dtype=a.dtype, block_size=a.block_size,
        max_num_seqs=n, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=max_len, num_kv_blocks=num_blocks, hf_overrides=overrides,
        enforce_eager=a.enforce_eager, usage="server"))
    if not a.as_built:
        set_up_as_served(engine)
    return engine


def set_up_as_served(engine: LLMEngine) -> None:
    """What `kvserve serve`'s engine core does to its engine once built: one
    torch CPU thread when it drives a GPU (`limit_host_threads`), and the
    start-up heap frozen (`freeze_startup_heap`), so that the garbage
    collector's passes skip it. `measure` unfreezes it."""
    limit_host_threads(engine)
    freeze_startup_heap()


def add_requests(engine: LLMEngine, n: int, a: argparse.Namespace) -> None:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=a.warmup + a.steps + 32, ignore_eos=True, temperature=a.temperature)
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(a.prompt_len + i % a.block_size)]
        engine.add_request(engine.make_request(prompt, params))


def all_decoding(engine: LLMEngine, n: int) -> bool:
    running = engine.scheduler.running
    return len(running) == n and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)


def measure(a: argparse.Namespace, n: int) -> dict[str, float]:
    engine = build_engine(a, n)
    if a.pin_core is not None:   # this thread (the engine's) alone; threads started before keep theirs
        os.sched_setaffinity(0, {a.pin_core})
    timer = StepTimer()
    undos = [instrument(engine, timer)] + ([instrument_parts(engine, timer)] if a.parts else [])
    try:
        return run_steps(engine, timer, a, n)
    finally:
        for undo in reversed(undos):
            undo()
        undos.clear()   # their closures hold the engine's methods: gone before the collection below
        del engine
        gc.unfreeze()   # `set_up_as_served` froze the engine: it must be collectable now
        gc.collect()  # the next engine sizes its KV cache from free device memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def prepare(engine: LLMEngine, a: argparse.Namespace, n: int) -> EngineCore:
    """`n` requests decoding, warmed up; the engine core whose output builder the steps time."""
    for core in preparation(engine, a, n):
        pass
    return core


def preparation(engine: LLMEngine, a: argparse.Namespace, n: int) -> Iterator[EngineCore]:
    """`prepare`, one engine step at a time (the core after each): host_step_ab.py
    interleaves two engines' preparations, so neither builds its requests' objects
    all after the other's."""
    if a.stub_forward:
        stub_forward(engine)
    add_requests(engine, n, a)
    core = EngineCore(engine, transport=None)   # only its output builder runs here
    core._num_sent.update((request_id, 0) for request_id in engine.requests)
    while not all_decoding(engine, n):
        core_outputs(core, engine.step())
        yield core
    for _ in range(a.warmup):
        core_outputs(core, engine.step())
        engine.get_metrics()
        yield core


def run_steps(engine: LLMEngine, timer: StepTimer, a: argparse.Namespace, n: int) -> dict[str, float]:
    core = prepare(engine, a, n)
    stagger_limits(engine, a.finish_per_step)
    samples, rng, yardstick = [], random.Random(1), Yardstick()
    before = host_counters()
    for _ in range(a.steps):
        leave(engine, a.leave_per_step, rng)
        yardstick.measure()
        samples.append(timed_step(engine, core, timer))
    state = host_state(before, host_counters(), a.steps)
    # Median (robust to another process taking the CPU for a step) or, on a
    # busy shared machine, each part's best step.
    stat = statistics.median if a.stat == "median" else min
    row = {part: stat(s[part] for s in samples) / 1e3 for part in samples[0] if ":" not in part}
    row["free"] = time_frees(engine)
    row["yardstick"] = yardstick.us()
    row.update(state)
    inner = {k for s in samples for k in s if ":" in k}   # `--parts`: means, a call need not come every step
    row.update({k: sum(s.get(k, 0) for s in samples) / len(samples) / (1 if k.startswith("calls:") else 1e3)
                for k in inner})
    return row


class Yardstick:
    """This process's speed while the steps run: a fixed Python pass over 256
    objects (`cuda_api_probe.python_pass`, the shape of the engine's per-request
    loops) timed before each step, untimed for the step; `us()` is its median.
    A virtual machine's speed changes over minutes, and two processes of the same
    code on one host have read ~2x apart in every part of a step (docs/BENCHMARKS.md,
    2026-12-06); where this pass moves by as much, the machine did, not the code."""

    def __init__(self) -> None:
        from cuda_api_probe import Row, python_pass
        self._pass, self._rows, self._ns = python_pass, [Row(i) for i in range(256)], []

    def measure(self) -> None:
        start = time.perf_counter_ns()
        self._pass(self._rows)
        self._ns.append(time.perf_counter_ns() - start)

    def us(self) -> float:
        return statistics.median(self._ns) / 1e3 if self._ns else float("nan")


def host_counters() -> dict[str, float]:
    """What the host did besides this bench, so far: this process's involuntary context switches
    (another thread or process took its core), the machine's CPU time and its steal time (a VM's
    vCPUs waiting for the physical CPU) in jiffies, and the core this thread last ran on (-1 where
    /proc lacks them: not Linux)."""
    counters = {"ivcsw": float(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw), "cpu": 0.0, "steal": 0.0,
                "core": -1.0}
    try:
        with open("/proc/stat") as f:
            counters["cpu"], counters["steal"] = cpu_times(f.readline())
        with open("/proc/thread-self/stat") as f:
            counters["core"] = float(last_core(f.read()))
    except (OSError, ValueError, IndexError):
        pass
    return counters


def cpu_times(line: str) -> tuple[float, float]:
    """(all, steal) jiffies of /proc/stat's first line: user nice system idle iowait irq softirq steal."""
    fields = [float(x) for x in line.split()[1:9]]
    return sum(fields), fields[7]


def last_core(stat: str) -> int:
    """The `processor` field (39th) of a /proc/<pid>/stat line; the name (2nd) may hold spaces."""
    return int(stat[stat.rindex(")") + 2:].split()[36])


def core_mhz(core: int) -> float:
    """The core's clock as /proc/cpuinfo reports it now (-1 if unknown; many VMs report a constant)."""
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        return -1.0
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if fields.get("processor") == str(core) and "cpu MHz" in fields:
            return float(fields["cpu MHz"])
    return -1.0


def host_state(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Over the timed steps: involuntary context switches a step, the machine's steal time in % of
    its CPU time, the core last run on and its MHz (host-state columns of the printed table)."""
    cpu = after["cpu"] - before["cpu"]
    core = int(after["core"])
    return {"ivcsw": (after["ivcsw"] - before["ivcsw"]) / max(steps, 1),
            "steal_pct": 100.0 * (after["steal"] - before["steal"]) / cpu if cpu > 0 else float("nan"),
            "core": core, "mhz": core_mhz(core) if core >= 0 else -1.0}


def leave(engine: LLMEngine, count: int, rng: random.Random) -> None:
    """`--leave-per-step`: abort `count` running requests, untimed, before a step.
    The running set changes, as it does in a server on nearly every step (a
    request finishes): the decode streak goes on without the rows that left
    (`kvserve/scheduler.py`'s `DecodeStreak.next_step`), the cache's decode run
    starts anew (`kvserve/cache/decode_run.py`)."""
    running = engine.scheduler.running
    for _ in range(min(count, len(running) - 1)):
        engine.abort_request(running[rng.randrange(len(running))].request_id)


def stagger_limits(engine: LLMEngine, per_step: int) -> None:
    """`--finish-per-step`: the running requests, in a random order, the i-th
    may give i // per_step more tokens than the step in flight brings it to, so
    `per_step` of them finish in each timed step (as the step before resolves,
    in the timed step's bookkeeping), from anywhere in the running
    order as in a server. Each gets its own parameters, as a server's requests do."""
    if not per_step:
        return
    running = list(engine.scheduler.running)
    random.Random(2).shuffle(running)
    for i, request in enumerate(running):
        limit = len(request.output_token_ids) + max(request.num_pending_tokens, 1) + i // per_step
        request.sampling_params = request.sampling_params.with_max_tokens(limit)
        request.set_token_checks(engine.scheduler_config.max_model_len)
    # The decode streak's bound on the tokens its rows may still take was set under the
    # old limits: drop it, so that the next step's rows come from the limits above.
    engine.scheduler._streak = None


def time_frees(engine: LLMEngine) -> float:
    """Median us of freeing one running request's KV after the timed steps, which
    offers the blocks its decode steps filled to the prefix cache (about
    (warmup + steps) / block_size of them here). A served request pays it once,
    when it finishes; the steps above do not include it. Leaves the engine
    unusable (its requests still run); run last."""
    kv, times = engine.kv_cache, []
    for request in list(engine.scheduler.running):
        start = time.perf_counter_ns()
        kv.free(request)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3 if times else 0.0


def core_outputs(core: EngineCore, touched: list) -> bytes:
    """What the engine core builds and sends after a step (`EngineCore._step`)."""
    return ENCODER.encode(core._outputs(touched))


def timed_step(engine: LLMEngine, core: EngineCore, timer: StepTimer) -> dict[str, int]:
    timer.active = True
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter_ns()
    touched = engine.step()
    step_ns = time.perf_counter_ns() - start
    engine.get_metrics()  # timed every step (the served core: at most every METRICS_INTERVAL_S)
    metrics_ns = time.perf_counter_ns() - start - step_ns
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    timer.active = False
    out_start = time.perf_counter_ns()
    core_outputs(core, touched)
    out_ns = time.perf_counter_ns() - out_start
    ns = timer.take()
    launch, prep = ns.get("launch", 0), ns.get("input_prep", 0)
    return {**{k: v for k, v in ns.items() if ":" in k}, "schedule": ns.get("schedule", 0),
            "bookkeeping": step_ns - ns.get("schedule", 0) - launch - ns.get("wait", 0),
            "metrics": metrics_ns, "input_prep": prep, "core_out": out_ns,
            "launch_rest": launch - prep, "wait": ns.get("wait", 0), "faults": faults * 1000}


def print_table(rows: dict[int, dict[str, float]], stat: str) -> None:
    head = ("running", *HOST_PARTS, "host_total", "core_out+", "launch_rest*", "wait*", "faults#")
    print(" ".join(f"{h:>12}" for h in head))
    for n, r in rows.items():
        total = sum(r[p] for p in HOST_PARTS)
        cells = [r[p] for p in HOST_PARTS] + [total, r["core_out"], r["launch_rest"], r["wait"], r["faults"]]
        print(f"{n:>12} " + " ".join(f"{c:>12.1f}" for c in cells))
    print_parts(rows)
    print("free (us, median): a request's KV freed after the timed steps, its decode-filled blocks "
          "offered to the prefix cache (once per finished request; not in the steps): "
          + ", ".join(f"{r['free']:.1f} at {n}" for n, r in rows.items()))
    print("host state over the timed steps (what else ran): " + "; ".join(
        f"{n}: {r['ivcsw']:.2f} involuntary context switches a step, machine steal {r['steal_pct']:.1f}%, "
        f"last on core {r['core']} at {r['mhz']:.0f} MHz, a fixed Python pass over 256 objects "
        f"{r['yardstick']:.1f} us (this process's speed)" for n, r in rows.items()))
    print(f"microseconds per step ({stat} over the timed steps); + serving's engine core adds it to every step "
          "(not in host_total); * not host bookkeeping: forward/sampling launch (CPU: the compute) and the wait "
          "for the step in flight; # minor page faults in the step and its metrics (the memory the host's "
          "allocators map anew: a VM's fresh pages can cost microseconds each)")


def print_parts(rows: dict[int, dict[str, float]]) -> None:
    """`--parts`: each inner callable's us per step and calls per step, per running count."""
    names = [name for _, name in PARTS if any(f"part:{name}" in r for r in rows.values())]
    if not names:
        return
    print(f"{'inner part (mean us / calls per step)':>40} " + " ".join(f"{n:>16}" for n in rows))
    for name in names:
        cells = [f"{r.get('part:' + name, 0):9.1f} /{r.get('calls:' + name, 0):5.1f}" for r in rows.values()]
        print(f"{name:>40} " + " ".join(f"{c:>16}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--running", default="32,128,256", help="comma-separated running-request counts")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--hf-overrides", default='{"max_position_embeddings": 4096}',
                   help="JSON merged into the model config (the tiny models' 512 positions are too few)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--stat", default="median", choices=["median", "min"],
                   help="per part over the timed steps (min: each part's best step, for busy machines)")
    p.add_argument("--as-built", action="store_true",
                   help="skip the served engine core's set-up (one torch thread on CUDA, the start-up heap "
                        "frozen), as the records measured before the bench did it")
    p.add_argument("--parts", action="store_true",
                   help="also time the callables inside the parts (PARTS): us and calls per step")
    p.add_argument("--stub-forward", action="store_true",
                   help="zeros instead of the transformer layers (host parts unchanged)")
    p.add_argument("--wait-mode", choices=sorted(WAIT_FLAGS), default=None,
                   help="CUDA: how the host thread waits for the device (KVSERVE_CUDA_WAIT, the context's "
                        f"scheduling flag; unset: the engine's, {DEFAULT_WAIT!r} unless the environment says)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the requests' sampling temperature (0: greedy, so that on CPU the sampling's "
                        "compute does not swamp the launch's host time in launch_rest)")
    p.add_argument("--leave-per-step", type=int, default=0,
                   help="abort this many running requests before each timed step (untimed): the running "
                        "set changes every step, as in a server (the decode streak goes on without them); a row's N "
                        "is then its count at the first timed step, N - steps x this at the last")
    p.add_argument("--finish-per-step", type=int, default=0,
                   help="stagger the running requests' output limits so that this many finish inside "
                        "each timed step (timed: the scheduler lets them go, their KV is freed); "
                        "--steps x this must stay below --running")
    p.add_argument("--pin-core", type=int, default=None,
                   help="pin the engine's thread to this CPU core once the engine is built")
    a = p.parse_args(argv)
    if a.leave_per_step < 0:
        p.error(f"--leave-per-step must be >= 0, got {a.leave_per_step}")
    if a.finish_per_step < 0:
        p.error(f"--finish-per-step must be >= 0, got {a.finish_per_step}")
    fewest = min(int(x) for x in a.running.split(","))
    if a.finish_per_step * a.steps >= fewest:
        p.error(f"--finish-per-step x --steps must stay below the fewest --running ({fewest}), "
                f"got {a.finish_per_step} x {a.steps}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.wait_mode is not None:
        os.environ["KVSERVE_CUDA_WAIT"] = a.wait_mode   # the engine sets it on the context it starts
    rows = {n: measure(a, n) for n in (int(x) for x in a.running.split(","))}
    print(f"model={a.model} device={a.device} prompt_len={a.prompt_len}(+0..{a.block_size - 1}) "
          f"block_size={a.block_size} steps={a.steps} stub_forward={a.stub_forward} "
          f"wait_mode={a.wait_mode or os.environ.get('KVSERVE_CUDA_WAIT', DEFAULT_WAIT)} pin_core={a.pin_core}")
    print_table(rows, a.stat)


if __name__ == "__main__":
    main()
