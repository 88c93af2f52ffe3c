"""scheduling_policy="prefix": who is admitted ahead of the queue head, how far
it may be overtaken, the per-running-request block reserve, and outputs equal
to first-come-first-served ones (scheduler.py's module doc)."""
from __future__ import annotations

import pytest

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec
from kvserve.config import EngineArgs, SchedulerConfig
from kvserve.entrypoints.llm import LLM
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from tiny_models import random_prompts, save_tiny_checkpoint

FILE_X, FILE_Y = list(range(10, 22)), list(range(50, 62))  # three blocks of 4 each


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 2) -> Scheduler:
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), num_blocks, 4)
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                             max_model_len=256, scheduling_policy=policy)
    return Scheduler(config, kv)


def _request(name: str, prompt: list[int]) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=8, ignore_eos=True))


def _admit_first(scheduler: Scheduler) -> Request:
    """A request on file X runs: it holds X's blocks."""
    first = _request("a", FILE_X + [1, 2, 3])
    scheduler.add_request(first)
    out = scheduler.schedule()
    scheduler.update_after_step(out)
    assert [s.request for s in out.scheduled] == [first]
    return first


@pytest.mark.parametrize("policy, admitted", [("fcfs", "y"), ("prefix", "x2")])
def test_request_sharing_a_held_prefix_goes_first(policy, admitted):
    scheduler = _scheduler(policy)
    _admit_first(scheduler)
    on_y, on_x = _request("y", FILE_Y + [4, 5]), _request("x2", FILE_X + [6, 7])
    scheduler.add_request(on_y)
    scheduler.add_request(on_x)
    out = scheduler.schedule()
    new = [s.request.request_id for s in out.scheduled if s.request.request_id != "a"]
    assert new == [admitted]
    if policy == "prefix":
        assert out.scheduled[-1].start_pos == len(FILE_X)  # its shared prefix was a hit
        assert on_y.num_overtaken == 1 and scheduler.num_prefix_overtakes == 1
        assert list(scheduler.waiting) == [on_y]
    scheduler.kv_cache.check_integrity()


def test_no_priority_while_the_shared_prefix_is_still_prefilling():
    # "a" prefills in chunks of 12: a request let in on its first block then
    # would recompute the part of file X not yet cached.
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=2, max_model_len=256,
                                          scheduling_policy="prefix"), kv)
    for name, prompt in [("a", FILE_X + [1, 2, 3]), ("y", FILE_Y + [4, 5]), ("x2", FILE_X + [6, 7])]:
        scheduler.add_request(_request(name, prompt))
    scheduler.update_after_step(scheduler.schedule())  # "a": 12 of 15 tokens
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "y"]
    assert scheduler.num_prefix_overtakes == 0


def test_overtaking_is_bounded():
    scheduler = _scheduler("prefix")
    _admit_first(scheduler)
    on_y, on_x = _request("y", FILE_Y + [4, 5]), _request("x2", FILE_X + [6, 7])
    on_y.num_overtaken = scheduler.config.max_num_seqs  # overtaken as often as allowed
    scheduler.add_request(on_y)
    scheduler.add_request(on_x)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "y"]
    assert scheduler.num_prefix_overtakes == 0


@pytest.mark.parametrize("policy, admitted", [("fcfs", True), ("prefix", False)])
def test_prefix_policy_keeps_a_block_per_running_request(policy, admitted):
    # 1 null + 4 blocks: "a" takes 4 tokens (1 block) plus room to grow; "y"
    # needs the other 3 exactly, leaving none for "a"'s next block under "prefix".
    scheduler = _scheduler(policy, num_blocks=5)
    first = _request("a", [1, 2, 3])
    scheduler.add_request(first)
    scheduler.update_after_step(scheduler.schedule())
    assert scheduler.kv_cache.num_free_blocks == 3
    scheduler.add_request(_request("y", FILE_Y))
    out = scheduler.schedule()
    assert ("y" in [s.request.request_id for s in out.scheduled]) == admitted


def test_scheduling_policy_is_validated():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, prefix, got 'lpm'"):
        EngineArgs(scheduling_policy="lpm").scheduler_config(128)


def test_prefix_policy_outputs_equal_fcfs(tmp_path):
    """Interleaved requests over three shared prefixes under a KV cap:
    reordering admissions changes no greedy output."""
    path = save_tiny_checkpoint("llama", tmp_path)
    files = random_prompts([24, 20, 28], seed=3)
    tails = random_prompts([6, 9, 5, 8, 7, 6, 9, 5, 7], seed=4)
    prompts = [files[i % 3] + tail for i, tail in enumerate(tails)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_model_len=96,
                  max_num_seqs=3, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.kv_cache.check_integrity()
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()

    reference, fcfs = run()
    reordered, metrics = run(scheduling_policy="prefix", num_kv_blocks=30)
    assert reordered == reference
    assert fcfs["num_prefix_overtakes"] == 0
    assert metrics["num_prefix_overtakes"] > 0 and metrics["num_preemptions"] > 0
