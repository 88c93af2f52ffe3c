"""Device diagnostics behind the 2026-11-29 H200 notes ("Diagnostics after run 4" in
docs/BENCHMARKS_HISTORY.md; the decode profiles and copy runs in docs/BENCHMARKS.md):

  python3 benchmarks/step_diagnostics.py copy      # KVTransfer speed vs batch size and slot order
  python3 benchmarks/step_diagnostics.py pcie      # raw pinned H2D / D2H bandwidth
  python3 benchmarks/step_diagnostics.py batch24   # kernel-time profile of 30 engine steps, 24 x 3.6K context
  python3 benchmarks/step_diagnostics.py batch1    # the same at batch 1 (128-token prompt)
  python3 benchmarks/step_diagnostics.py decode24prof  # batch24's profile, decode steps only
  python3 benchmarks/step_diagnostics.py decode24  # steady decode ms/step, 24 x ~3.7K context (wall clock)
  python3 benchmarks/step_diagnostics.py ide112prof  # decode profile, 112 x ~900 tokens, 16 per shared 700-token prefix
  python3 benchmarks/step_diagnostics.py ide24prof [VOCAB]  # the same at 24 x ~900 tokens, 3 per prefix (ide at
                                                    # 30 req/s); VOCAB 49152: the served directory's (vllm_step_profile.py)
  python3 benchmarks/step_diagnostics.py ide24solo [VOCAB]  # the same without shared prefixes (each request its own
                                                    # 700-token prefix: the KV reads L2 cannot share)
  python3 benchmarks/step_diagnostics.py mixedburst  # long prompts join 32 decodes: host ms, ITL and TTFT with
                                                    # the drain before long eager launches off and on (tokens
                                                    # timed when the engine hands them over, as the core sends them)
  python3 benchmarks/step_diagnostics.py launchqueue  # launches the host queues behind a busy device before
                                                    # one blocks (CUDA_SCALE_LAUNCH_QUEUES=4x: four times as many)
  python3 benchmarks/step_diagnostics.py prefill8k   # kernel time of 8K-token eager prefill steps, by kind
                                                    # (TMA=0: without the TMA prefill path)

An A/B against an older tree runs the same script with PYTHONPATH pointing at it
(`git archive <commit> kvserve | tar -x -C _old; PYTHONPATH=$PWD/_old python3 ...`).
MIN_SPLIT=N overrides the decode kernel's min_split_keys for the run.
"""
import os
import random
import sys
import time

import torch


def patch_decode_config() -> None:
    if os.environ.get("MIN_SPLIT"):
        from kvserve.attention.kernels import decode
        defaults = list(decode.decode_attention.__defaults__)
        defaults[0] = decode.DecodeConfig(min_split_keys=int(os.environ["MIN_SPLIT"]))
        decode.decode_attention.__defaults__ = tuple(defaults)


def copy_speed() -> None:
    from kvserve.cache.host_tier import BlockCopy, CopyBatch
    from kvserve.runner.kv_transfer import KVTransfer
    storage = torch.zeros(36, 2, 4097, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    transfer = KVTransfer(storage, 1024, torch.device("cuda"))

    def timed(copies, label):
        run = lambda: transfer.run(CopyBatch(copies))  # noqa: E731
        run(); torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - start) / 3
        print(f"{label}: {len(copies)} blocks {len(copies) * transfer.block_bytes / dt / 1e9:.1f} GB/s ({dt * 1e3:.1f} ms)")
    rng = random.Random(0)
    for n in (16, 64, 256):
        timed([BlockCopy(True, 100 + i, i) for i in range(n)], "to_host consecutive")
        timed([BlockCopy(False, 100 + i, i) for i in range(n)], "to_gpu consecutive")
        slots = rng.sample(range(1024), n)
        timed([BlockCopy(True, 100 + i, s) for i, s in enumerate(slots)], "to_host scattered")
        timed([BlockCopy(False, 100 + i, s) for i, s in enumerate(slots)], "to_gpu scattered")


def pcie() -> None:
    for n in (64 << 20, 512 << 20):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for name, f in (("H2D", lambda: dev.copy_(host, non_blocking=True)),
                        ("D2H", lambda: host.copy_(dev, non_blocking=True))):
            f(); torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                f()
            torch.cuda.synchronize()
            print(f"{name} {n >> 20} MB: {5 * n / (time.perf_counter() - start) / 1e9:.1f} GB/s")


