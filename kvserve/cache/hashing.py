"""Chained block hashes: the prefix-cache key of every full block.

Owns the hash function and the incremental extension of `Request.block_hashes`.
Block i's hash covers block i-1's hash, block i's token ids and the engine's
extra keys (model, LoRA, ...), so equal hashes imply equal prefixes up to a
128-bit collision. Hits never trust the hash alone: the pool also verifies
the stored parent hash, tokens and position (see `block_pool.BlockContent`).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from kvserve.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int],
               extra_keys: tuple = ()) -> bytes:
    """xxh3-128 over the parent hash, the int32-packed tokens and the extra keys."""
    # A fixed-width marker keeps "no parent" distinct from any 16-byte parent.
    # One-shot over the joined parts: the same digest as updating part by part.
    return xxhash.xxh3_128_digest(b"".join((parent if parent is not None else b"\x00root",
                                            array("i", token_ids).tobytes(),
                                            repr(extra_keys).encode())))


def extend_block_hashes(request: Request, block_size: int, extra_keys: tuple = ()) -> None:
    """Append hashes for the full blocks of `request.all_token_ids` not hashed yet."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = request.block_hashes
    num_full = request.num_known_tokens // block_size  # never a pending (unknown) token
    if len(hashes) >= num_full:
        return
    first = len(hashes)
    # Only the new blocks' tokens: all_token_ids would copy the whole sequence.
    token_ids = request.token_ids_between(first * block_size, num_full * block_size)
    for index in range(first, num_full):
        parent = hashes[-1] if hashes else None
        offset = (index - first) * block_size
        block_tokens = token_ids[offset:offset + block_size]
        hashes.append(hash_block(parent, block_tokens, extra_keys))
