"""DeepSeek V4 model bench on one GPU: `dummy:deepseek-v4-flash-l8` (V4-Flash
per-layer dims, 8 layers, 32 experts) in bf16 on the Triton kernel path.

Prints markdown tables of:
  * decode output tokens/s at batch 1, 64 and 256 x context 4K, 32K and 128K,
    CUDA graphs off (eager) and on;
  * prefill tokens/s of one 8K and one 64K prompt (8,192-token chunks, eager);
  * the KV pool at gpu_memory_utilization 0.9 and how many 32K-token
    sequences fit in it (the engine's own plan, kvserve/model/deepseek_v4/engine.py).

How decode contexts are built: no prefill runs. Every value of the KV pool
is filled with random numbers once, and each sequence gets block tables of
its own blocks, laid out as the V4 cache managers lay them out for a
sequence of that length (window groups hold only the window's blocks,
compressed groups a block where entries end). A decode step therefore reads
a full-length context of random keys, entries and indexer keys (top-k runs
over all of them), and writes its rows as the engine would. Timed: the
forward, the logits and a greedy argmax fed back as the next token, on the
device (no scheduler, no host batch preparation, no detokenisation).

    python benchmarks/v4_model_bench.py [--quick]
    python benchmarks/v4_model_bench.py --kernels 1 4096   # where a batch-1 step's time goes
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/v4_model_bench.py --builds   # what a cold start builds, and when
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve.cache.v4_specs import CompressedSpec
from kvserve.config import EngineArgs
from kvserve.engine.step_trace import build_variant
from kvserve.model.deepseek_v4.engine import build_v4_engine_parts, plan_v4_memory
from kvserve.model.deepseek_v4.graphs import V4Step

MODEL = "dummy:deepseek-v4-flash-l8"
BATCHES = (1, 64, 256)
CONTEXTS = (4096, 32768, 131072)
PREFILLS = (8192, 65536)
CHUNK = 8192
STEP_MARGIN = 256  # decode positions past the context: the bounds leave room for them


def build():
    args = EngineArgs(model=MODEL, dtype="bfloat16", device="cuda", block_size=16,
                      max_model_len=CONTEXTS[-1] + STEP_MARGIN, max_num_seqs=BATCHES[-1],
                      max_num_batched_tokens=CHUNK, gpu_memory_utilization=0.9, enforce_eager=True)
    parts = build_v4_engine_parts(args)
    storage = parts.runner.kv_storage
    for rows in storage.split(1 << 16):  # random pages: the contexts decode steps read
        rows.normal_()
    return parts.runner


class Tables:
    """Block tables of `batch` sequences of one length, each its own blocks."""

    def __init__(self, runner) -> None:
        self.layout, self.device = runner.layout.kv, runner.device
        self.num_blocks = runner.layout.num_blocks

    def slots(self, spec, first: int, end: int) -> torch.Tensor:
        """Which table slots of a sequence stepping from `first` to `end` hold real blocks."""
        B = self.layout.block_size
        slots = torch.arange(-(-end // B))
        if isinstance(spec, CompressedSpec):
            return ((slots + 1) * B // spec.rate) > (slots * B // spec.rate)
        return (slots + 1) * B > spec.visible_start(first)

    def needed(self, batch: int, first: int, end: int) -> int:
        return batch * sum(int(self.slots(g.kind.spec, first, end).sum()) for g in self.layout.groups)

    def build(self, batch: int, first: int, end: int) -> list[torch.Tensor] | None:
        """Tables for positions [first, end), or None when the pool is too small."""
        if self.needed(batch, first, end) > self.num_blocks - 1:
            return None
        tables, next_id = [], 1
        for g in self.layout.groups:
            real = self.slots(g.kind.spec, first, end)
            table = torch.zeros(batch, len(real), dtype=torch.int32)
            count = int(real.sum())
            table[:, real] = torch.arange(next_id, next_id + batch * count, dtype=torch.int32).view(batch, count)
            next_id += batch * count
            tables.append(table.to(self.device))
        return tables


@torch.inference_mode()
def decode_tok_s(runner, tables: list[torch.Tensor], batch: int, context: int, steps: int, warmup: int) -> float:
    device = runner.device
    ids = torch.randint(0, runner.model.config.vocab_size, (batch,), device=device)
    seq_idx = torch.arange(batch, dtype=torch.int32, device=device)
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        positions = torch.full((batch,), context + i, dtype=torch.long, device=device)
        step = V4Step(ids, positions, seq_idx, tables, batch, context + i + 1)
        hidden = runner.forward_step(step)
        ids = runner.model.compute_logits(hidden).argmax(-1)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


@torch.inference_mode()
def prefill_tok_s(runner, tables: list[torch.Tensor], length: int) -> float:
    device = runner.device
    ids = torch.randint(0, runner.model.config.vocab_size, (length,), device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, length, CHUNK):
        end = min(length, first + CHUNK)
        positions = torch.arange(first, end, device=device)
        step = V4Step(ids[first:end], positions, torch.zeros(end - first, dtype=torch.int32, device=device),
                      tables, 1, end)
        hidden = runner.forward_step(step)
    runner.model.compute_logits(hidden[-1:]).argmax(-1)
    torch.cuda.synchronize()
    return length / (time.perf_counter() - start)


def capture(runner, steps: int):
    """Graphs for the bench's batch sizes and contexts, or (None, why not)."""
    bounds = [c + steps + 8 for c in CONTEXTS]
    graphs = runner.static_graphs(bounds[-1], BATCHES[-1], BATCHES[-1], mixed=False, sizes=list(BATCHES),
                                  bounds=bounds)
    reason = graphs.host_sync_reason()
    if reason is not None:
        return None, f"not captured: the forward synchronises the host ({reason})"
    start = time.perf_counter()
    graphs.capture(torch.cuda.graph_pool_handle())
    return graphs, f"{len(graphs.graphs)} graphs captured in {time.perf_counter() - start:.1f} s"


