"""CPU simulation of a multi-turn workload through the real Scheduler and
KVCacheManager (no model: each computed step samples a random token).

Shape follows the code-review workload (kvserve/bench/workloads.py): each
conversation's turn k+1 re-sends turn k's prompt plus a new synthetic reply
and new user text, and is submitted when turn k finishes; conversations are
interleaved. Generated tokens are never re-sent, so they are one-shot tails.
Run `python tests/kv_pressure_sim.py` for the table in docs/eviction.md.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.host_tier import HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec
from kvserve.config import SchedulerConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler


@dataclass(frozen=True)
class Workload:
    num_conversations: int = 24
    num_turns: int = 4
    first_prompt: int = 96
    new_per_turn: int = 25
    output_tokens: int = 19
    max_running: int = 8
    seed: int = 0


def simulate(policy: str, num_blocks: int, workload: Workload = Workload(), block_size: int = 4,
             host_blocks: int = 0) -> float:
    """Prefix-cache hit rate (cached prompt tokens / prompt tokens) of the run."""
    rng = random.Random(workload.seed)
    host = HostTier(host_blocks, 1) if host_blocks else None
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), num_blocks, block_size,
                        eviction_policy=policy, host_tier=host)
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=workload.max_running,
                             max_model_len=4096)
    scheduler = Scheduler(config, kv)
    prompts = [[rng.randrange(1000) for _ in range(workload.first_prompt)]
               for _ in range(workload.num_conversations)]
    turn = [0] * workload.num_conversations
    cached = total = 0
    for c in range(workload.num_conversations):
        scheduler.add_request(_request(c, 0, prompts[c], workload))
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        kv.take_pending_copies()
        scheduler.update_after_step(out)
        for item in out.scheduled:
            if not item.completes_sequence:
                continue
            request = item.request
            request.output_token_ids.append(rng.randrange(1000))
            if request.num_output_tokens < workload.output_tokens:
                continue
            scheduler.remove_finished(request, RequestStatus.FINISHED_LENGTH)
            cached += request.num_cached_tokens
            total += request.num_prompt_tokens
            c = int(request.request_id.split("-")[0])
            turn[c] += 1
            if turn[c] < workload.num_turns:
                new = [rng.randrange(1000) for _ in range(workload.new_per_turn)]
                prompts[c] = request.prompt_token_ids + new
                scheduler.add_request(_request(c, turn[c], prompts[c], workload))
        kv.check_integrity() if rng.random() < 0.01 else None
    return cached / total


def _request(conversation: int, turn: int, prompt: list[int], workload: Workload) -> Request:
    return Request(f"{conversation}-{turn}", list(prompt),
                   SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True))


def reusable_fraction(workload: Workload = Workload()) -> float:
    """Share of prompt tokens that repeat an earlier turn's prompt (the ceiling)."""
    w = workload
    total = reused = 0
    for k in range(w.num_turns):
        length = w.first_prompt + k * w.new_per_turn
        total += length
        reused += length - w.new_per_turn if k else 0
    return reused / total


if __name__ == "__main__":
    work = Workload()
    print(f"reusable prompt tokens: {reusable_fraction(work):.1%}")
    print("| GPU blocks | host blocks | lru | reuse |")
    print("|---|---|---|---|")
    for blocks, host in [(160, 0), (240, 0), (320, 0), (400, 0), (480, 0), (640, 0), (240, 400)]:
        lru = simulate("lru", blocks, work, host_blocks=host)
        reuse = simulate("reuse", blocks, work, host_blocks=host)
        print(f"| {blocks} | {host} | {lru:.1%} | {reuse:.1%} |")
