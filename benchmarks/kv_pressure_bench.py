"""Same-lease comparison driver, kvserve or vLLM on the Qwen3-8B shape (dummy weights),
same prompts for both: the KV-pressure workloads (multi-turn code review, IDE completion)
under a KV cap, and the anchor workload's throughput and batch-1 latency. Several
workloads run in one engine (one start-up) with the prefix cache reset between them.

  python3 benchmarks/kv_pressure_bench.py --engine kvserve|vllm --workload code-review,ide [--cap-tokens 65536]
  python3 benchmarks/kv_pressure_bench.py --engine vllm --workload code-review,anchor,latency --cap-tokens 0

Code review: 24 conversations x 4 turns; turn 1 ~1.5K tokens, each later turn resends the
history (prompt + previous output) plus ~400 new tokens; 300 output tokens per turn
(ignore_eos). All conversations' turn t run as one generate() batch. IDE: 768 requests over
48 file prefixes of ~700 tokens, ~190 unique tokens each, 127 output tokens, one batch.
Hit rate = sum of per-request cached tokens / sum of prompt tokens. Prints a RESULT line per workload.
"""
import argparse, json, os, random, sys, time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def rand_tokens(rng, n):
    return [rng.randrange(100, 100000) for _ in range(n)]


def make_engine(args):
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        from transformers import Qwen3Config
        d = "/tmp/qwen3-8b-dummy"
        os.makedirs(d, exist_ok=True)
        cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3ForCausalLM"]
        cfg.save_pretrained(d)
        extra = {"num_gpu_blocks_override": args.cap_tokens // 16} if args.cap_tokens else {}
        llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
                  gpu_memory_utilization=0.85, seed=0, enable_prefix_caching=True, **extra)
        return llm, lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    sys.path.insert(0, os.getcwd())
    from kvserve import LLM, SamplingParams
    kw = {"num_kv_blocks": args.cap_tokens // 16 + 1} if args.cap_tokens else {}
    llm = LLM(args.model, max_model_len=8192, gpu_memory_utilization=0.85,
              max_num_batched_tokens=16384, cpu_kv_cache_gb=args.cpu_kv_cache_gb,
              eviction_policy=args.eviction_policy, preemption_mode=args.preemption_mode,
              kv_rotation_interval=args.kv_rotation_interval,
              scheduling_policy=args.scheduling_policy, **kw)
    return llm, lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def watch_steps(llm):
    """kvserve --step-profile: wrap engine.step to time each step (host wall
    clock; with one-deep pipelining a step's time is about the previous step's
    device time) by kind, and the part of it the host was busy (not waiting
    for sampled ids): host busy close to the step time means a host-bound
    step. Returns a function printing and clearing the tally."""
    from kvserve.runner.model_runner import InFlightStep
    engine, scheduler = llm.engine, llm.engine.scheduler
    tally, schedule, step = {}, scheduler.schedule, engine.step
    last = {"wait": 0.0}
    resolve = InFlightStep.resolve

    def timed_resolve(self):  # the host waiting for the device
        t = time.perf_counter()
        result = resolve(self)
        last["wait"] += time.perf_counter() - t
        return result
    InFlightStep.resolve = timed_resolve

    def recorded_schedule():
        out = last["out"] = schedule()
        return out

    def timed_step(emit=None):
        t, last["wait"] = time.perf_counter(), 0.0
        touched = step(emit)
        out = last.pop("out", None)
        if out is not None and out.scheduled:
            decode = all(s.num_new_tokens == 1 for s in out.scheduled)
            kind = (("decode" if decode else "mixed") + (" +copies" if out.kv_copies.copies else "")
                    + (" +prefetch" if out.kv_prefetch.copies else ""))
            n, secs, seqs, wait = tally.get(kind, (0, 0.0, 0, 0.0))
            tally[kind] = (n + 1, secs + time.perf_counter() - t, seqs + len(out.scheduled),
                           wait + last["wait"])
        return touched

    scheduler.schedule, engine.step = recorded_schedule, timed_step

    def report():
        for kind, (n, secs, seqs, wait) in sorted(tally.items()):
            print(f"  steps {kind:26s} {n:5d}  {secs:6.2f} s  {secs / n * 1e3:6.2f} ms/step "
                  f"(host busy {(secs - wait) / n * 1e3:5.2f})  {seqs / n:5.1f} seqs/step", flush=True)
        tally.clear()
    return report


def run_batches(llm, sp, batches_fn, report=None):
    cached = prompt = 0
    start = time.perf_counter()
    for prompts, out_len, on_done in batches_fn():
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp(out_len), use_tqdm=False)
        print(f"batch of {len(prompts)}: {time.perf_counter() - t0:.2f} s", flush=True)
        if report is not None:
            report()
        for o in outs:
            cached += o.num_cached_tokens or 0
            prompt += len(o.prompt_token_ids)
        on_done(outs)
    return time.perf_counter() - start, cached, prompt


