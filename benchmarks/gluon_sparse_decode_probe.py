"""The DeepSeek-V4 sparse decode attention kernel in Gluon (FlashMLA-style), variant by variant.

The kernel is production's `kvserve/model/deepseek_v4/kernels/sparse_decode_gluon.py` (its
module doc says how it works); this probe checks and times its variants: key rows a ring slot
(BLOCK_N), ring depth (STAGES) and dim parts (programs a token: 1, two consumer warpgroups
each with half the output dims; "parts2", two programs a token of one consumer each). Our Triton kernel
(`sparse_attention.py`, planned path, block_n 64, one split) reads its bytes at ~29% of copy
bandwidth at batch 256 (134 us).

The problem (one query token per sequence): q [T, 64, 512] bf16; one shared K = V head whose
row r is storage[r, :512] (bf16, a gather by row id: in production rows sit anywhere in a paged
pool); rows [T, max_keys] lists each token's keys, valid ids first, then -1; sinks [64]
float32, one extra logit per head with a zero value row. out[t, h] = softmax over the token's
keys plus the sink of (512 ** -0.5 * q.k), times the key rows. A token with no key outputs zeros.

Measured (H200, 2026-12-04, docs/BENCHMARKS.md, at 0c8737a, when the probe had its own copy with
int32 ids): "n64 st2" 80.1 us at batch 256 (54.7% of copy), 32.4 us at 64 (33.7%: 64 programs on
132 SMs), 154.5 us at 512; n32 st4 and n32 st2 slower. Persistent variants (one program an SM
walking tokens through one ring) were no faster (80.4 us at 256) and are gone.
Each consumer runs a tile serially (S wgmma, wait, softmax, PV wgmma, wait). FA3's order (S(j)
issued before P(j-1) V(j-1); a slot then released a tile later, two slots held per consumer) was
probed as "n64 st2 overlap" and "n32 st4 overlap": 7-23% slower than "n64 st2" at batch 64, 256
and 512 (H100, 2026-12-05, docs/BENCHMARKS_HISTORY.md), and removed. Split-S with fp32
partial scores needs 2 x 16 KB of exchange at BLOCK_N 64, more than "n64 st2" leaves free
(about 30 KB); at BLOCK_N 32 it fits.
Dim parts ("parts2"): two programs a token fill 128 of 132 SMs at batch 64 where one part fills
64; at 256 and 512 they double the gathers into shared memory for the same work. H100,
2026-12-06 (docs/BENCHMARKS.md): batch 64 33.4 -> 25.0 us, 256 85.7 -> 95.1, 512 160.7 -> 181.4;
production takes two parts only while they fit one wave (`dim_parts`).

    python3 benchmarks/gluon_sparse_decode_probe.py --compile-only   # no GPU: compile every variant
        # for sm_90, print ptxas registers / spills, shared memory and the count of
        # `ttg.warp_specialize` in TTGIR; exits non-zero when a variant fails to compile
    python3 benchmarks/gluon_sparse_decode_probe.py                  # GPU: every variant in its own
        # process (a deadlocked ring times out alone) at batch 64, 256, 512: checked on NaN-poisoned
        # output against a float32 reference, then timed with do_bench_cudagraph (us, GB/s, share
        # of the measured copy bandwidth)
    python3 benchmarks/gluon_sparse_decode_probe.py --variant "n64 st2"   # one variant, in process
"""
from __future__ import annotations

import sys
from pathlib import Path

from gluon_harness import compile_rows, compile_sm90, compiled_report, probe_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # kvserve, when not installed
from kvserve.model.deepseek_v4.kernels import sparse_decode_gluon as sd  # noqa: E402

HEADS, HEAD_DIM = sd.HEADS, sd.HEAD_DIM
WINDOW_KEYS, CHOSEN_KEYS = 128, 512
MAX_KEYS = WINDOW_KEYS + CHOSEN_KEYS
LOG2E = 1.4426950408889634
ROW_ALIGN = HEAD_DIM   # the probe's storage is [rows, 512]: a row id is its offset / 512
# name -> (BLOCK_N key rows per ring slot, STAGES, dim parts); a slot holds BLOCK_N KB.
VARIANTS = {"n64 st2": (64, 2, 1), "n32 st4": (32, 4, 1), "n32 st2": (32, 2, 1),
            "n64 st2 parts2": (64, 2, 2), "n32 st4 parts2": (32, 4, 2)}


def gluon_sparse_decode(q, storage, rows, sinks, out, scale: float, block_n: int, stages: int, parts: int):
    """Production's kernel on the probe's inputs: rows [T, max_keys] int64 storage row ids."""
    return sd.sparse_decode_gluon(q, storage, rows, ROW_ALIGN, sinks, scale * LOG2E, out, block_n, stages, parts)


# ---------------------------------------------------------------- compile-only (no GPU)

