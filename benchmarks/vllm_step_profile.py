"""vLLM 0.26.0's decode step at ide-completion's served shape, profiled like kvserve's
(`step_diagnostics.py ide24prof`): 24 requests of ~890 tokens, three per 700-token prefix,
greedy. The prompts are prefilled and cached first (max_tokens=1); the profiled generate then
recomputes one token a request and decodes 48 steps, so its kernels are the decode step's.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so torch's profiler sees
its kernels.

    PYTHONPATH=$PWD:$PWD/.vsite python3 benchmarks/vllm_step_profile.py [MODEL_DIR]   # default dummy dir
"""
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

STEPS = 48


def prompts(n: int = 24, share: int = 3) -> list[list[int]]:
    """The same ids as step_diagnostics.py's ide24prof."""
    return [[100 + (i // share * 7 + j) % 5000 for j in range(700)] + [5100 + i * 190 + j for j in range(190)]
            for i in range(n)]


def main() -> None:
    from vllm import LLM, SamplingParams
    model_dir = sys.argv[1] if len(sys.argv) > 1 else ".dummy-qwen3-8b"
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=8192, gpu_memory_utilization=0.85, max_num_batched_tokens=8192)
    batch = [{"prompt_token_ids": p} for p in prompts()]
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=1, detokenize=False), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, detokenize=False)
    llm.generate(batch, params, use_tqdm=False)   # warm: every decode graph this batch uses
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    print(f"vllm ide24: {STEPS} steps, wall {wall / STEPS * 1e3:.2f} ms/step (profiler on; the first step recomputes "
          f"one token a request)")
    print(f"GPU kernel time {sum(e.self_device_time_total for e in events) / 1e3 / STEPS:.2f} ms/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        print(f"  {e.self_device_time_total / 1e3 / STEPS:7.3f} ms/step  n={e.count / STEPS:6.1f}  {e.key[:90]}")
    from kvserve.bench.profile import device_idle   # PYTHONPATH holds the repository root too
    print("\n".join(device_idle(prof, STEPS)))


if __name__ == "__main__":
    main()
