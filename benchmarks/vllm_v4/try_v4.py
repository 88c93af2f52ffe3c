#!/usr/bin/env python3
"""One try of vLLM 0.26.0's own DeepSeek V4 (NVIDIA) model path on one H200: engine build, then
decode speed per batch size (4,096-token prompts by default). Started on the GPU machine by run.sh
beside it (README.md gives the calls), with the vLLM bundle and the kit unpacked in .vsite and on
PYTHONPATH.

Model: benchmarks/vllm_v4/model/config.json (the folder beside this script), a DeepSeek-V4-Flash
shape cut to 8 layers and 32 routed experts (kvserve preset `deepseek-v4-flash-l8`), FP8
block-quantised linears with UE8M0 scales and MXFP4 experts (expert_dtype=fp4), the checkpoint's own
quantization_config; weights are vLLM's dummy ones.
KV cache: kv_cache_dtype="fp8" (vLLM maps it to DeepSeek's fp8_ds_mla layout for this model).

Prints timestamped stage markers ("[v4try +SECONDS HH:MM:SS] STAGE"), a decode table, and one
line "RESULT {json}" (also written to $OUT/v4_result.json when OUT is set). On any error it prints
"V4TRY FAILED at stage ...", the exception type and message (with its chain) and the last
traceback frames, writes the same into the result json, and exits 1.

Environment overrides (all optional):
  V4_BATCHES=1,64      batch sizes to measure            V4_CTX=4096   prompt tokens per request
  V4_OUT=128           decode tokens measured per req    V4_MAX_LEN    max_model_len (default CTX+OUT+256)
  V4_MNBT=8192         max_num_batched_tokens            V4_GPU_UTIL=0.85
  V4_KV_DTYPE=fp8      kv_cache_dtype                     V4_EAGER=0    1 = enforce_eager (no CUDA graphs)
  V4_CG_SIZES          CUDA-graph capture sizes (default: the batch sizes, to keep capture and JIT short)
  V4_LINEAR_BACKEND    kernel_config.linear_backend (default: vLLM's auto, i.e. DeepGEMM on SM90)
  V4_MOE_BACKEND       kernel_config.moe_backend (default: auto, i.e. Marlin MXFP4 on SM90)
  V4_PATCH=1           0 = run the dummy loader exactly as vLLM ships it (see patch_dummy_loader)
  V4_SMOKE=1           0 = skip the stand-alone tilelang/cute-dsl smoke test before building the engine
  V4_BUDGET_S=440      wall-clock budget: a batch is skipped when <25 s are left, stacks dumped at +10 s
  V4_FAST_JIT=0        1 = DeepGEMM JIT through NVRTC (DG_JIT_USE_NVRTC=1) instead of nvcc
  VLLM_DEEP_GEMM_WARMUP (default here: skip; vLLM's default is relax)
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback

T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "model")
OUT_DIR = os.environ.get("OUT")
RESULT: dict = {"ok": False, "stages": {}}
_STAGE = ["start"]


def begin(stage: str) -> None:
    """Names the stage now running (reported as failed_stage if it raises)."""
    _STAGE[0] = stage
    print(f"[v4try +{time.time() - T0:7.1f}s {time.strftime('%H:%M:%S')}] ... {stage}", flush=True)


def mark(stage: str, **info) -> None:
    _STAGE[0] = "after " + stage
    el = round(time.time() - T0, 1)
    RESULT["stages"][stage] = el
    extra = (" " + json.dumps(info, default=str)) if info else ""
    print(f"[v4try +{el:7.1f}s {time.strftime('%H:%M:%S')}] {stage}{extra}", flush=True)


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def env_ints(name: str, default: list[int]) -> list[int]:
    v = os.environ.get(name)
    return [int(x) for x in v.replace(" ", "").split(",") if x] if v else default


BATCHES = env_ints("V4_BATCHES", [1, 64])
CTX = env_int("V4_CTX", 4096)
NOUT = env_int("V4_OUT", 128)
MAX_LEN = env_int("V4_MAX_LEN", CTX + NOUT + 256)
MNBT = env_int("V4_MNBT", 8192)
GPU_UTIL = float(os.environ.get("V4_GPU_UTIL", "0.85"))
KV_DTYPE = os.environ.get("V4_KV_DTYPE", "fp8")
EAGER = os.environ.get("V4_EAGER", "0") == "1"
PATCH = os.environ.get("V4_PATCH", "1") == "1"
SMOKE = os.environ.get("V4_SMOKE", "1") == "1"
BUDGET = env_int("V4_BUDGET_S", 440)
MAXB = max(BATCHES)
CG_SIZES = env_ints("V4_CG_SIZES", sorted(set(BATCHES)))


def setup_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/v4cache/vllm")
    os.environ.setdefault("TILELANG_CACHE_DIR", "/tmp/v4cache/tilelang")
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/v4cache/triton")
    os.environ.setdefault("DG_JIT_CACHE_DIR", "/tmp/v4cache/deep_gemm")
    if os.environ.get("V4_FAST_JIT") == "1":
        os.environ.setdefault("DG_JIT_USE_NVRTC", "1")
    # nvcc for DeepGEMM's and TileLang's JIT.
    if not os.environ.get("CUDA_HOME"):
        nvcc = shutil.which("nvcc") or next(
            (p for p in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc") if os.path.exists(p)), None)
        if nvcc:
            os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.environ.get("CUDA_HOME"):
        b = os.path.join(os.environ["CUDA_HOME"], "bin")
        if b not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = b + os.pathsep + os.environ.get("PATH", "")
    # nvidia-cutlass-dsl puts `cutlass` under nvidia_cutlass_dsl/dsl_packages through a .pth file, which a
    # PYTHONPATH (--target) install does not run: add that folder here and for any child process.
    for entry in list(sys.path):
        dsl = os.path.join(entry or ".", "nvidia_cutlass_dsl", "dsl_packages")
        if os.path.isdir(dsl) and dsl not in sys.path:
            sys.path.insert(sys.path.index(entry) + 1, dsl)
            pp = os.environ.get("PYTHONPATH", "")
            if dsl not in pp.split(os.pathsep):
                os.environ["PYTHONPATH"] = (pp + os.pathsep + dsl) if pp else dsl


def versions() -> dict:
    info: dict = {"python": platform.python_version()}
    for mod, attr in (("torch", "__version__"), ("triton", "__version__"), ("transformers", "__version__"),
                      ("vllm", "__version__"), ("tilelang", "__version__"), ("tvm_ffi", "__version__"),
                      ("cutlass", "__version__"), ("quack", "__version__"), ("cuda.bindings", "__version__"),
                      ("z3", None), ("google.protobuf", "__version__")):
        try:
            m = importlib.import_module(mod)
            info[mod] = getattr(m, attr, "?") if attr else "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            info[mod] = f"IMPORT FAILED {type(e).__name__}: {e}"[:300]
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as e:  # noqa: BLE001
        info["gpu"] = f"{type(e).__name__}: {e}"
    nvcc = shutil.which("nvcc")
    info["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    if nvcc:
        try:
            info["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                          timeout=30).stdout.strip().splitlines()[-1]
        except Exception as e:  # noqa: BLE001
            info["nvcc"] = f"{type(e).__name__}: {e}"
    else:
        info["nvcc"] = "not found"
    return info


def smoke() -> dict:
    """vLLM's own TileLang mHC post kernel (nvcc JIT) against torch, and the cute-dsl import chain.
    Same static arguments as the model uses (hc=4, hidden=4096), so the compiled kernel is reused."""
    import torch

    res: dict = {}
    from vllm.model_executor.kernels.mhc.tilelang import mhc_post_tilelang

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hc, h = 3, 4, 4096
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    resid = torch.randn(n, hc, h, device="cuda", generator=g).to(torch.bfloat16)
    post = torch.rand(n, hc, 1, device="cuda", generator=g)
    comb = torch.rand(n, hc, hc, device="cuda", generator=g)
    t = time.time()
    out = mhc_post_tilelang(x, resid, post, comb)
    torch.cuda.synchronize()
    ref = post.view(n, hc, 1) * x.float().view(n, 1, h) + torch.einsum("nij,nih->njh", comb, resid.float())
    err = (out.float() - ref).abs().max().item()
    res["tilelang_mhc_post_s"] = round(time.time() - t, 1)
    res["tilelang_mhc_post_maxerr"] = round(err, 4)
    if not err < 0.1:
        raise RuntimeError(f"tilelang mhc_post mismatch vs torch: max abs err {err}")
    t = time.time()
    for mod in ("vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",  # cutlass + quack + cuda.bindings
                "vllm.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl"):
        importlib.import_module(mod)
    res["cutedsl_ops_import_s"] = round(time.time() - t, 1)
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    res["deep_gemm_supported"] = bool(is_deep_gemm_supported())
    return res


def patch_dummy_loader() -> None:
    """Two gaps of vLLM 0.26's dummy loading for this model, closed after its own dummy init:
    1. DeepseekV4ForCausalLM.load_weights() ends with model.finalize_mhc_broadcast_weights(), which
       sets layers[0].hc_attn_fn_broadcast; the dummy loader never calls load_weights(), and the first
       decoder layer asserts `hc_attn_fn_broadcast is not None` on its first forward.
    2. initialize_dummy_weights() skips integer tensors, so the MXFP4 experts' packed uint8 weights and
       uint8 E8M0 scales stay torch.empty() (scale byte 0xFF is NaN). They are filled with random FP4
       bytes and scale 2^-9, before process_weights_after_loading() repacks them.
    V4_PATCH=0 skips both, to record what vLLM does alone."""
    import torch
    from vllm.model_executor.model_loader import dummy_loader

    orig = dummy_loader.DummyModelLoader.load_weights

    def load_weights(self, model, model_config):
        orig(self, model, model_config)
        filled = 0
        gen = None
        for name, p in model.named_parameters():
            if p.dtype == torch.uint8 and ".experts." in name and p.device.type == "cuda":
                if gen is None:
                    gen = torch.Generator(device=p.device).manual_seed(1234)
                if "scale" in name:
                    p.data.fill_(118)  # E8M0 2^-9
                else:
                    p.data.random_(0, 256, generator=gen)
                filled += 1
        fin = 0
        for m in model.modules():
            f = getattr(m, "finalize_mhc_broadcast_weights", None)
            if callable(f) and m is not model:
                f()
                fin += 1
        if fin == 0 and callable(getattr(model, "finalize_mhc_broadcast_weights", None)):
            model.finalize_mhc_broadcast_weights()
            fin = 1
        print(f"[v4try] dummy-loader patch: filled {filled} uint8 expert tensors, "
              f"finalize_mhc_broadcast_weights on {fin} module(s)", flush=True)

    dummy_loader.DummyModelLoader.load_weights = load_weights


def build_llm():
    from vllm import LLM

    kwargs = dict(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  kv_cache_dtype=KV_DTYPE, max_model_len=MAX_LEN, gpu_memory_utilization=GPU_UTIL,
                  max_num_seqs=MAXB, max_num_batched_tokens=MNBT, enable_prefix_caching=False, seed=0,
                  enforce_eager=EAGER, disable_log_stats=False)
    if not EAGER:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": CG_SIZES}
    kc = {}
    if os.environ.get("V4_LINEAR_BACKEND"):
        kc["linear_backend"] = os.environ["V4_LINEAR_BACKEND"]
    if os.environ.get("V4_MOE_BACKEND"):
        kc["moe_backend"] = os.environ["V4_MOE_BACKEND"]
    if kc:
        kwargs["kernel_config"] = kc
    RESULT["llm_kwargs"] = {k: v for k, v in kwargs.items() if k != "model"}
    return LLM(**kwargs)


def engine_facts(llm) -> dict:
    facts: dict = {}
    try:
        vc = llm.llm_engine.vllm_config
        facts["cache_dtype"] = vc.cache_config.cache_dtype
        facts["block_size"] = vc.cache_config.block_size
        facts["num_gpu_blocks"] = vc.cache_config.num_gpu_blocks
        facts["quantization"] = vc.model_config.quantization
        facts["cudagraph_mode"] = str(vc.compilation_config.cudagraph_mode)
        facts["compile_mode"] = str(vc.compilation_config.mode)
        facts["capture_sizes"] = vc.compilation_config.cudagraph_capture_sizes
    except Exception as e:  # noqa: BLE001
        facts["error"] = f"{type(e).__name__}: {e}"
    try:
        import torch

        facts["gpu_mem_alloc_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        facts["gpu_mem_reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
    except Exception:  # noqa: BLE001
        pass
    return facts


def prompts(batch: int, ctx: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 120000, (batch, ctx), generator=g).tolist()
    return [{"prompt_token_ids": p} for p in ids]


def timed_generate(llm, ps, max_tokens: int):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    return time.perf_counter() - t, outs


def measure(llm, batch: int) -> dict:
    """Decode speed at `batch` requests of CTX prompt tokens each (random distinct token ids):
    t1 = generate(max_tokens=1) (prefill + 1 token), t2 = generate(max_tokens=1+NOUT) on fresh prompts;
    decode tok/s = batch*NOUT/(t2-t1). Also the mean per-request inter-token latency from vLLM's request
    metrics of the t2 run (first_token_ts .. last_token_ts)."""
    seed = 1000 * batch
    timed_generate(llm, prompts(batch, min(CTX, 512), seed + 1), 4)  # JIT/warm at this batch size
    t1, _ = timed_generate(llm, prompts(batch, CTX, seed + 2), 1)
    t2, outs = timed_generate(llm, prompts(batch, CTX, seed + 3), 1 + NOUT)
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"batch": batch, "ctx": CTX, "out": NOUT, "prefill_s": round(t1, 3), "total_s": round(t2, 3),
           "gen_tokens": ntok}
    dec = t2 - t1
    row["decode_s"] = round(dec, 3)
    row["decode_tok_s"] = round(batch * NOUT / dec, 1) if dec > 0 else None
    row["ms_per_step"] = round(1000 * dec / NOUT, 3) if dec > 0 else None
    row["e2e_out_tok_s"] = round(ntok / t2, 1)
    itls = []
    for o in outs:
        m = getattr(o, "metrics", None)
        n = len(o.outputs[0].token_ids)
        if m is not None and getattr(m, "last_token_ts", 0) and n > 1:
            itls.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    if itls:
        itls.sort()
        row["itl_ms_mean"] = round(1000 * sum(itls) / len(itls), 3)
        row["itl_ms_median"] = round(1000 * itls[len(itls) // 2], 3)
        row["decode_tok_s_from_itl"] = round(batch / (sum(itls) / len(itls)), 1)
    first = outs[0].outputs[0].token_ids
    row["distinct_tokens_req0"] = len(set(first))
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["batch", "ctx", "out", "prefill_s", "total_s", "decode_s", "decode_tok_s", "ms_per_step",
            "itl_ms_mean", "decode_tok_s_from_itl", "e2e_out_tok_s", "distinct_tokens_req0"]
    print("\n" + " | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{str(r.get(c, '-')):>12}" for c in cols))
    print(flush=True)


def write_result() -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    line = json.dumps(RESULT, default=str)
    print("RESULT " + line, flush=True)
    if OUT_DIR and os.path.isdir(OUT_DIR):
        with open(os.path.join(OUT_DIR, "v4_result.json"), "w") as f:
            f.write(line + "\n")


def fail(exc: BaseException) -> None:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    chain = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(f"{type(e).__module__}.{type(e).__qualname__}: {e}")
        e = e.__cause__ or e.__context__
    frames = traceback.extract_tb(exc.__traceback__)[-12:]
    RESULT["ok"] = False
    RESULT["failed_stage"] = _STAGE[0]
    RESULT["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
    RESULT["error"] = str(exc)[:4000]
    RESULT["error_chain"] = [c[:2000] for c in chain]
    RESULT["last_frames"] = [f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}" for fr in frames]
    write_result()  # RESULT line first, so the traceback below is what the output tail shows
    print("\n========== V4TRY FAILED at stage %r after %.1fs ==========" % (_STAGE[0], time.time() - T0))
    print("".join(tb)[-6000:])
    print("exception chain:")
    for c in chain:
        print("  -", c[:1500])
    print("V4TRY FAILED: %s: %s" % (RESULT["error_type"], str(exc)[:1500]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def on_sigterm(signum, frame) -> None:
    """`timeout` sends SIGTERM: record where the run was, then exit 124."""
    print(f"\n========== V4TRY KILLED (signal {signum}) during stage {_STAGE[0]!r} "
          f"after {time.time() - T0:.1f}s ==========", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    RESULT["ok"] = False
    RESULT["failed_stage"] = _STAGE[0]
    RESULT["error_type"] = "timeout"
    RESULT["error"] = f"killed by signal {signum} (time limit) during {_STAGE[0]}"
    write_result()
    os._exit(124)


def main() -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(BUDGET + 10, exit=False)  # stacks, if something hangs past budget
    signal.signal(signal.SIGTERM, on_sigterm)
    setup_env()
    mark("env", batches=BATCHES, ctx=CTX, out=NOUT, max_len=MAX_LEN, mnbt=MNBT, kv=KV_DTYPE, eager=EAGER,
         patch=PATCH, cg_sizes=CG_SIZES, budget_s=BUDGET, model=MODEL_DIR)
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        cfg = json.load(f)
    RESULT["model"] = {k: cfg.get(k) for k in ("num_hidden_layers", "n_routed_experts", "hidden_size",
                                                 "compress_ratios", "expert_dtype")}
    begin("import")
    importlib.import_module("torch")
    importlib.import_module("vllm")

    RESULT["versions"] = versions()
    mark("import ok", **RESULT["versions"])
    if SMOKE:
        begin("smoke: vLLM tilelang mhc_post (nvcc JIT) + cute-dsl op imports")
        RESULT["smoke"] = smoke()
        mark("smoke ok", **RESULT["smoke"])
    if PATCH:
        patch_dummy_loader()
    begin("engine build (model init, dummy weights, profile run, KV cache, CUDA graphs)")
    llm = build_llm()
    RESULT["engine"] = engine_facts(llm)
    mark("engine built", **RESULT["engine"])
    begin("warmup generate")
    ps = prompts(2, 64, 7)
    t, outs = timed_generate(llm, ps, 8)
    mark("warmup done", seconds=round(t, 2), tokens=[list(o.outputs[0].token_ids) for o in outs])
    rows = []
    for b in BATCHES:
        left = BUDGET - (time.time() - T0)
        if left < 25:
            mark(f"batch {b} skipped", reason=f"budget: {left:.0f}s left of {BUDGET}s")
            rows.append({"batch": b, "skipped": "budget"})
            continue
        begin(f"measure batch {b}")
        row = measure(llm, b)
        rows.append(row)
        mark(f"batch {b} done", **row)
    RESULT["rows"] = rows
    RESULT["ok"] = True
    print_table([r for r in rows if "skipped" not in r])
    mark("done")
    write_result()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - recorded in full, then exit 1
        fail(exc)
