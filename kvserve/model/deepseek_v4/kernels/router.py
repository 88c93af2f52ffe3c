"""The V4 MoE router's glue after its GEMM, as one Triton kernel: expert
scores (sqrtsoftplus / sigmoid / softmax), the experts (top-k of scores +
correction bias, or the hash table's `tid2eid[token]`), and the routing
weights (renormalised, scaled).

Why: `layers.Gate.forward` is ~9 torch launches after the GEMM (score,
bias add, top-k, gather, sum, add, divide, scale); per V4-Flash-l8 decode
step that was ~10 of ~50 launches per layer once the mHC and norm glue were
fused. One program per token, k-fold argmax over the experts: no host sync,
shapes fixed by T (CUDA-graph safe).

Rounding follows `Gate.forward` in the logits' dtype: scores, the weights'
sum, quotient and scaled product are each rounded to it; top-k compares
float32 scores + bias, ties going to the lower expert id.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _log1p(u):
    """log(1 + u), accurate for small u (Goldberg's correction)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))


@triton.jit
def _scores(logits, ok, dtype: tl.constexpr, FUNC: tl.constexpr):
    if FUNC == 0:  # sqrt(softplus), softplus (threshold 20, as torch's) rounded first
        soft = tl.maximum(logits, 0.0) + _log1p(tl.exp(-tl.abs(logits)))
        return tl.sqrt(tl.where(logits > 20.0, logits, soft).to(dtype).to(tl.float32))
    if FUNC == 1:
        return tl.sigmoid(logits)
    p = tl.exp(tl.where(ok, logits, float("-inf")) - tl.max(tl.where(ok, logits, float("-inf")), 0))
    return p / tl.sum(p, 0)


@triton.jit
def _top_k(scores, bias_ptr, experts, ok, slots, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """(expert ids, their scores) [K_PAD] of the TOP_K largest scores + bias."""
    biased = tl.where(ok, scores + tl.load(bias_ptr + experts, mask=ok, other=0.0), float("-inf"))
    ids = tl.zeros((K_PAD,), tl.int64)
    picked = tl.zeros((K_PAD,), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.min(tl.where(biased == tl.max(biased, 0), experts, BLOCK_E), 0)
        ids = tl.where(slots == j, best, ids)
        picked = tl.where(slots == j, tl.sum(tl.where(experts == best, scores, 0.0), 0), picked)
        biased = tl.where(experts == best, float("-inf"), biased)
    return ids, picked


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, token_ptr, tid2eid_ptr, weights_ptr, indices_ptr, num_experts, scale,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, FUNC: tl.constexpr, IS_HASH: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = weights_ptr.dtype.element_ty
    experts = tl.arange(0, BLOCK_E)
    ok = experts < num_experts
    logits = tl.load(logits_ptr + t * num_experts + experts, mask=ok, other=0.0).to(tl.float32)
    scores = tl.where(ok, _scores(logits, ok, dtype, FUNC).to(dtype).to(tl.float32), 0.0)
    slots = tl.arange(0, K_PAD)
    if IS_HASH:
        token = tl.load(token_ptr + t)
        ids = tl.load(tid2eid_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0).to(tl.int64)
        picked = tl.sum(tl.where(experts[None, :] == ids[:, None], scores[None, :], 0.0), 1)
    else:
        ids, picked = _top_k(scores, bias_ptr, experts, ok, slots, TOP_K, K_PAD, BLOCK_E)
    total = tl.sum(tl.where(slots < TOP_K, picked, 0.0), 0).to(dtype).to(tl.float32)
    weights = (picked / (total + 1e-20).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(weights_ptr + t * TOP_K + slots, (weights * scale).to(dtype), mask=slots < TOP_K)
    tl.store(indices_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


def route_tokens(logits: torch.Tensor, func: str, top_k: int, scale: float, bias: torch.Tensor | None = None,
                 input_ids: torch.Tensor | None = None,
                 tid2eid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`Gate.forward` after its GEMM: (weights [T, k] in logits' dtype, expert ids
    [T, k] int64) from router logits [T, E]; top-k of scores + `bias`, or with
    `tid2eid` [vocab, k] the hash table's experts of `input_ids`."""
    T, num_experts = logits.shape
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    is_hash = tid2eid is not None
    if T:
        _router_kernel[(T,)](logits.contiguous(), bias if not is_hash else logits,
                             input_ids if is_hash else logits, tid2eid if is_hash else logits, weights, indices,
                             num_experts, float(scale), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                             FUNC=_FUNCS[func], IS_HASH=is_hash, BLOCK_E=triton.next_power_of_2(num_experts),
                             num_warps=1 if num_experts <= 256 else 4)
    return weights, indices