def step_profile(what: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    from kvserve import LLM, SamplingParams
    n, plen, out = {"batch24": (24, 3600, 48), "decode24prof": (24, 3600, 48),
                    "ide112prof": (112, 890, 48), "ide24prof": (24, 890, 48),
                    "ide24solo": (24, 890, 48)}.get(what, (1, 128, 48))
    # An optional second argument sets the vocabulary (the served dummy directory's is 49,152).
    vocab = {"vocab_size": int(sys.argv[2])} if len(sys.argv) > 2 else None
    llm = LLM("dummy:qwen3-8b", max_model_len=8192, gpu_memory_utilization=0.85, max_num_batched_tokens=16384,
              hf_overrides=vocab)
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(plen)] for i in range(n)]
    if what.startswith("ide"):  # the IDE workload's shape: 700-token file prefixes (16 or 3 requests each)
        share = {"ide112prof": 16, "ide24solo": 1}.get(what, 3)
        prompts = [[100 + (i // share * 7 + j) % 5000 for j in range(700)] + [5100 + i * 190 + j for j in range(190)]
                   for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if not what.startswith("ide"):
        llm.reset_prefix_cache()
    # ide*: the prompts stay cached, so requests sharing a file prefix share its blocks, as when
    # served (and as vllm_step_profile.py runs vLLM); before 5d67885 each had its own copy.
    engine = llm.engine
    for p in prompts:
        engine.add_request(engine.make_request(p, params))
    decode_only = what in ("decode24prof", "ide112prof", "ide24prof", "ide24solo")
    if decode_only:  # profile steady decode only: run until every prefill is done
        while not all(r.num_output_tokens >= 2 for r in engine.requests.values()):
            engine.step()
    for _ in range(2 if decode_only else 3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, k = time.perf_counter(), 0
        while engine.has_unfinished_requests() and k < 30:
            engine.step()
            k += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"{what}: {k} steps, wall {wall / k * 1e3:.2f} ms/step (profiler on)")
    events = prof.key_averages()
    print(f"GPU kernel time {sum(e.self_device_time_total for e in events) / 1e3 / k:.2f} ms/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        if e.self_device_time_total > 0:
            print(f"  {e.self_device_time_total / 1e3 / k:7.3f} ms/step  n={e.count / k:6.1f}  {e.key[:90]}")
    from kvserve.bench.profile import device_idle
    print("\n".join(device_idle(prof, k)))
    while engine.has_unfinished_requests():
        engine.step()


def decode24() -> None:
    from kvserve import LLM, SamplingParams
    # An optional second argument sets the vocabulary (the served dummy directory's is 49,152).
    vocab = {"vocab_size": int(sys.argv[2])} if len(sys.argv) > 2 else None
    llm = LLM("dummy:qwen3-8b", max_model_len=8192, gpu_memory_utilization=0.85, max_num_batched_tokens=16384,
              hf_overrides=vocab)
    prompts = [{"prompt_token_ids": [100 + (i * 7919 + j * 31) % 90000 for j in range(3600)]} for i in range(24)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    times = {}
    for out in (1, 129):  # prompts are cached now: the difference is 128 decode steps
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
        times[out] = time.perf_counter() - start
    print(f"decode24: {(times[129] - times[1]) / 128 * 1e3:.2f} ms/step (24 seqs x ~3.7K context)")


def prefill8k() -> None:
    """Three fresh 8,000-token prompts through 8,192-token steps (eager, as a served burst's long
    prompts run): device ms a step by kernel kind and the top kernels, and the GEMMs' TFLOP/s."""
    from torch.profiler import ProfilerActivity, profile
    from kvserve import LLM, SamplingParams
    from kvserve.attention.kernels import mixed
    from kvserve.bench.profile import kernel_kind
    if os.environ.get("TMA") == "0":   # the paged kernel's large tiles, as before the TMA path
        mixed.TMA_MIN_TOKENS = 1 << 30
    llm = LLM("dummy:qwen3-8b", max_model_len=8192, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
              hf_overrides={"vocab_size": 49152}, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [100 + (i * 7919 + j * 31) % 40000 for j in range(8000)]} for i in range(3)]
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = 3   # 24,000 tokens in 8,192-token steps
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kinds: dict[str, float] = {}
    for e in events:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3 / steps
    print(f"prefill8k (TMA path {'off' if os.environ.get('TMA') == '0' else 'on'}): 24,000 prompt tokens in {steps} steps, wall {wall * 1e3 / steps:.1f} ms/step (profiler on)")
    print("  " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    gemm_flops = 2 * 8000 * 6.95e9   # Qwen3-8B's 36 layers' projections, per 8,000 tokens
    print(f"  gemm {gemm_flops / (kinds.get('gemm', 1) / 1e3) / 1e12:.0f} TFLOP/s over the layers' weights")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:16]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.2f} ms/step  n={e.count / steps:6.1f}  {e.key[:90]}")


def mixed_burst() -> None:
    """The served mixed burst's shape, offline: 32 requests decoding, then 12 prompts of ~7K tokens
    join (one 8K-token step each, eager); four bursts, the engine's drain before long eager launches
    (`LLMEngine._drain_before_long_launch`) off, on, off, on. Per burst: the long steps' host ms
    (the step less its waits), the decoding requests' gaps between tokens, the long prompts' time to
    first token, and the burst's wall time (what draining costs the device)."""
    from kvserve import LLM, SamplingParams
    llm = LLM("dummy:qwen3-8b", max_model_len=8192, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
              hf_overrides={"vocab_size": 49152})
    engine, rng = llm.engine, random.Random(0)
    bound = engine.runner.drain_above_tokens
    short = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    decoding = [engine.make_request([rng.randrange(100, 40000) for _ in range(900)], short) for _ in range(32)]
    for request in decoding:
        engine.add_request(request)
    for _ in range(40):
        engine.step()
    print(f"mixedburst: 32 decoding, 12 x ~7.4K-token prompts per burst; drain bound {bound} tokens")
    print(f"{'drain':>6}{'long steps':>11}{'host p50':>9}{'host max':>9}{'ITL p50':>9}{'ITL p95':>9}{'ITL max':>9}"
          f"{'TTFT mean':>10}{'TTFT max':>9}{'wall s':>8}")
    for burst in range(4):
        engine.runner.drain_above_tokens = bound if burst % 2 else None
        print(burst_row(engine, rng, decoding, bool(burst % 2)))


def burst_row(engine, rng: random.Random, decoding: list, drain: bool) -> str:
    """One burst: 12 long prompts join the running decodes; steps until they finish."""
    from kvserve import SamplingParams
    from kvserve.engine.step_trace import percentile
    start = time.perf_counter()
    longs = []
    for i in range(12):
        prompt = [rng.randrange(100, 40000) for _ in range(7000 + rng.randrange(900))]
        longs.append(engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
        engine.add_request(longs[-1])
    last = {r.request_id: start for r in decoding}
    gaps, ttft, hosts = [], {}, []

    def handed_over(touched: list) -> None:   # when the serving core would send these tokens
        now = time.perf_counter()
        for r in touched:
            if r.request_id in last:
                gaps.append((now - last[r.request_id]) * 1e3)
                last[r.request_id] = now
            elif r in longs and r.request_id not in ttft:
                ttft[r.request_id] = (now - start) * 1e3
    while not all(r.is_finished for r in longs):
        eager, t0 = engine.runner.num_eager_forwards, time.perf_counter()
        touched = engine.step(emit=handed_over)
        if engine.runner.num_eager_forwards > eager:
            hosts.append((time.perf_counter() - t0 - engine.last_wait_s) * 1e3)
        handed_over(touched)
    firsts = list(ttft.values())
    q = lambda v, p: percentile(v, p) if v else float("nan")  # noqa: E731
    return (f"{'on' if drain else 'off':>6}{len(hosts):>11}{q(hosts, .5):>9.1f}{q(hosts, 1):>9.1f}{q(gaps, .5):>9.1f}"
            f"{q(gaps, .95):>9.1f}{q(gaps, 1):>9.1f}{sum(firsts) / max(len(firsts), 1):>10.0f}{max(firsts, default=0):>9.0f}"
            f"{time.perf_counter() - start:>8.2f}")


def launch_queue() -> None:
    """Launches of a tiny kernel queued behind a ~1 s device spin until one blocks the host: the
    launch queue's depth under CUDA_SCALE_LAUNCH_QUEUES as the caller set it (the driver reads it
    when CUDA starts)."""
    x = torch.zeros(1, device="cuda")
    x.add_(1)   # the kernel's module loads lazily: not inside the timed launches
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    for queued in range(20000):
        t0 = time.perf_counter()
        x.add_(1)
        if time.perf_counter() - t0 > 5e-3:
            break
    torch.cuda.synchronize()
    print(f"launchqueue: {queued} launches queued before one blocked the host "
          f"(CUDA_SCALE_LAUNCH_QUEUES={os.environ.get('CUDA_SCALE_LAUNCH_QUEUES', 'unset')})")


if __name__ == "__main__":
    patch_decode_config()
    what = sys.argv[1]
    {"copy": copy_speed, "pcie": pcie, "decode24": decode24, "mixedburst": mixed_burst,
     "prefill8k": prefill8k, "launchqueue": launch_queue}.get(what, lambda: step_profile(what))()
