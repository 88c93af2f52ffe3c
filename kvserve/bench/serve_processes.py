"""`kvserve bench serve --client-processes N`: one run's requests sent from N client processes.

One asyncio loop that parses every streamed chunk falls behind its Poisson schedule at high
rates: on an H200 at 80 req/s the send lag reached seconds (docs/BENCHMARKS.md), so such a run
measured the client, not the server. Here each process takes whole conversations (a follow-up
turn stays with the turn it waits for) and keeps the shared schedule from one start time.
Latencies are measured inside each process; only the start crosses processes, as wall-clock
time on the same machine.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from kvserve.bench.workloads import WorkloadRequest

# Time for the processes to start (spawn, imports, `BenchClient.warm_up`) before the first request is due.
LEAD_S = 2.0


def owners(requests: list[WorkloadRequest], processes: int) -> list[int]:
    """The process of each request: first turns round-robin, follow-ups with their predecessor."""
    owner: list[int] = []
    first_turns = 0
    for request in requests:
        if request.after is None:
            owner.append(first_turns % processes)
            first_turns += 1
        else:
            owner.append(owner[request.after])
    return owner


def split(requests: list[WorkloadRequest], due: list[float], processes: int):
    """Per process: (the requests' indices in the run, the requests with `after` renumbered, due times)."""
    owner = owners(requests, processes)
    parts = []
    for p in range(processes):
        indices = [i for i, o in enumerate(owner) if o == p]
        local = {run_index: i for i, run_index in enumerate(indices)}
        mine = [replace(requests[i], after=None if requests[i].after is None else local[requests[i].after])
                for i in indices]
        parts.append((indices, mine, [due[i] for i in indices]))
    return parts


async def send_in_processes(client, requests: list[WorkloadRequest], due: list[float],
                            max_concurrency: int | None, processes: int, start: float) -> list:
    """Results in request order; `start` is this process's perf_counter time of due time 0."""
    start_wall = time.time() + (start - time.perf_counter())
    limit = -(-max_concurrency // processes) if max_concurrency else None
    parts = split(requests, due, processes)
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [loop.run_in_executor(pool, run_part, client.url, client.model, client.ignore_eos,
                                     client.timeout_s, mine, part_due, start_wall, limit)
                for _, mine, part_due in parts]
        part_results = await asyncio.gather(*jobs)
    results: list = [None] * len(requests)
    for (indices, _, _), rows in zip(parts, part_results):
        for i, row in zip(indices, rows):
            results[i] = row
    return results


def run_part(url: str, model: str, ignore_eos: bool, timeout_s: float, requests: list[WorkloadRequest],
             due: list[float], start_wall: float, limit: int | None) -> list:
    """A client process: its share of the run, on the shared schedule."""
    return asyncio.run(_part(url, model, ignore_eos, timeout_s, requests, due, start_wall, limit))


async def _part(url, model, ignore_eos, timeout_s, requests, due, start_wall, limit) -> list:
    from kvserve.bench.serve import BenchClient, send_on_schedule
    client = BenchClient(url, model, ignore_eos, timeout_s)
    try:
        await client.warm_up()
        return await send_on_schedule(client, requests, due, limit, time.perf_counter() + start_wall - time.time())
    finally:
        await client.close()
