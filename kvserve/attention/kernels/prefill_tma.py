"""Varlen prefill attention whose chunk keys come from the step's own K/V through TMA.

In a large eager step most keys a prompt attends are its own chunk's, and those
sit contiguous in the step's K/V (the projection's output, one row a token)
before they are scattered into the paged cache. This kernel reads them from
there with tensor descriptors (Hopper's bulk tensor copies, pipelined by
Triton), and only the cached prefix through the block table. The paged
kernel gathers every key row by row: at a served 8K-token step's shapes on an
H200 it ran 384 TFLOP/s against 519 for TMA loads of the same problem
(`benchmarks/prefill_headroom.py`).

A program owns BLOCK_Q query tokens of one sequence times the GQA group of
one KV head (BLOCK_M rows, as the paged kernel's). It folds, in order: the
cached prefix's whole key tiles (unmasked) and its last partial tile (masked)
from the cache; then the chunk's tiles before the diagonal (unmasked) and
those reaching it (causal mask) from the descriptors. Tiles that run past a
sequence's chunk into the next one's rows are masked by causality, and rows
past the tensor's end are zero-filled by the copy engine. No split-KV: the
path serves steps with query tiles enough to fill the GPU, a chunk of 2,048 tokens
or more (`mixed.TMA_MIN_LONGEST_CHUNK`: over short chunks the paged kernel wins),
and only those whose chunks' own keys carry a third of their attention or more
(`AttentionMetadata.fresh_key_share`): past that the prefix's gathers dominate,
and the paged kernel's own tiles do those better (3 x 1,000 new tokens after
7,000 cached: 350 against 379 TFLOP/s; 1 x 4,096 after 4,096, a share of a
third: 416 against 370).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import dot_precision, online_softmax_tile, score_tile, store_split
from kvserve.attention.kernels.prefill import LOG2E, _attend_before, _tile_rows


@dataclass(frozen=True)
class TmaPrefillConfig:
    # Fastest of nine on an H200 at 1x8192, 2x4096 and 8x1024 fresh prompts
    # (benchmarks/prefill_headroom.py): 32 tokens x 4 heads, 128-key tiles, 8 warps, 3 stages.
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # Keys a tile of the cached prefix, gathered row by row: 128 beat 64 and 32 at all four
    # chunk-after-prefix shapes timed (by 4-17% over 64).
    prefix_block_n: int = 128


def supports_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this launch can take the TMA path: a Hopper-or-later GPU, K/V in the cache's
    own dtype (the prefix and the chunk must be the same numbers), and descriptor-legal
    strides (unit last stride, others and the base 16-byte aligned)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype or kv_cache.element_size() != 2:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in (k, v))


@triton.jit
def _fold_fresh(q, k_desc, v_desc, row, kv_head, m_i, l_i, acc, qk_scale, tok, keys,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Fold one tile of the chunk's own keys (step rows [row, row + BLOCK_N)) into the
    online softmax; MASK: rows see only keys at or before their own token."""
    k = k_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK:
        s = tl.where(keys[None, :] <= tok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_prefix(q, k_cache_ptr, v_cache_ptr, prefix, table_row, stride_cache_block,
                   stride_cache_offset, kv_head_offset, m_i, l_i, acc, qk_scale,
                   BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The cached prefix [0, prefix), which every row sees: whole tiles unmasked, then
    the partial last tile with its keys past the prefix masked."""
    whole = prefix // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_before(q, k_cache_ptr, v_cache_ptr, 0, whole, table_row, stride_cache_block,
                                   stride_cache_offset, kv_head_offset, m_i, l_i, acc, qk_scale,
                                   BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION)
    if whole < prefix:
        key, key_valid, v_ptrs, s = score_tile(
            q, k_cache_ptr, v_cache_ptr, whole + tl.arange(0, BLOCK_N), prefix, 0, 0, table_row,
            stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale, HEAD_DIM, PAGE_SIZE,
            DOT_PRECISION)
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_tile(s, m_i, l_i, acc, v_ptrs, key_valid, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_table", "min_q_len"])
def _prefill_tma_kernel(
    q_ptr, k_desc, v_desc, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, qk_scale, min_q_len,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr,
    SKIP_SINGLE: tl.constexpr, HAS_PREFIX: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid (query tiles of the longest chunk, KV heads, sequences), the query tile counted
    # down: the programs of one (sequence, KV head) run side by side and share its keys in
    # L2, and a chunk's last tiles, which see the most keys, start first.
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    seq = tl.program_id(2)
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    idle = (q_tile * BLOCK_Q >= q_len) | (q_len < min_q_len)   # shorter queries: the paged kernel's
    if SKIP_SINGLE:  # one-query rows go to the decode kernel
        idle = idle | (q_len == 1)
    if idle:
        return
    kv_head = tl.program_id(1)
    prefix = tl.load(seq_lens_ptr + seq) - q_len
    tok, group_head, row_valid = _tile_rows(q_tile, q_len, GROUP, BLOCK_M)
    head = kv_head * GROUP + group_head
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if HAS_PREFIX:  # compiled out for steps without cached prefixes: its gather tiles cost registers
        m_i, l_i, acc = _attend_prefix(q, k_cache_ptr, v_cache_ptr, prefix,
                                       block_table_ptr + seq.to(tl.int64) * stride_table, stride_cache_block,
                                       stride_cache_offset, kv_head * stride_cache_head, m_i, l_i, acc,
                                       qk_scale, BLOCK_M, HEAD_DIM, PAGE_SIZE, PREFIX_BLOCK_N, DOT_PRECISION)
    first = q_tile * BLOCK_Q                 # chunk-relative, as `tok`
    diag = first // BLOCK_N * BLOCK_N
    for n in tl.range(0, diag, BLOCK_N):
        m_i, l_i, acc = _fold_fresh(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                                    n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    for n in tl.range(diag, tl.minimum(first + BLOCK_Q, q_len), BLOCK_N):
        m_i, l_i, acc = _fold_fresh(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                                    n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    token = (q_start + tok).to(tl.int64)
    store_split(out_ptr, out_ptr, out_ptr, m_i, l_i, acc, token, token, head, row_valid,
                0, 1, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, True)


def prefill_attention_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          out: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, max_query_len: int, scale: float,
                          config: TmaPrefillConfig = TmaPrefillConfig(),
                          single_queries: bool = True, cached_prefixes: bool = True,
                          from_length: int = 0) -> torch.Tensor:
    """Full (causal) attention of every sequence's queries over its cached prefix and its
    own chunk. q/out: [T, H, D]; k/v: [T, KVH, D], this step's new keys and values (also
    in the cache by now, where later steps read them); lengths as `prefill_attention`'s.
    `single_queries=False` leaves one-query sequences to the decode kernel, `from_length`
    the sequences with a shorter query to the paged kernel.
    `cached_prefixes=False` promises that no sequence it computes has one: the kernel is
    then built without the prefix loop, whose 128-key gather tiles otherwise slow the
    chunk's own loop too (H200, fresh prompts: 1 x 8,192 1,148 against 1,182 us; a
    served burst's ragged step 450 against 479)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [config.block_n, 1, head_dim]) for t in (k, v))
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _prefill_tma_kernel[(triton.cdiv(max_query_len, block_q), num_kv_heads, seq_lens.shape[0])](
        q, k_desc, v_desc, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
        scale * LOG2E, from_length, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=config.block_n, PREFIX_BLOCK_N=config.prefix_block_n,
        SKIP_SINGLE=not single_queries, HAS_PREFIX=cached_prefixes,
        DOT_PRECISION=dot_precision(kv_cache.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
    return out