def decode_table(runner, tables: Tables, steps: int, warmup: int) -> None:
    graphs, note = capture(runner, warmup + steps)
    print(f"\n## Decode output tokens/s ({steps} timed steps after {warmup}; graphs: {note})\n")
    print("| batch | context | eager tok/s | graphs tok/s | graphs / eager |")
    print("|---:|---:|---:|---:|---:|")
    for context in CONTEXTS:
        for batch in BATCHES:
            built = tables.build(batch, context, context + warmup + steps)
            if built is None:
                fits = (tables.num_blocks - 1) // max(1, tables.needed(1, context, context + warmup + steps))
                print(f"| {batch} | {context:,} | does not fit ({fits} sequences of this context do) | | |")
                continue
            runner.graphs = None
            eager = decode_tok_s(runner, built, batch, context, steps, warmup)
            runner.graphs = graphs
            graphed = decode_tok_s(runner, built, batch, context, steps, warmup) if graphs else float("nan")
            print(f"| {batch} | {context:,} | {eager:,.0f} | {graphed:,.0f} | {graphed / eager:.2f}x |", flush=True)
    runner.graphs = None


def prefill_table(runner, tables: Tables) -> None:
    print(f"\n## Prefill tokens/s (one prompt, {CHUNK:,}-token chunks, eager; random token ids)\n")
    print("| prompt tokens | tok/s | seconds |")
    print("|---:|---:|---:|")
    prefill_tok_s(runner, tables.build(1, 0, PREFILLS[0]), PREFILLS[0])  # compiles the prefill kernels
    for length in PREFILLS:
        rate = prefill_tok_s(runner, tables.build(1, 0, length), length)
        print(f"| {length:,} | {rate:,.0f} | {length / rate:.2f} |", flush=True)


class Builds:
    """Every Triton build (kernel, ms, variant) from the JIT hooks, for `--builds`. The start-up's
    builds run on several threads (`kernels/warmup.py`): their milliseconds overlap, so a phase's
    sum can exceed its wall time."""

    def __init__(self) -> None:
        from triton import knobs
        self.rows: list[tuple[str, float, str]] = []
        self._started: dict[str, float] = {}
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._start, self._done

    def _start(self, **info):
        self._started[info["key"]] = time.perf_counter()

    def _done(self, **info):
        ms = (time.perf_counter() - self._started.pop(info["key"], time.perf_counter())) * 1e3
        self.rows.append((info["fn"].name, ms, build_variant(info)))

    def report(self, phase: str) -> None:
        rows, self.rows = self.rows, []
        print(f"\n{phase}: {len(rows)} builds, {sum(r[1] for r in rows) / 1e3:.1f} s")
        for name, ms, variant in rows:
            print(f"  {ms:8.0f} ms  {name}  {variant}")


