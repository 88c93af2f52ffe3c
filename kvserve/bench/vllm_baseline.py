"""vLLM as an in-run baseline: the same prompts through vLLM's `LLM.generate`
in a subprocess, so each engine has the GPU to itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from kvserve.bench.throughput import ThroughputResult

_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
job = json.load(open(sys.argv[1]))
llm = LLM(model=job["model_dir"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=job["max_model_len"], gpu_memory_utilization=job["gpu_memory_utilization"], seed=0,
          **job.get("extra", {}))
sp = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True, detokenize=False)
ps = [{"prompt_token_ids": p} for p in job["prompts"]]
llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False), use_tqdm=False)
t = time.perf_counter(); outs = llm.generate(ps, sp, use_tqdm=False); dt = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
print("VLLM_RESULT " + json.dumps({"seconds": dt, "tokens": n}), flush=True)
"""


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def run_vllm_generate(model: str, prompts: list[list[int]], output_len: int, max_model_len: int,
                      gpu_memory_utilization: float, extra: dict | None = None) -> ThroughputResult:
    from kvserve.model.loaders.dummy import DUMMY_CONFIGS, PREFIX
    if not model or not model.startswith(PREFIX):
        raise ValueError("--baseline vllm runs dummy:<shape> models only (vLLM load_format='dummy')")
    if not vllm_available():
        raise ValueError("--baseline vllm needs vLLM importable (see docs/BENCHMARKS.md for the GPU bundle)")
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(DUMMY_CONFIGS[model.removeprefix(PREFIX)], torch_dtype="bfloat16")
        config["model_type"] = _MODEL_TYPES[config["architectures"][0]]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        job = os.path.join(tmp, "job.json")
        with open(job, "w") as f:
            json.dump({"model_dir": tmp, "prompts": prompts, "output_len": output_len,
                       "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
                       "extra": extra or {}}, f)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, job], capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("VLLM_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM baseline failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line.removeprefix("VLLM_RESULT "))
    if result["tokens"] != len(prompts) * output_len:
        raise RuntimeError(f"vLLM produced {result['tokens']} tokens, expected {len(prompts) * output_len}")
    return ThroughputResult("vllm", result["seconds"], len(prompts), len(prompts[0]), output_len)
