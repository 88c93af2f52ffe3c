"""Where the TMA prefill kernel loses on short chunks.

On an H200 the production TMA path (`kernels/prefill_tma.py`, through `mixed_attention`)
took 381-385 us for 8 fresh prompts of 1,024 tokens, while a plain contiguous causal
kernel with the same tiles (GQA-packed, 32 query tokens x 4 heads, 128-key tiles, 8 warps,
3 stages; `prefill_headroom.py`'s "tma gqa-packed q=32 n=128 w=8 st=3") took 212 us; at
1 x 8,192 the two were 1,148 and 1,069 us. The difference is per program, not per tile.
This probe times, at 8 x 1,024, 2 x 4,096, 1 x 8,192 and the served burst's ragged step:
- the production path, through `mixed_attention` and the TMA kernel alone, each under
  `do_bench` and `do_bench_cudagraph` (a host-bound launch shows as a gap between them);
- a copy of the production kernel with one difference switched at a time: Q through a
  tensor descriptor (`QTMA`), the query tiles in launch order instead of counted down
  (`UP`), the plain normalised store instead of `store_split` (`STORE`), -1e30 instead of
  -inf under the causal mask (`FINITE`), and all four;
- the contiguous kernel (equal lengths only), for reference;
and prints each compiled kernel's registers and spills. Every row is checked against a
float32 SDPA per sequence first.

    python3 benchmarks/tma_prefill_probe.py
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

from kvserve.attention.kernels import mixed_attention
from kvserve.attention.kernels.prefill_tma import prefill_attention_tma, _prefill_tma_kernel
from prefill_headroom import (HEADS, KV_HEADS, HEAD_DIM, GROUP, LOG2E, RAGGED, ragged_cache, reference,
                              tma_attention, _tma_causal)

BLOCK_Q, BLOCK_N = 32, 128
BLOCK_M = BLOCK_Q * GROUP
VARIANTS = {"copy": {}, "QTMA": {"QTMA": True}, "UP": {"UP": True}, "STORE": {"STORE": True},
            "FINITE": {"FINITE": True}, "all four": {"QTMA": True, "UP": True, "STORE": True, "FINITE": True}}


@triton.jit
def _fold(q, k_desc, v_desc, row, kv_head, m_i, l_i, acc, qk_scale, tok, keys,
          BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, FINITE: tl.constexpr):
    k = k_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(keys[None, :] <= tok[:, None], s, -1.0e30 if FINITE else float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _probe_kernel(q_ptr, q_desc, k_desc, v_desc, out_ptr, query_start_loc_ptr, qk_scale,
                  stride_qt, stride_qh, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  QTMA: tl.constexpr, UP: tl.constexpr, STORE: tl.constexpr, FINITE: tl.constexpr):
    """The production kernel's fresh-key path (no prefix, no single-query skip)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    seq = tl.program_id(2)
    q_tile = tl.program_id(0) if UP else tl.num_programs(0) - 1 - tl.program_id(0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = tok < q_len
    dims = tl.arange(0, HEAD_DIM)
    if QTMA:
        q = q_desc.load([q_start + q_tile * BLOCK_Q, kv_head * GROUP, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = q_tile * BLOCK_Q
    diag = first // BLOCK_N * BLOCK_N
    for n in tl.range(0, diag, BLOCK_N):
        m_i, l_i, acc = _fold(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                              n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, False, FINITE)
    for n in tl.range(diag, tl.minimum(first + BLOCK_Q, q_len), BLOCK_N):
        m_i, l_i, acc = _fold(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                              n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, True, FINITE)
    token = (q_start + tok).to(tl.int64)
    if STORE:
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    else:
        out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + dims[None, :], out,
             mask=row_valid[:, None])


def probe(q, k, v, out, starts, max_len, **flags):
    from triton.tools.tensor_descriptor import TensorDescriptor
    qd = TensorDescriptor.from_tensor(q, [BLOCK_Q, GROUP, HEAD_DIM])
    kd, vd = (TensorDescriptor.from_tensor(t, [BLOCK_N, 1, HEAD_DIM]) for t in (k, v))
    grid = (triton.cdiv(max_len, BLOCK_Q), KV_HEADS, starts.shape[0] - 1)
    kw = {"QTMA": False, "UP": False, "STORE": False, "FINITE": False} | flags
    _probe_kernel[grid](q, qd, kd, vd, out, starts, HEAD_DIM ** -0.5 * LOG2E, q.stride(0), q.stride(1),
                        out.stride(0), out.stride(1), NUM_HEADS=HEADS, GROUP=GROUP, HEAD_DIM=HEAD_DIM,
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=8, num_stages=3, **kw)
    return out


def registers(kernel) -> str:
    """Registers and spills of each variant this JIT function compiled."""
    rows = []
    try:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                rows.append(f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared}")
    except Exception as e:  # noqa: BLE001 - Triton's cache layout is not an API
        rows.append(f"unreadable: {type(e).__name__}: {e}")
    return "; ".join(sorted(set(rows)))


def case(lengths: list[int]) -> None:
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], 1, b - a).transpose(1, 2).reshape(b - a, HEADS, HEAD_DIM)
                     for a, b in itertools.pairwise(starts.tolist())])
    cache, table = ragged_cache(k, v, lengths)
    out = torch.empty_like(q)
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
    top, scale = max(lengths), HEAD_DIM ** -0.5
    runs = [("production, mixed_attention", lambda: mixed_attention(
                q, cache, out, table, starts, lens, top, top, scale, None, 0, fresh_kv=(k, v), cached_prefixes=False)),
            ("production, TMA kernel alone", lambda: prefill_attention_tma(
                q, k, v, cache, out, table, starts, lens, top, scale, cached_prefixes=False))]
    runs += [(f"probe {name}", lambda f=f: probe(q, k, v, out, starts, top, **f)) for name, f in VARIANTS.items()]
    if len(set(lengths)) == 1:
        runs.append(("contiguous kernel (headroom)", lambda: tma_attention(
            q, k, v, out, len(lengths), lengths[0], True, BLOCK_Q, BLOCK_N, 8, 3)))
    label = f"{len(lengths)} seqs / {total} tokens / max {top}"
    for name, fn in runs:
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, warmup=25, rep=100)
            graph_ms = do_bench_cudagraph(fn, rep=100)
            print(f"{label:<32} {name:<30} {ms * 1e3:8.1f} us  graph {graph_ms * 1e3:8.1f} us "
                  f"{flops / graph_ms / 1e9:6.1f} TFLOP/s  rel err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row
            print(f"{label:<32} {name:<30} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    for lengths in ([1024] * 8, [4096] * 2, [8192], RAGGED):
        case(lengths)
    print("production kernel:", registers(_prefill_tma_kernel))
    print("probe kernel:", registers(_probe_kernel))
    print("contiguous kernel:", registers(_tma_causal))


if __name__ == "__main__":
    main()
