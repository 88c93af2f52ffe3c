"""Triton kernels of the paged-KV attention backend.

`cache_write` stores a step's new K/V by slot mapping; `prefill` computes
varlen (chunked) prefill attention over the paged cache; `decode` computes
one-query-per-sequence attention with split-KV plus a reduce; `mixed` gives
a mixed batch's one-query rows to the decode kernel and the rest to the
varlen one; `prefill_tma` is the varlen kernel of large eager steps, reading
the chunk's own keys from the step's K/V through TMA. All of them index
the cache [2, num_blocks, block_size, num_kv_heads, head_dim] through block
tables and never read a key no query can see (so NULL blocks stay unread).
"""
from kvserve.attention.kernels.cache_write import reshape_and_cache
from kvserve.attention.kernels.decode import DecodeConfig, decode_attention
from kvserve.attention.kernels.mixed import mixed_attention
from kvserve.attention.kernels.prefill import PrefillConfig, prefill_attention

__all__ = ["reshape_and_cache", "decode_attention", "DecodeConfig",
           "prefill_attention", "PrefillConfig", "mixed_attention"]
