"""Skinny-GEMM (decode, M <= 8) Triton kernel vs cuBLAS on the Qwen3-8B projection shapes:
`python3 benchmarks/skinny_gemm_bench.py` (an exploration; see docs/BENCHMARKS_HISTORY.md,
"Diagnostics after run 4", 2026-11-29, H200)."""
import torch, triton, triton.language as tl


@triton.jit
def skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    for k in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def skinny(x, w, cfg):
    bn, bk, sk, warps, stages = cfg
    M, K = x.shape; N = w.shape[0]
    y = torch.zeros((M, N), device=x.device, dtype=torch.float32) if sk > 1 else torch.empty((M, N), device=x.device, dtype=x.dtype)
    skinny_kernel[(triton.cdiv(N, bn), sk)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                           BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps, num_stages=stages)
    return y


def bench(f, reps=200):
    g = torch.cuda.CUDAGraph()
    f(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(20): f()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps // 20): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1000  # us


shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
cfgs = [(bn, bk, sk, w, st) for bn in (16, 32, 64) for bk in (128, 256) for sk in (1,) for w in (4,) for st in (3, 4, 6)]
cfgs += [(32, 256, 2, 4, 4), (64, 256, 2, 4, 4), (32, 128, 2, 4, 4)]
torch.manual_seed(0)
for name, (N, K) in shapes.items():
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    for M in (1, 4, 8):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        t_cublas = bench(lambda: torch.nn.functional.linear(x, w))
        best = None
        for cfg in cfgs:
            try:
                y = skinny(x, w, cfg)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2: print("bad", name, M, cfg, err); continue
                t = bench(lambda: skinny(x, w, cfg))
            except Exception as ex:
                print("fail", cfg, str(ex)[:80]); continue
            if best is None or t < best[0]: best = (t, cfg)
        gb = N * K * 2 / 1e9
        print(f"{name:8s} M={M}: cublas {t_cublas:6.1f} us ({gb/t_cublas*1e6:5.0f} GB/s)  triton {best[0]:6.1f} us ({gb/best[0]*1e6:5.0f} GB/s) {best[1]}")