def code_review(rng):
    histories = [rand_tokens(rng, rng.randint(1300, 1700)) for _ in range(24)]
    def batches():
        for turn in range(4):
            def done(outs):
                for i, o in enumerate(outs):
                    histories[i] = histories[i] + list(o.outputs[0].token_ids) + rand_tokens(rng, rng.randint(350, 450))
            yield [list(h) for h in histories], 300, done
    return batches


def ide(rng):
    prefixes = [rand_tokens(rng, rng.randint(600, 800)) for _ in range(48)]
    prompts = [prefixes[rng.randrange(48)] + rand_tokens(rng, rng.randint(160, 220)) for _ in range(768)]
    return lambda: iter([(prompts, 127, lambda outs: None)])


def anchor_prompts():
    """The 256 x 512 random-token prompts of vllm_bench_anchor.py."""
    import torch
    g = torch.Generator().manual_seed(1)
    return torch.randint(100, 100000, (256, 512), generator=g).tolist()


def anchor(_rng):
    """The anchor workload: 256 x 512 in / 128 out, after an 8-prompt warm-up."""
    prompts = anchor_prompts()
    return lambda: iter([(prompts[:8], 128, lambda outs: None), (prompts, 128, lambda outs: None)])


def latency(_rng):
    """Batch 1, 128 in / 256 out, run twice (the first warms up)."""
    prompt = anchor_prompts()[0][:128]
    return lambda: iter([([prompt], 256, lambda outs: None)] * 2)


WORKLOADS = {"code-review": code_review, "ide": ide, "anchor": anchor, "latency": latency}


def run_workload(llm, sp, args, name):
    batches = WORKLOADS[name](random.Random(0))
    if name in ("anchor", "latency"):  # time only the last batch (the others warm up)
        *warm, last = list(batches())
        for prompts, out_len, _ in warm:
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp(out_len), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in last[0]], sp(last[1]), use_tqdm=False)
        dt = time.perf_counter() - t
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {"seconds": round(dt, 2), "out_tok_s": round(ntok / dt, 1)}
        if name == "latency":
            res["ms_per_token"] = round(1000 * dt / ntok, 2)
    else:
        report = watch_steps(llm) if args.step_profile and args.engine == "kvserve" else None
        seconds, cached, prompt = run_batches(llm, sp, batches, report)
        res = {"seconds": round(seconds, 2), "hit_rate": round(cached / prompt, 3), "prompt_tokens": prompt}
    return {"engine": args.engine, "workload": name, "cap_tokens": args.cap_tokens,
            "cpu_kv_cache_gb": args.cpu_kv_cache_gb, "eviction_policy": args.eviction_policy, **res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["kvserve", "vllm"], required=True)
    ap.add_argument("--workload", default="code-review",
                    help="comma-separated, run in order in one engine with the prefix cache reset "
                         f"between them: {', '.join(WORKLOADS)}")
    ap.add_argument("--cap-tokens", type=int, default=65536)
    ap.add_argument("--cpu-kv-cache-gb", type=float, default=0.0)
    ap.add_argument("--eviction-policy", default="lru")
    ap.add_argument("--model", default="dummy:qwen3-8b",
                    help="kvserve only: another model (e.g. a tiny checkpoint dir to simulate the schedule on CPU)")
    ap.add_argument("--preemption-mode", default="auto")
    ap.add_argument("--kv-rotation-interval", type=int, default=0, help="kvserve only (scheduler.py)")
    ap.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "prefix"], help="kvserve only (scheduler.py)")
    ap.add_argument("--stats", action="store_true", help="kvserve only: print engine counters after each run")
    ap.add_argument("--step-profile", action="store_true",
                    help="kvserve only: per batch, step count and host time by step kind")
    args = ap.parse_args()
    names = args.workload.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    t = time.perf_counter()
    llm, sp = make_engine(args)
    print(f"startup {time.perf_counter() - t:.1f} s", flush=True)
    llm.generate([{"prompt_token_ids": [101] * 16}], sp(2), use_tqdm=False)  # warm-up
    for i, name in enumerate(names):
        if i and not llm.reset_prefix_cache():
            raise RuntimeError("prefix cache reset refused between workloads")
        print("RESULT " + json.dumps(run_workload(llm, sp, args, name)), flush=True)
        if args.stats and args.engine == "kvserve":
            print("STATS " + json.dumps(llm.get_metrics()), flush=True)


if __name__ == "__main__":
    main()