def builds_report(runner, tables: "Tables", builds: Builds) -> None:
    """Which kernels a 64K prompt's chunks build after the engine's start-up, chunk by chunk."""
    builds.report("engine start-up")
    prefill_tok_s(runner, tables.build(1, 0, PREFILLS[0]), PREFILLS[0])
    builds.report(f"a {PREFILLS[0]:,}-token prefill")
    length = PREFILLS[-1]
    built, device = tables.build(1, 0, length), runner.device
    ids = torch.randint(0, runner.model.config.vocab_size, (length,), device=device)
    with torch.inference_mode():
        for first in range(0, length, CHUNK):
            start = time.perf_counter()
            positions = torch.arange(first, first + CHUNK, device=device)
            seq = torch.zeros(CHUNK, dtype=torch.int32, device=device)
            runner.forward_step(V4Step(ids[first:first + CHUNK], positions, seq, built, 1, first + CHUNK))
            torch.cuda.synchronize()
            builds.report(f"chunk at {first:,} ({(time.perf_counter() - start) * 1e3:.0f} ms)")


def pool_table(runner) -> None:
    layout = runner.layout
    dtype_bytes = layout.bytes_per_block // layout.kv.unit
    plan = plan_v4_memory(layout.num_blocks * layout.bytes_per_block, layout.kv, dtype_bytes)
    print("\n## KV pool at gpu_memory_utilization 0.9\n")
    print("| pool GiB | blocks (16 tokens) | block KiB | 32K-token sequences that fit "
          "| tokens of context, windows aside |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {plan.num_blocks * plan.block_bytes / 1024**3:.1f} | {plan.num_blocks:,} | {plan.block_bytes / 1024:.0f} "
          f"| {plan.num_seqs} | {plan.max_context_tokens:,} |")


def kernel_table(runner, tables: Tables, batch: int, context: int, top: int = 15) -> None:
    """Where a graph-replayed decode step's device time goes at one shape:
    the top kernels' microseconds and launches per step, and their totals."""
    from torch.profiler import ProfilerActivity, profile

    from kvserve.bench.profile import kernel_rows
    steps, warmup = 6, 2
    graphs, note = capture(runner, 2 * (steps + warmup))
    built = tables.build(batch, context, context + 2 * (steps + warmup))
    runner.graphs = graphs
    decode_tok_s(runner, built, batch, context, steps, warmup)  # replays once outside the profiler
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_tok_s(runner, built, batch, context + steps + warmup, steps, warmup)
    runner.graphs = None
    n = steps + warmup
    rows = [(r["name"], r["us"] / n, r["calls"] / n) for r in kernel_rows(prof, on_gpu=True)]
    print(f"\n## Device kernels per decode step, batch {batch}, context {context:,} (graphs: {note})\n")
    print(f"{len(rows)} kernels, {sum(r[2] for r in rows):.0f} launches and "
          f"{sum(r[1] for r in rows):,.0f} us of kernel time per step\n")
    print("| kernel | us / step | launches / step |")
    print("|---|---:|---:|")
    for name, us, calls in rows[:top]:
        print(f"| `{name[:70]}` | {us:,.1f} | {calls:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (a smoke run)")
    parser.add_argument("--kernels", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                        help="only the device-kernel table of graph-replayed decode steps at this shape")
    parser.add_argument("--builds", action="store_true",
                        help="only the Triton builds of start-up, an 8K prefill and each chunk of a 64K one")
    a = parser.parse_args()
    steps, warmup = (5, 2) if a.quick else (20, 3)
    start = time.perf_counter()
    builds = Builds() if a.builds else None
    runner = build()
    print(f"# DeepSeek V4 model bench: {MODEL}, bf16, {torch.cuda.get_device_name()}")
    print(f"(engine built and pool filled in {time.perf_counter() - start:.0f} s)")
    tables = Tables(runner)
    if a.kernels:
        kernel_table(runner, tables, *a.kernels)
        return
    if builds is not None:
        builds_report(runner, tables, builds)
        return
    pool_table(runner)
    decode_table(runner, tables, steps, warmup)
    prefill_table(runner, tables)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
