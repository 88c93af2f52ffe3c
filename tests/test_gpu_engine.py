"""GPU engine tests (run on the device machine; skipped without CUDA):
the whole engine on CUDA matches HF transformers on CUDA token for token in
float32, and CUDA-graph replay equals eager execution."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24


def _hf_greedy_cuda(path, prompts):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _kvserve(path, prompts, **kwargs):
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=256, kv_cache_memory_gb=1, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-hybrid", "mistral"])
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_greedy_matches_hf_on_gpu(tmp_path, kind, eager):
    path = save_tiny_checkpoint(kind, tmp_path / kind)
    prompts = random_prompts([5, 17, 30, 41, 58, 63])
    got, llm = _kvserve(path, prompts, enforce_eager=eager, block_size=16)
    assert got == _hf_greedy_cuda(path, prompts)


def _record_forwards(llm) -> list[tuple[bool, int]]:
    """(decode-only, num_seqs) of every forward the runner is asked for."""
    runner, calls = llm.engine.runner, []
    forward = runner._forward

    def recording(inputs, *rest):   # rest: the drain of a long eager step (`ModelRunner.run`)
        calls.append((inputs.meta.is_decode_only, inputs.meta.num_seqs))
        return forward(inputs, *rest)
    runner._forward = recording
    return calls


def _mixed_replays(runner) -> int:
    return sum(runner.mixed_graphs.num_replays.values()) if runner.mixed_graphs is not None else 0


def test_cuda_graph_replay_equals_eager_for_random_batch_sizes(tmp_path):
    """Random batch sizes, and contexts on both sides of the short-context
    bucket (500 + 12 tokens crosses it mid-decode). Every decode-only step
    replays a graph (counted per (size, bucket) by the runner), none falls
    back to eager, and tokens and logprobs equal an enforce_eager run."""
    path = save_tiny_checkpoint("qwen3-hybrid", tmp_path / "q", max_position_embeddings=1024)
    rng = random.Random(0)
    eager = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024, enforce_eager=True, max_num_seqs=48,
                kv_cache_memory_gb=1)
    graphs = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=48, kv_cache_memory_gb=1)
    assert eager.engine.runner.graphs is None
    decode_graphs = graphs.engine.runner.graphs
    assert decode_graphs is not None and decode_graphs.buckets == [512, 1024]
    assert not decode_graphs.num_replays  # capture is not a replay
    eager_calls, graph_calls = _record_forwards(eager), _record_forwards(graphs)
    runner = graphs.engine.runner
    eager_forwards_before, mixed_before = runner.num_eager_forwards, _mixed_replays(runner)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for trial in range(5):
        n = rng.randint(1, 45)
        lengths = [rng.choice([rng.randint(3, 90), 500, rng.randint(510, 900)]) for _ in range(n)]
        if trial == 4:  # no prompt past 500: decode starts in the 512-key bucket and crosses it
            lengths = [min(length, 500) for length in lengths] + [500]
        prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=trial)]
        a = [o.outputs[0] for o in eager.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0] for o in graphs.generate(prompts, params, use_tqdm=False)]
        assert [x.token_ids for x in a] == [y.token_ids for y in b], f"trial {trial}, batch {n}"
        for x, y in zip(a, b):
            for lp_eager, lp_graph in zip(x.logprobs, y.logprobs):
                assert lp_eager.keys() == lp_graph.keys()
                assert all(abs(lp_eager[t] - lp_graph[t]) < 1e-3 for t in lp_eager), f"trial {trial}"
    num_decode_steps = sum(1 for decode_only, _ in graph_calls if decode_only)
    replays = sum(decode_graphs.num_replays.values())
    assert num_decode_steps > 0 and replays == num_decode_steps
    assert all(size <= 48 for size, _ in decode_graphs.num_replays)
    assert {bucket for _, bucket in decode_graphs.num_replays} == {512, 1024}  # both buckets ran
    mixed = _mixed_replays(runner) - mixed_before
    assert runner.num_eager_forwards - eager_forwards_before + mixed == len(graph_calls) - num_decode_steps
    assert eager.engine.runner.num_eager_forwards >= len(eager_calls) > 0


def test_capture_sizes_and_bf16_graph_generation(tmp_path):
    """Graphs are captured for 1, 2, 4, 8 and multiples of 8 up to max_num_seqs,
    and a bf16 batch decodes through them to the requested length."""
    path = save_tiny_checkpoint("llama", tmp_path / "l")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=16, kv_cache_memory_gb=1)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts([20] * 5)], params, use_tqdm=False)
    assert sorted(runner.graphs.graphs) == [(1, 256), (2, 256), (4, 256), (8, 256), (16, 256)]
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


def test_memory_planning_fills_kv_and_rejects_impossible_settings(tmp_path):
    path = save_tiny_checkpoint("llama", tmp_path / "l")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=512, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    kv_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
    assert kv_bytes > 0.3 * total
    del llm
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.0001"):
        LLM(str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.0001)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_host_tier_on_cuda_keeps_greedy_outputs(tmp_path, preemption_mode):
    """Real copy streams: write-backs, saves on eviction, loads and swaps run
    on the copy stream while forwards run; outputs equal a run without a cap.
    Two rounds, so the second reloads prefixes from the host tier."""
    path = save_tiny_checkpoint("qwen3-hybrid", tmp_path / "q")
    prompts = random_prompts([40, 55, 33, 60, 47, 38, 52, 44], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=128, block_size=4, **kwargs)
        outs = [o.outputs[0].token_ids for _ in range(2)
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        return outs, llm.get_metrics()

    reference, _ = run(kv_cache_memory_gb=0.05)
    got, m = run(num_kv_blocks=130, cpu_kv_cache_gb=0.01, preemption_mode=preemption_mode,
                 eviction_policy="reuse")
    assert got == reference
    assert m["num_preemptions"] > 0 and m["kv_host_hit_tokens"] > 0 and m["kv_host_blocks_to_host"] > 0


def test_decode_steps_never_synchronise_the_host(tmp_path):
    """The step loop is pipelined one deep: step N+1 is queued before step N's
    ids are read. A blocking upload (a plain `.to("cuda")` of a host tensor)
    silently waits for the step in flight instead; sync debug mode turns any
    such call in steady decode into an error."""
    path = save_tiny_checkpoint("qwen3", tmp_path / "q")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, kv_cache_memory_gb=1,
              cpu_kv_cache_gb=0.01)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for p in random_prompts([30, 41, 17, 52], seed=4):
        engine.add_request(engine.make_request(p, params))
    while not all(r.num_output_tokens >= 2 for r in engine.requests.values()):
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished_requests():
        engine.step()


def test_timed_steps_carry_their_device_span(tmp_path):
    """With `time_steps` (the step trace turns it on), every resolved step reports its device span:
    positive, and no longer than the wall time the host saw the whole generation take."""
    import math
    import time
    path = save_tiny_checkpoint("qwen3", tmp_path / "q")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, kv_cache_memory_gb=1)
    llm.engine.runner.time_steps = True
    spans = []
    real = llm.engine._finish_in_flight

    def finish(launched):
        touched = real(launched)
        spans.append(llm.engine.last_gpu_ms)
        return touched
    llm.engine._finish_in_flight = finish
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in random_prompts([40, 7, 90], seed=1)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    wall_ms = (time.perf_counter() - start) * 1e3
    timed = [s for s in spans if not math.isnan(s)]
    assert timed and all(0 < s < wall_ms for s in timed)