def compile_variant(block_n: int, stages: int, parts: int):
    """Compile production's kernel for sm_90 without a GPU, specialized as a launch on MAX_KEYS
    would be."""
    signature = {"q_ptr": "*bf16", "storage_ptr": "*bf16", "plan_ptr": "*i64", "sinks_ptr": "*fp32",
                 "out_ptr": "*bf16", "qk_scale": "fp32", "stride_qt": "i32", "stride_pt": "i32", "stride_ot": "i32",
                 "max_keys": "i32"}
    constexprs = {"HEADS": HEADS, "HEAD_DIM": HEAD_DIM, "BLOCK_N": block_n, "STAGES": stages, "CHUNK": sd.CHUNK,
                  "MAX_TILES": sd.max_tiles(MAX_KEYS, block_n), "ROW_ALIGN": ROW_ALIGN, "PARTS": parts}
    aligned = [n for n in signature if n.endswith("_ptr") or n.startswith("stride_") or n == "max_keys"]
    return compile_sm90(sd._sparse_decode_kernel, signature, constexprs, aligned, sd.CONSUMER_WARPS.value)


def compile_only() -> int:
    return compile_rows({name: lambda v=v: compile_variant(*v) for name, v in VARIANTS.items()}, 20)


# ---------------------------------------------------------------- GPU check and timing

BATCHES = (64, 256, 512)
STORAGE_ROWS = 1 << 20   # 1 GiB of key rows: random gathers miss L2 (50 MB) as in production
TOLERANCE = 2e-2   # relative error to float32; bf16 P and output land near 4e-3


def make_inputs(batch: int):
    """Random q, storage, sinks and row ids: most tokens have all 640 keys, every 5th a random
    shorter list (-1 tail), the last none."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    storage = torch.randn(STORAGE_ROWS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    sinks = torch.randn(HEADS, dtype=torch.float32, device="cuda", generator=gen)
    rows = torch.randint(0, STORAGE_ROWS, (batch, MAX_KEYS), dtype=torch.int64, device="cuda", generator=gen)
    counts = torch.full((batch, ), MAX_KEYS, dtype=torch.int64, device="cuda")
    counts[3::5] = torch.randint(1, MAX_KEYS, counts[3::5].shape, device="cuda", generator=gen)
    counts[-1] = 0
    rows.masked_fill_(torch.arange(MAX_KEYS, device="cuda")[None, :] >= counts[:, None], -1)
    return q, storage, rows, sinks


def reference(q, storage, rows, sinks, scale: float):
    """float32 softmax over each token's valid keys plus the sink column, which is then dropped."""
    import torch
    keys = storage[rows.clamp(min=0)].float()   # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill((rows < 0)[:, None, :], float("-inf"))
    sink = sinks[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def _check_reference(q, storage, rows, sinks, ref, scale: float) -> None:
    """The reference agrees with the engine's torch V4 sink attention on a short-list token."""
    from kvserve.attention.v4_torch_ref import sink_attention
    t = 3
    keys = storage[rows[t].clamp(min=0)].float()
    other = sink_attention(q[t:t + 1].float(), keys, (rows[t] >= 0)[None, :], sinks, scale)[0]
    err = ((other - ref[t]).norm() / ref[t].norm()).item()
    if err > 1e-3:
        raise RuntimeError(f"the harness reference disagrees with v4_torch_ref.sink_attention: {err:.1e}")


def bytes_read(q, rows) -> int:
    """Valid key rows x 1 KB + q + out (written) + the row ids."""
    return int((rows >= 0).sum().item()) * HEAD_DIM * 2 + 2 * q.numel() * 2 + rows.numel() * 8


def case(batch: int, variant: str, copy_gbs: float) -> None:
    """Check one variant against the float32 reference on NaN-poisoned output, then time it."""
    import torch
    from triton.testing import do_bench_cudagraph
    scale = HEAD_DIM ** -0.5
    q, storage, rows, sinks = make_inputs(batch)
    ref = reference(q, storage, rows, sinks, scale)
    label = f"batch {batch}"
    try:
        _check_reference(q, storage, rows, sinks, ref, scale)
        out = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows in the error
        fn = lambda: gluon_sparse_decode(q, storage, rows, sinks, out, scale, *VARIANTS[variant])  # noqa: E731
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        empty_ok = bool((out[-1] == 0).all())   # the token without keys
        torch.cuda.synchronize()
        verdict = "ok" if err < TOLERANCE and empty_ok else "WRONG"   # nan compares false: WRONG
        ms = do_bench_cudagraph(fn, rep=100)
        gbs = bytes_read(q, rows) / ms / 1e6
        print(f"{variant:<20} {label:<10} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs / copy_gbs:5.1%} of copy  "
              f"rel err {err:.1e} empty token {'zeros' if empty_ok else 'NOT zeros'} {verdict}", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row
        print(f"{variant:<20} {label:<10} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def run_variant(variant: str) -> None:
    import torch
    from kvserve.bench.kernels import copy_bandwidth_gbs
    copy_gbs = copy_bandwidth_gbs(1 << 30)
    print(f"{variant:<20} device copy bandwidth {copy_gbs:.0f} GB/s (read + write of 1 GiB)", flush=True)
    for batch in BATCHES:
        case(batch, variant, copy_gbs)
    if torch.cuda.is_initialized():
        print(f"{variant:<20} compiled: {compiled_report(sd._sparse_decode_kernel)}", flush=True)


if __name__ == "__main__":
    probe_main(__file__, __doc__, list(VARIANTS), run_variant, compile_only, 20)
