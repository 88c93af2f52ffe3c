"""reshape_and_cache: scatter a step's new K/V [T, KVH, D] into the paged cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token (e.g. a CUDA-graph batch slot): nothing to store
        return
    offs = tl.arange(0, BLOCK)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    valid = offs < NUM_KV_HEADS * HEAD_DIM
    dst = ((slot // PAGE_SIZE) * stride_cache_block
           + (slot % PAGE_SIZE) * stride_cache_offset + head * stride_cache_head + dim)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=valid)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=valid)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=valid)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=valid)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D]; slot_mapping: [T] int64 (negative = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim))
