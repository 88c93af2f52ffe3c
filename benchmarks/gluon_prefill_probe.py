"""Variants of the TMA path's Gluon prefill kernel (`kvserve/attention/kernels/prefill_gluon.py`).

History: this began as a probe with its own copy of a warp-specialized (FlashAttention-3-style)
kernel, written offline and first run on an H200 on 2026-12-04 (the tree of aa17301; results in
docs/BENCHMARKS.md). Its fastest variant, S(j) issued before P(j-1) V(j-1) with 128-key slots two
deep, became the production kernel; the variants without that overlap, slower at every shape,
went with the copy. What remains explores the production kernel's ring (`GluonPrefillConfig`:
keys a slot, slots) on the problem the probe had: q/out [T, 32, 128] bf16, k/v [T, 8, 128],
ragged fresh prompts, causal within each (block size 16).

    PYTHONPATH=<triton 3.6.0 wheel's site> python benchmarks/gluon_prefill_probe.py --compile-only
        # no GPU: every variant built for sm_90 (GQA group 4, block 16, with and without the
        # prefix loop) and the default at groups 2 and 8 and block 64: registers, spills, shared memory
    python3 benchmarks/gluon_prefill_probe.py      # GPU: the Triton TMA kernel and every variant, each
        # in its own process (a deadlocked ring times out alone), at 8 x 1,024, 2 x 4,096, 1 x 8,192
        # and RAGGED: checked on NaN-poisoned output against float32 SDPA, then timed (us, causal TFLOP/s)
    python3 benchmarks/gluon_prefill_probe.py --variant "n64 st3"   # one variant, in process
"""
from __future__ import annotations


from gluon_harness import compile_rows, compile_sm90, compiled_report, probe_main
from kvserve.attention.kernels import prefill_gluon
from kvserve.attention.kernels.prefill_gluon import GluonPrefillConfig
from prefill_headroom import HEADS, KV_HEADS, HEAD_DIM, GROUP, RAGGED

VARIANTS = {"n128 st2": GluonPrefillConfig(128, 2), "n64 st3": GluonPrefillConfig(64, 3),
            "n64 st4": GluonPrefillConfig(64, 4)}
GPU_CASES = ([1024] * 8, [4096] * 2, [8192], RAGGED)
PRODUCTION = "triton TMA kernel"
TOLERANCE = 2e-2   # relative error to float32; bf16 P and output land near 4e-3


def compile_variant(config: GluonPrefillConfig, group: int = GROUP, page: int = 16, has_prefix: bool = False,
                    listed: bool = True):
    """The production kernel for sm_90, without a GPU, as a launch would specialize it."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    kv = torch.empty(16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)   # CPU: only the type matters
    layout = prefill_gluon._kv_layout(config.block_n)
    tile, pages = (mangle_type(TensorDescriptor.from_tensor(kv, [rows, 1, HEAD_DIM], layout))
                   for rows in (config.block_n, page))
    signature = {"q_ptr": "*bf16", "k_desc": tile, "v_desc": tile, "kc_desc": pages, "vc_desc": pages,
                 "out_ptr": "*bf16", "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "tiles_ptr": "*i32", "qk_scale": "fp32", "min_q_len": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
                 "stride_oh": "i32", "stride_table": "i32"}
    constexprs = {"GROUP": group, "HEAD_DIM": HEAD_DIM, "PAGE": page, "BLOCK_N": config.block_n,
                  "STAGES": config.stages, "HAS_PREFIX": has_prefix, "LISTED": listed,
                  "NUM_KV_HEADS": KV_HEADS}
    aligned = [n for n in signature if n.endswith("_ptr") or n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh")]
    return compile_sm90(prefill_gluon._prefill_gluon_kernel, signature, constexprs, aligned,
                        prefill_gluon.CONSUMER_WARPS.value)


def compile_only() -> int:
    builds = {}
    for name, config in VARIANTS.items():
        for has_prefix in (False, True):
            builds[f"{name}{' prefix' if has_prefix else ''}"] = (
                lambda c=config, h=has_prefix: compile_variant(c, has_prefix=h))
    default = GluonPrefillConfig()
    for group, page in ((2, 16), (8, 16), (4, 64)):
        builds[f"default group {group} page {page} prefix"] = (
            lambda g=group, p=page: compile_variant(default, g, p, True))
    builds["default prefix, full grid"] = lambda: compile_variant(default, has_prefix=True, listed=False)
    return compile_rows(builds, 32)


def case(lengths: list[int], variant: str) -> None:
    """Check one variant against float32 SDPA per sequence on poisoned output, then time it."""
    import torch
    from triton.testing import do_bench_cudagraph
    from kvserve.attention.kernels.prefill_gluon import prefill_attention_gluon
    from kvserve.attention.kernels.prefill_tma import prefill_attention_tma
    from prefill_headroom import fresh_step, ragged_cache
    total, top, scale = sum(lengths), max(lengths), HEAD_DIM ** -0.5
    q, k, v, starts, ref = fresh_step(lengths)
    out = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows in the error
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cache, table = ragged_cache(k, v, lengths)
    if variant == PRODUCTION:
        fn = lambda: prefill_attention_tma(q, k, v, cache, out, table, starts, lens, top, scale,  # noqa: E731
                                           cached_prefixes=False)
    else:
        fn = lambda: prefill_attention_gluon(q, k, v, cache, out, table, starts, lens, top, scale,  # noqa: E731
                                             cached_prefixes=False, config=VARIANTS[variant])
    label = f"{len(lengths)} seqs / {total} tokens / max {top}"
    try:
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        torch.cuda.synchronize()
        verdict = "ok" if err < TOLERANCE else "WRONG"   # nan compares false: WRONG
        ms = do_bench_cudagraph(fn, rep=100)
        flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
        print(f"{variant:<18} {label:<34} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  "
              f"rel err {err:.1e} {verdict}", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row
        print(f"{variant:<18} {label:<34} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def run_variant(variant: str) -> None:
    import torch
    for lengths in GPU_CASES:
        case(lengths, variant)
    if variant != PRODUCTION and torch.cuda.is_initialized():
        print(f"{variant:<18} compiled: {compiled_report(prefill_gluon._prefill_gluon_kernel)}", flush=True)


if __name__ == "__main__":
    probe_main(__file__, __doc__, [PRODUCTION, *VARIANTS], run_variant, compile_only, 18)
