"""The torch reference attention backend: paged KV write + masked SDPA.

Owns the portable (any device, any dtype) implementation of the backend
protocol. It is vectorised over the batch: each sequence's keys are gathered
through its block table into one padded tensor, queries are padded the same
way, and a boolean mask built from positions and the layer's spec (causal,
sliding window, sink, padding) goes to `scaled_dot_product_attention`. It is
the correctness oracle for faster backends and the CPU benchmark path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionLayerInfo, register_backend
from kvserve.attention.metadata import AttentionMetadata


# Slot 0 of the null block 0: never allocated, never written, zero from the
# runner's zero-initialised cache. Invisible keys are gathered from here.
ZERO_SLOT = 0


@register_backend("torch")
class TorchReferenceBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, layer: AttentionLayerInfo,
                meta: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mappings[layer.group_id])
        mask, slots, seq_idx, q_idx = _batch_layout(layer, meta, kv_cache.shape[2], q.dtype)
        # One gather through flat slots; keys no query may see (NULL blocks, past
        # the sequence end: garbage, maybe NaN, which would poison SDPA even when
        # masked) read slot 0 of the null block instead, which stays zero.
        keys, values = _gather(kv_cache[0], slots), _gather(kv_cache[1], slots)
        q_pad = _pad_queries(q, meta, seq_idx, q_idx)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None], scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        out = out.transpose(1, 2)  # [B, Q, H, D]
        if meta.is_decode_only:
            return out[:, 0]
        return out[seq_idx, q_idx]


def _batch_layout(layer: AttentionLayerInfo, meta: AttentionMetadata, block_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask, gather slots and token coordinates: the same for every layer of a
    group, so computed once per batch and kept in `meta.scratch`."""
    key = ("torch_ref", layer.group_id, layer.spec)
    if key not in meta.scratch:
        num_keys = -(-meta.max_seq_len // block_size) * block_size
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        mask = build_mask(layer, meta.seq_lens, query_lens, meta.max_query_len, num_keys)
        key_visible = mask.any(dim=1)
        slots = gather_slots(meta.block_tables[layer.group_id], block_size, num_keys)
        slots = torch.where(key_visible, slots, ZERO_SLOT)
        mask = _open_padding_rows(mask, key_visible, query_lens)
        # An additive mask takes a faster SDPA path on CPU than a boolean one.
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        seq_idx, q_idx = _token_coordinates(meta, query_lens)
        meta.scratch[key] = (mask, slots, seq_idx, q_idx)
    return meta.scratch[key]


def gather_slots(block_table: torch.Tensor, block_size: int, num_keys: int) -> torch.Tensor:
    """[B, num_keys] flat cache slot of each key position."""
    num_blocks = num_keys // block_size
    if block_table.shape[1] < num_blocks:
        raise ValueError(f"block_table has {block_table.shape[1]} columns but {num_keys} keys "
                         f"need {num_blocks} blocks of {block_size}")
    pos = torch.arange(num_keys, device=block_table.device)
    return block_table[:, :num_blocks].long()[:, pos // block_size] * block_size + pos % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, L, KVH, D] from one half of the cache; index_select is ~2x faster
    than advanced indexing on CPU."""
    flat = cache.view(-1, *cache.shape[-2:])
    return torch.index_select(flat, 0, slots.view(-1)).view(*slots.shape, *cache.shape[-2:])


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's k/v at its flat slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    slot_mapping = slot_mapping.long()  # index_copy_ takes int64 only
    key_cache.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def build_mask(layer: AttentionLayerInfo, seq_lens: torch.Tensor,
               query_lens: torch.Tensor, max_query_len: int,
               num_keys: int) -> torch.Tensor:
    """[B, max_query_len, num_keys] bool: True where a query may see a key."""
    device = seq_lens.device
    seq_lens = seq_lens.long()[:, None, None]
    query_lens = query_lens.long()[:, None, None]
    q_offsets = torch.arange(max_query_len, device=device)[None, :, None]
    query_pos = seq_lens - query_lens + q_offsets
    key_pos = torch.arange(num_keys, device=device)[None, None, :]
    # Padding rows (q_offsets >= query_len) get query_pos >= seq_len: the
    # causal test then only admits keys past the sequence for them; they are
    # cleared below and reopened by _open_padding_rows.
    is_real_row = q_offsets < query_lens
    mask = (key_pos <= query_pos) & is_real_row
    # Duck-typed so a new spec with a window needs no change here.
    window = getattr(layer.spec, "window", None)
    if window is not None:
        mask &= (query_pos - key_pos < window) | (key_pos < layer.spec.sink)
    return mask


def _open_padding_rows(mask: torch.Tensor, key_visible: torch.Tensor,
                       query_lens: torch.Tensor) -> torch.Tensor:
    """Let padded query rows see the sequence's finite keys so SDPA's softmax
    stays finite there; their outputs are dropped when unpadding."""
    q_offsets = torch.arange(mask.shape[1], device=mask.device)[None, :, None]
    is_padding_row = q_offsets >= query_lens.long()[:, None, None]
    return mask | (is_padding_row & key_visible[:, None, :])


def _token_coordinates(meta: AttentionMetadata, query_lens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index within the sequence's queries) for each token."""
    device = query_lens.device
    seq_idx = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), query_lens.long(),
        output_size=meta.num_tokens)
    q_idx = torch.arange(meta.num_tokens, device=device) - meta.query_start_loc[seq_idx].long()
    return seq_idx, q_idx


def _pad_queries(q: torch.Tensor, meta: AttentionMetadata, seq_idx: torch.Tensor,
                 q_idx: torch.Tensor) -> torch.Tensor:
    if meta.is_decode_only:
        return q[:, None]
    q_pad = q.new_zeros(meta.num_seqs, meta.max_query_len, *q.shape[1:])
    q_pad[seq_idx, q_idx] = q
    return q_pad
