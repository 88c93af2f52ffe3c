"""How far the paged prefill kernel sits from what this GPU's attention can do.

At the shapes of a served 8K-token eager step (Qwen3-8B heads: 32 q / 8 kv,
head_dim 128, bf16, block size 16), times:
- the paged kernel as large eager steps run it (`LARGE_TILES`) and as graphs run it (default);
- torch SDPA, cuDNN and flash backends, on contiguous tensors with the KV heads expanded
  (cuDNN's fused attention is FA3-class on Hopper; flash is FA2);
- a contiguous causal kernel in Triton that loads Q/K/V tiles through tensor descriptors
  (TMA), one query head a program or one GQA group a program, over a few tile shapes.
- the TMA path large eager steps take (`kernels/prefill_tma.py`), through `mixed_attention`,
  built without its prefix loop (as fresh prompts run it) and with it;
- with --cudnn-ragged, cuDNN's ragged (THD) attention through `aten._cudnn_attention_forward`:
  the step's packed tokens and unexpanded KV heads, one call for every sequence (the shape of
  vLLM's FA3 varlen call).
Rows print TFLOP/s (causal FLOPs: 4 * heads * head_dim * keys seen) and, for fresh prompts,
the relative error against a float32 SDPA. Then chunks after a cached prefix (paged kernel
against the TMA path; no reference there: tests/test_triton_kernels.py checks it), a ragged
step of the served mixed burst's prompt lengths, and one with some cached prefixes (TMA prefix
tiles of 64 and 128 keys); with --cudnn-ragged also cuDNN's log-sum-exp against float32 and
its first call at new shapes against its warm time. With --cudnn-rows only the ragged step as
one dense cuDNN SDPA call per row (KV heads native through `enable_gqa` or expanded, each row's
exact length or padded to a multiple of 128), against the TMA path: the whole step's time with
the padding and expansion copies, the first call at new lengths (cuDNN builds a plan per
shape), and cuDNN's dense log-sum-exp against float32.

    python3 benchmarks/prefill_headroom.py [--quick] [--cudnn-ragged] [--cudnn-rows]
    # --quick: no contiguous-kernel variants; --cudnn-ragged: cuDNN's ragged rows (on torch 2.11
    # each call took 44-75 ms, first or warm: it builds its plan every time)
"""
from __future__ import annotations

import itertools
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from kvserve.attention.kernels import PrefillConfig, prefill_attention
from kvserve.attention.kernels import mixed_attention
from kvserve.attention.kernels.mixed import LARGE_TILES
from kvserve.attention.kernels.prefill_tma import TmaPrefillConfig, prefill_attention_tma
from kvserve.bench.kernels import paged_cache

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP = HEADS // KV_HEADS
SHAPES = [(1, 8192), (2, 4096), (8, 1024)]
PREFIX_SHAPES = [(1, 4096, 4096), (2, 2048, 2000), (4, 512, 1504), (3, 1000, 7000)]
LOG2E = 1.4426950408889634
CUDNN_RAGGED = "--cudnn-ragged" in sys.argv
CUDNN_ROWS = "--cudnn-rows" in sys.argv
# The contiguous kernel's variants: (GQA-packed rows, query tokens, keys a tile, warps, stages).
TMA_VARIANTS = [(False, 128, 64, 4, 3), (False, 128, 128, 8, 3), (False, 128, 64, 8, 3), (False, 128, 128, 8, 2),
                (True, 32, 64, 4, 3), (True, 32, 128, 8, 3), (True, 64, 64, 8, 3), (True, 64, 128, 8, 2),
                (True, 32, 64, 8, 4)]


@triton.jit
def _fold(q, k, v, m_i, l_i, acc, qk_scale, rows_pos, keys_pos, MASK: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(rows_pos[:, None] >= keys_pos[None, :], s, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _tma_causal(q_desc, k_desc, v_desc, out_ptr, S, qk_scale,
                H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, PACKED: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """Equal-length sequences; program (query tile, sequence x head or x kv head)."""
    q_tile = tl.program_id(0)
    b = tl.program_id(1) // (H // GROUP if PACKED else H)
    h = tl.program_id(1) % (H // GROUP if PACKED else H)
    kvh = h if PACKED else h // GROUP
    ROWS: tl.constexpr = BLOCK_Q * GROUP if PACKED else BLOCK_Q
    row0 = b * S + q_tile * BLOCK_Q
    if PACKED:
        q = q_desc.load([row0, kvh * GROUP, 0]).reshape(ROWS, D)
    else:
        q = q_desc.load([row0, h, 0]).reshape(ROWS, D)
    rows_pos = q_tile * BLOCK_Q + (tl.arange(0, ROWS) // GROUP if PACKED else tl.arange(0, ROWS))
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    diag = q_tile * BLOCK_Q // BLOCK_N * BLOCK_N
    for n in tl.range(0, diag, BLOCK_N):
        k = k_desc.load([b * S + n, kvh, 0]).reshape(BLOCK_N, D)
        v = v_desc.load([b * S + n, kvh, 0]).reshape(BLOCK_N, D)
        m_i, l_i, acc = _fold(q, k, v, m_i, l_i, acc, qk_scale, rows_pos, rows_pos, False)
    for n in tl.range(diag, (q_tile + 1) * BLOCK_Q, BLOCK_N):
        k = k_desc.load([b * S + n, kvh, 0]).reshape(BLOCK_N, D)
        v = v_desc.load([b * S + n, kvh, 0]).reshape(BLOCK_N, D)
        m_i, l_i, acc = _fold(q, k, v, m_i, l_i, acc, qk_scale, rows_pos, n + tl.arange(0, BLOCK_N), True)
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    heads = kvh * GROUP + tl.arange(0, ROWS) % GROUP if PACKED else h + tl.arange(0, ROWS) * 0
    toks = (row0 + (tl.arange(0, ROWS) // GROUP if PACKED else tl.arange(0, ROWS))).to(tl.int64)
    tl.store(out_ptr + (toks * H + heads)[:, None] * D + tl.arange(0, D)[None, :], out)


def tma_attention(q, k, v, out, batch, seq, packed, block_q, block_n, warps, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor
    qd = TensorDescriptor.from_tensor(q, [block_q, GROUP if packed else 1, HEAD_DIM])
    kd = TensorDescriptor.from_tensor(k, [block_n, 1, HEAD_DIM])
    vd = TensorDescriptor.from_tensor(v, [block_n, 1, HEAD_DIM])
    grid = (seq // block_q, batch * (KV_HEADS if packed else HEADS))
    _tma_causal[grid](qd, kd, vd, out, seq, HEAD_DIM ** -0.5 * LOG2E, H=HEADS, GROUP=GROUP, D=HEAD_DIM,
                      PACKED=packed, BLOCK_Q=block_q, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out


def cudnn_ragged(q, k, v, cu_seqlens, max_len, lse=False):
    """Causal attention of packed sequences [T, heads, D] through cuDNN's ragged path."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_seqlens, cu_seqlens, max_len, max_len, lse,
                                                   0.0, True, False, scale=HEAD_DIM ** -0.5)[0]


def reference(q, k, v, batch, seq):
    qc, kc, vc = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    kc, vc = (t.repeat_interleave(GROUP, 1) for t in (kc, vc))
    return F.scaled_dot_product_attention(qc.float(), kc.float(), vc.float(), is_causal=True)


def fresh_step(lengths: list[int]):
    """A step of fresh prompts of `lengths` tokens (seed 0): q [T, HEADS, D], k and v
    [T, KV_HEADS, D], query_start_loc, and the float32 causal reference per sequence."""
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda").unbind(0)
    starts = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], 1, b - a).transpose(1, 2).reshape(b - a, HEADS, HEAD_DIM)
                     for a, b in itertools.pairwise(starts.tolist())])
    return q, k, v, starts, ref


def paged(k, v, batch, seq):
    """The paged cache, block table, query starts and lengths of `batch` fresh prompts of `seq`."""
    cache, table = paged_cache(k, v, batch, 16)
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    return cache, table, starts, lens


def rows_for(batch: int, seq: int, quick: bool) -> list[str]:
    torch.manual_seed(0)
    q = torch.randn(batch * seq, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, batch * seq, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    flops = 4 * batch * HEADS * HEAD_DIM * seq * (seq + 1) // 2
    ref = reference(q, k, v, batch, seq).transpose(1, 2).reshape(batch * seq, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    rows = []

    def row(label, fn):
        try:
            got = fn()
            err = ((got.float() - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, warmup=25, rep=100)
            rows.append(f"{batch}x{seq} {label:<46} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  rel err {err:.1e}")
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not a stop
            rows.append(f"{batch}x{seq} {label:<46} failed: {type(e).__name__}: {str(e)[:160]}")
        print(rows[-1], flush=True)

    cache, table, starts, lens = paged(k, v, batch, seq)
    for name, cfg in (("paged large tiles (eager)", LARGE_TILES), ("paged default (graphs)", PrefillConfig())):
        row(name, lambda cfg=cfg: prefill_attention(q, cache, out, table, starts, lens, seq, HEAD_DIM ** -0.5,
                                                    None, 0, cfg))
    for name, cached in (("tma path (mixed_attention, fresh K/V)", False), ("tma path with its prefix loop", True)):
        row(name, lambda cached=cached: mixed_attention(q, cache, out, table, starts, lens, seq, seq, HEAD_DIM ** -0.5,
                                                        None, 0, fresh_kv=(k, v), cached_prefixes=cached))
    if CUDNN_RAGGED:
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
        row("cudnn ragged (THD, kv heads unexpanded)", lambda: cudnn_ragged(q, k, v, cu, seq))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qc = q.view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
    kc, vc = (t.view(batch, seq, KV_HEADS, HEAD_DIM).repeat_interleave(GROUP, 2).transpose(1, 2) for t in (k, v))
    for name, backend in (("sdpa cudnn (heads expanded)", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash (heads expanded)", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True).transpose(1, 2).reshape(
                    batch * seq, HEADS, HEAD_DIM)
        row(name, sdpa)
    for packed, bq, bn, w, st in [] if quick else TMA_VARIANTS:
        label = f"tma {'gqa-packed' if packed else 'per-head'} q={bq} n={bn} w={w} st={st}"
        row(label, lambda a=(packed, bq, bn, w, st): tma_attention(q, k, v, out, batch, seq, *a))
    return rows


def prefix_rows(batch: int, new: int, prefix: int) -> None:
    """`batch` chunks of `new` tokens after `prefix` cached ones: paged kernel against the TMA path."""
    torch.manual_seed(0)
    total = prefix + new
    q = torch.randn(batch * new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, batch * total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache, table = paged_cache(k, v, batch, 16)
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
    lens = torch.full((batch,), total, dtype=torch.int32, device="cuda")
    fresh = tuple(t.view(batch, total, KV_HEADS, HEAD_DIM)[:, prefix:].reshape(-1, KV_HEADS, HEAD_DIM) for t in (k, v))
    out = torch.empty_like(q)
    flops = 4 * batch * HEADS * HEAD_DIM * (new * prefix + new * (new + 1) // 2)
    paged_out = prefill_attention(q, cache, out.clone(), table, starts, lens, new, HEAD_DIM ** -0.5, None, 0,
                                  LARGE_TILES)
    runs = [("paged large tiles", lambda: prefill_attention(q, cache, out, table, starts, lens, new,
                                                             HEAD_DIM ** -0.5, None, 0, LARGE_TILES))]
    for n in (32, 64, 128):
        runs.append((f"tma, prefix tiles of {n}", lambda n=n: prefill_attention_tma(
            q, *fresh, cache, out, table, starts, lens, new, HEAD_DIM ** -0.5, TmaPrefillConfig(prefix_block_n=n))))
    for name, fn in runs:
        ms = do_bench(fn, warmup=25, rep=100)
        diff = ((out.float() - paged_out.float()).norm() / paged_out.float().norm()).item()
        print(f"{batch}x{new} after {prefix} {name:<24} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s"
              f"  rel diff to paged {diff:.1e}", flush=True)


# Prompt lengths of the served mixed burst's first requests (workload `mixed`, seed 0): one ~8K step.
RAGGED = [4313, 1311, 1033, 891, 120, 175, 107]
RAGGED_NEW_SHAPES = [[1558, 4313, 883, 760, 757], [4313, 4313], [1147, 407, 1084, 152, 1073, 1101, 885, 1946, 1191]]


def timed_rows(label: str, runs, ref: torch.Tensor, flops: int, warmup: int = 25, rep: int = 100) -> None:
    """Print each run's time, TFLOP/s and relative error against `ref`; a run that fails is a row."""
    for name, fn in runs:
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, warmup=warmup, rep=rep)
            print(f"{label} {name:<28} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  rel err {err:.1e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a path that fails here is a row
            print(f"{label} {name:<28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def ragged_rows() -> None:
    """One step of ragged fresh prompts: paged kernel, TMA path and cuDNN against a float32
    reference per sequence; then cuDNN's first call at new shapes (plan building) against its warm time."""
    torch.manual_seed(0)
    total = sum(RAGGED)
    q = torch.randn(total, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([0] + list(itertools.accumulate(RAGGED)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(RAGGED, dtype=torch.int32, device="cuda")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], 1, b - a).transpose(1, 2).reshape(b - a, HEADS, HEAD_DIM)
                     for a, b in itertools.pairwise(starts.tolist())])
    cache, table = ragged_cache(k, v, RAGGED)
    out = torch.empty_like(q)
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in RAGGED)
    runs = [("paged large tiles", lambda: prefill_attention(q, cache, out, table, starts, lens, max(RAGGED),
                                                             HEAD_DIM ** -0.5, None, 0, LARGE_TILES)),
            ("tma path", lambda: mixed_attention(q, cache, out, table, starts, lens, max(RAGGED), max(RAGGED),
                                                 HEAD_DIM ** -0.5, None, 0, fresh_kv=(k, v), cached_prefixes=False)),
            ("tma with prefix loop", lambda: mixed_attention(q, cache, out, table, starts, lens, max(RAGGED),
                                                             max(RAGGED), HEAD_DIM ** -0.5, None, 0, fresh_kv=(k, v))),
            ("cudnn ragged", lambda: cudnn_ragged(q, k, v, starts, max(RAGGED))),
            ("cudnn ragged + lse", lambda: cudnn_ragged(q, k, v, starts, max(RAGGED), lse=True))][:None if CUDNN_RAGGED else 3]
    timed_rows(f"ragged {len(RAGGED)} seqs / {total} tokens", runs, ref, flops)
    if not CUDNN_RAGGED:
        return
    lse_check(q, k, v, starts)
    for shape in RAGGED_NEW_SHAPES + [RAGGED_NEW_SHAPES[0][::-1]]:
        cu = torch.tensor([0] + list(itertools.accumulate(shape)), dtype=torch.int32, device="cuda")
        n = sum(shape)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cudnn_ragged(q[:n], k[:n], v[:n], cu, max(shape))
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            warm = do_bench(lambda: cudnn_ragged(q[:n], k[:n], v[:n], cu, max(shape)), warmup=5, rep=20)
            print(f"cudnn new shape {len(shape)} seqs / {n} tokens / max {max(shape)}: first call {first:8.1f} ms, "
                  f"warm {warm * 1e3:7.1f} us", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"cudnn new shape failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


# (cached prefix, new tokens) of a served burst's step: most prompts fresh, some after a cached
# file prefix (656 tokens), one decode row.
RAGGED_PREFIXED = [(0, 4313), (656, 227), (0, 1311), (656, 104), (0, 1033), (0, 891), (672, 85), (900, 1)]


def ragged_prefix_rows() -> None:
    """A served-like step with some cached prefixes: the paged kernel against the TMA path at
    prefix tiles of 64 and 128 keys (differences to the paged kernel; the tests check both)."""
    torch.manual_seed(0)
    totals = [p + n for p, n in RAGGED_PREFIXED]
    k_all, v_all = torch.randn(2, sum(totals), KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache, table = ragged_cache(k_all, v_all, totals)
    fresh_rows = torch.cat([torch.arange(a + p, a + p + n) for a, (p, n) in
                            zip(itertools.accumulate([0] + totals[:-1]), RAGGED_PREFIXED)]).cuda()
    k, v = k_all[fresh_rows], v_all[fresh_rows]
    news = [n for _, n in RAGGED_PREFIXED]
    q = torch.randn(sum(news), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(totals, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = sum(4 * HEADS * HEAD_DIM * (n * p + n * (n + 1) // 2) for p, n in RAGGED_PREFIXED)
    base = mixed_attention(q, cache, out.clone(), table, starts, lens, max(news), max(totals), HEAD_DIM ** -0.5,
                           None, 0)
    runs = [("paged (mixed_attention)", lambda: mixed_attention(q, cache, out, table, starts, lens, max(news),
                                                                max(totals), HEAD_DIM ** -0.5, None, 0))]
    for n in (64, 128):
        runs.append((f"tma, prefix tiles of {n}", lambda n=n: prefill_attention_tma(
            q, k, v, cache, out, table, starts, lens, max(news), HEAD_DIM ** -0.5,
            TmaPrefillConfig(prefix_block_n=n), single_queries=False)))
    for name, fn in runs:
        ms = do_bench(fn, warmup=25, rep=100)
        rows = starts[-2].item()   # the decode row is the decode kernel's (the paged row's only)
        diff = ((out[:rows].float() - base[:rows].float()).norm() / base[:rows].float().norm()).item()
        print(f"ragged with prefixes {len(news)} seqs / {sum(news)} tokens {name:<24} {ms * 1e3:8.1f} us "
              f"{flops / ms / 1e9:6.1f} TFLOP/s  rel diff to paged {diff:.1e}", flush=True)


def lse_check(q, k, v, starts) -> None:
    """cuDNN's log-sum-exp (what a merge with a cached prefix's part needs): its layout, and
    its largest error against float32 for the second sequence."""
    try:
        lse = torch.ops.aten._cudnn_attention_forward(q, k, v, None, starts, starts, max(RAGGED), max(RAGGED), True,
                                                      0.0, True, False, scale=HEAD_DIM ** -0.5)[1]
        a, b = starts[1].item(), starts[2].item()
        qs = q[a:b].float().transpose(0, 1)                                   # [H, n, D]
        ks = k[a:b].float().repeat_interleave(GROUP, 1).transpose(0, 1)      # [H, n, D]
        s = qs @ ks.transpose(1, 2) * HEAD_DIM ** -0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        ref = torch.logsumexp(s, -1)                                           # [H, n]
        got = lse[..., a:b] if lse.shape[-1] == q.shape[0] else lse[a:b].transpose(0, 1)
        print(f"cudnn lse: shape {tuple(lse.shape)} stride {lse.stride()} dtype {lse.dtype}; "
              f"max abs err (read as [.., T]) {(got.reshape(ref.shape).float() - ref).abs().max().item():.2e}",
              flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"cudnn lse failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def ragged_cache(k, v, lengths):
    """A paged cache holding each sequence's K/V (block size 16; block 0, the NULL block, unused)
    and its block table."""
    block = 16
    blocks = [-(-n // block) for n in lengths]
    cache = torch.zeros(2, sum(blocks) + 1, block, KV_HEADS, HEAD_DIM, dtype=k.dtype, device=k.device)
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=k.device)
    first, start = 1, 0
    for i, (n, nb) in enumerate(zip(lengths, blocks)):
        table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        for c, t in enumerate((k, v)):
            cache[c].view(-1, KV_HEADS, HEAD_DIM)[first * block:first * block + n] = t[start:start + n]
        first, start = first + nb, start + n
    return cache, table


def _row_views(t: torch.Tensor, a: int, b: int, heads: int) -> torch.Tensor:
    """Tokens a..b of a packed [T, heads, D] tensor as SDPA's [1, heads, n, D] (a strided view)."""
    return t[a:b].view(1, b - a, heads, HEAD_DIM).transpose(1, 2)


def cudnn_row(q, k, v, out, a, b, gqa: bool, bucket: int):
    """Causal attention of tokens a..b, one dense cuDNN call: KV heads native (`enable_gqa`) or
    expanded; with `bucket`, padded to a multiple of it (padded keys sit after every real query,
    so causality hides them; padded queries are dropped)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, first = b - a, a
    if bucket:
        m = -(-n // bucket) * bucket
        qs, ks, vs = (F.pad(t[a:b], (0, 0, 0, 0, 0, m - n)) for t in (q, k, v))
        a, b = 0, m
    else:
        qs, ks, vs = q, k, v
    qv = _row_views(qs, a, b, HEADS)
    if gqa:
        kv, vv = _row_views(ks, a, b, KV_HEADS), _row_views(vs, a, b, KV_HEADS)
    else:
        kv, vv = (t[a:b].repeat_interleave(GROUP, 1).view(1, b - a, HEADS, HEAD_DIM).transpose(1, 2) for t in (ks, vs))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qv, kv, vv, is_causal=True, enable_gqa=gqa)
    out[first:first + n] = o.transpose(1, 2)[0, :n]


def cudnn_rows() -> None:
    """The ragged step as dense cuDNN calls, one a row, against the TMA path."""
    torch.manual_seed(0)
    total = sum(RAGGED)
    q = torch.randn(total, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    bounds = list(itertools.pairwise([0] + list(itertools.accumulate(RAGGED))))
    starts = torch.tensor([0] + list(itertools.accumulate(RAGGED)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(RAGGED, dtype=torch.int32, device="cuda")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], 1, b - a).transpose(1, 2).reshape(b - a, HEADS, HEAD_DIM)
                     for a, b in bounds])
    cache, table = ragged_cache(k, v, RAGGED)
    out = torch.empty_like(q)
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in RAGGED)
    runs = [("tma path", lambda: mixed_attention(q, cache, out, table, starts, lens, max(RAGGED), max(RAGGED),
                                                 HEAD_DIM ** -0.5, None, 0, fresh_kv=(k, v), cached_prefixes=False))]
    for gqa, bucket in ((True, 0), (False, 0), (True, 128), (False, 128)):
        def step(gqa=gqa, bucket=bucket):
            for a, b in bounds:
                cudnn_row(q, k, v, out, a, b, gqa, bucket)
            return out
        runs.append((f"cudnn rows {'gqa' if gqa else 'expanded'} {'bucket ' + str(bucket) if bucket else 'exact'}", step))
    timed_rows(f"rows {len(RAGGED)} seqs / {total} tokens", runs, ref, flops, warmup=10, rep=50)
    for gqa, bucket in ((True, 0), (True, 128)):
        for n in (1500, 1501, 2999, 3001, 777):   # lengths not seen above
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cudnn_row(q, k, v, out, 0, n, gqa, bucket)
                torch.cuda.synchronize()
                first = (time.perf_counter() - t0) * 1e3
                warm = do_bench(lambda: cudnn_row(q, k, v, out, 0, n, gqa, bucket), warmup=3, rep=10)
                print(f"cudnn row new length {n} gqa={gqa} bucket={bucket}: first call {first:7.1f} ms, "
                      f"warm {warm * 1e3:7.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"cudnn row new length {n} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    dense_lse_check(q, k, v)
    cudnn_prefixed_rows()


def _cudnn_part(qv, kv, vv, causal: bool):
    """(out [1, H, n, D], log-sum-exp [1, H, n]) of one dense cuDNN call, KV heads expanded."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(qv, kv, vv, None, True, 0.0, causal, False,
                                                             scale=HEAD_DIM ** -0.5)
    return res[0], res[1].reshape(qv.shape[:3])


def cudnn_prefixed_row(q, k_all, v_all, out, a, prefix, n, key_at):
    """A chunk of n queries after `prefix` cached keys (tokens key_at.. of k_all/v_all, the
    prefix first): cuDNN over the prefix (no mask) and over the chunk's own keys (causal),
    each with its log-sum-exp, merged."""
    qv = _row_views(q, a, a + n, HEADS)
    own_k, own_v = (t[key_at + prefix:key_at + prefix + n].repeat_interleave(GROUP, 1).view(1, n, HEADS, HEAD_DIM)
                    .transpose(1, 2) for t in (k_all, v_all))
    o2, l2 = _cudnn_part(qv, own_k, own_v, True)
    if prefix == 0:
        out[a:a + n] = o2.transpose(1, 2)[0]
        return
    pre_k, pre_v = (t[key_at:key_at + prefix].repeat_interleave(GROUP, 1).view(1, prefix, HEADS, HEAD_DIM)
                    .transpose(1, 2) for t in (k_all, v_all))
    o1, l1 = _cudnn_part(qv, pre_k, pre_v, False)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    merged = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    out[a:a + n] = merged.transpose(1, 2)[0].to(out.dtype)


def cudnn_prefixed_rows() -> None:
    """The served-like step with cached prefixes (RAGGED_PREFIXED, its decode row left out) and a
    long chunk after a long prefix: the TMA path against cuDNN calls a row, a prefixed row's
    prefix gathered contiguous first (here already so: the gather's cost is not in these times),
    its two parts merged through their log-sum-exps. Each checked against float32."""
    for shape in ([(p, n) for p, n in RAGGED_PREFIXED if n > 1], [(4096, 4096)], [(2000, 2048), (2000, 2048)]):
        torch.manual_seed(0)
        totals = [p + n for p, n in shape]
        k_all, v_all = torch.randn(2, sum(totals), KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        cache, table = ragged_cache(k_all, v_all, totals)
        key_at = [0] + list(itertools.accumulate(totals))[:-1]
        fresh_rows = torch.cat([torch.arange(a + p, a + p + n) for a, (p, n) in zip(key_at, shape)]).cuda()
        news = [n for _, n in shape]
        q = torch.randn(sum(news), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        q_at = [0] + list(itertools.accumulate(news))
        starts = torch.tensor(q_at, dtype=torch.int32, device="cuda")
        lens = torch.tensor(totals, dtype=torch.int32, device="cuda")
        ref = []
        for a, ka, (p, n) in zip(q_at, key_at, shape):
            qs = q[a:a + n].float().transpose(0, 1)
            ks, vs = (t[ka:ka + p + n].float().repeat_interleave(GROUP, 1).transpose(0, 1) for t in (k_all, v_all))
            sc = qs @ ks.transpose(1, 2) * HEAD_DIM ** -0.5
            mask = torch.ones(n, p + n, dtype=torch.bool, device="cuda").triu(p + 1)
            ref.append((sc.masked_fill(mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        ref = torch.cat(ref)
        out = torch.empty_like(q)
        flops = sum(4 * HEADS * HEAD_DIM * (n * p + n * (n + 1) // 2) for p, n in shape)
        k, v = k_all[fresh_rows], v_all[fresh_rows]

        def rows():
            for a, ka, (p, n) in zip(q_at, key_at, shape):
                cudnn_prefixed_row(q, k_all, v_all, out, a, p, n, ka)
            return out
        runs = [("tma path", lambda: prefill_attention_tma(q, k, v, cache, out, table, starts, lens, max(news),
                                                           HEAD_DIM ** -0.5, TmaPrefillConfig(), single_queries=False)),
                ("paged large tiles", lambda: prefill_attention(q, cache, out, table, starts, lens, max(news),
                                                                 HEAD_DIM ** -0.5, None, 0, LARGE_TILES)),
                ("cudnn rows, prefix merged", rows)]
        timed_rows(f"prefixed {shape}", runs, ref, flops, warmup=10, rep=50)


def dense_lse_check(q, k, v) -> None:
    """cuDNN's dense log-sum-exp (a merge with a cached prefix's part needs it) against float32."""
    n = 1000
    try:
        qv, kv, vv = _row_views(q, 0, n, HEADS), *(_row_views(t, 0, n, KV_HEADS).repeat_interleave(GROUP, 1)
                                                     for t in (k, v))
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qv, kv.contiguous(), vv.contiguous(), None, True,
                                                                 0.0, True, False, scale=HEAD_DIM ** -0.5)
        lse = res[1]
        s = qv[0].float() @ kv[0].float().transpose(1, 2) * HEAD_DIM ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        ref = torch.logsumexp(s, -1)
        print(f"cudnn dense lse: shape {tuple(lse.shape)} dtype {lse.dtype}; max abs err "
              f"{(lse.reshape(ref.shape).float() - ref).abs().max().item():.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"cudnn dense lse failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    if CUDNN_ROWS:
        cudnn_rows()
        return
    quick = "--quick" in sys.argv
    for batch, seq in SHAPES:
        rows_for(batch, seq, quick)
    for shape in PREFIX_SHAPES:
        prefix_rows(*shape)
    ragged_rows()
    ragged_prefix_rows()


if __name__ == "__main__":
    main()
