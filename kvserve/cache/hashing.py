"""Chained block hashes: the prefix-cache key of every full block.

Owns the hash function, the incremental extension of `Request.block_hashes`,
and the `BlockContent` a cached block is verified against (built from the
same token slice as its hash). Block i's hash covers block i-1's hash and
block i's token ids, so equal hashes imply equal prefixes up to a 128-bit
collision. Hits never trust the hash alone: the pool also verifies the
stored parent hash, tokens and position (see `block_pool.BlockContent`). A
request's `cache_salt` is block 0's parent (`salt_root`): its chain, and so
its hits, are shared only with requests of the same salt.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import xxhash

from kvserve.cache.block_pool import BlockContent

if TYPE_CHECKING:
    from kvserve.request import Request

# BlockContent._make without its Python frame: one is built per block cached.
_new_content = partial(tuple.__new__, BlockContent)


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """xxh3-128 over the parent hash and the int32-packed tokens."""
    # A fixed-width marker keeps "no parent" distinct from any 16-byte parent.
    # One-shot over the joined parts: the same digest as updating part by part.
    return xxhash.xxh3_128_digest(b"".join((parent if parent is not None else b"\x00root",
                                            _int32s(len(token_ids)).pack(*token_ids))))


@lru_cache(maxsize=64)
def _int32s(n: int) -> struct.Struct:
    """Packs n ints as native int32 (array("i")'s bytes, at a third of its cost)."""
    return struct.Struct(f"{n}i")


def salt_root(salt: str | None) -> bytes | None:
    """Block 0's parent in a chain: None without a salt, else 16 bytes of the salt
    (hashed behind its own marker, so it is no block's hash in practice)."""
    return None if salt is None else xxhash.xxh3_128_digest(b"\x00salt" + salt.encode())


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append hashes for the full blocks of `request.all_token_ids` not hashed yet."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = request.block_hashes
    num_full = request.num_known_tokens // block_size  # never a pending (unknown) token
    first = len(hashes)
    if first >= num_full:
        return
    # Only the new blocks' tokens: all_token_ids would copy the whole sequence.
    token_ids = request.token_ids_between(first * block_size, num_full * block_size)
    _append_hashes(hashes, token_ids, first, num_full, block_size, request.cache_salt)


def _append_hashes(hashes: list[bytes], token_ids: Sequence[int], first: int, end: int, block_size: int,
                   salt: str | None = None) -> None:
    """Chain the hashes of blocks [len(hashes), end) onto `hashes` (`token_ids`
    start at block `first`): the one walk behind every block hash."""
    root = salt_root(salt) if not hashes else None
    for index in range(len(hashes), end):
        offset = (index - first) * block_size
        hashes.append(hash_block(hashes[-1] if index else root, token_ids[offset:offset + block_size]))


def block_contents(request: Request, first: int, end: int, block_size: int) -> list[BlockContent]:
    """What blocks [first, end) of the request hold (full of known tokens),
    hashing those past `request.block_hashes` on the way: one token slice
    serves both (a decode step fills a block every block_size steps)."""
    hashes = request.block_hashes
    if first > len(hashes):
        raise ValueError(f"block {first} follows {len(hashes)} hashed blocks: its parent hash is unknown")
    token_ids = request.token_ids_between(first * block_size, end * block_size)
    _append_hashes(hashes, token_ids, first, end, block_size, request.cache_salt)
    return [block_content(hashes, token_ids, index, block_size, first) for index in range(first, end)]


def block_content(block_hashes: Sequence[bytes], token_ids: Sequence[int], index: int, block_size: int,
                  first: int = 0) -> BlockContent:
    """What block `index` of a request must hold for a hit to be correct
    (`token_ids` start at block `first`): what a lookup verifies and what
    caching a block stores."""
    parent = block_hashes[index - 1] if index > 0 else None
    offset = (index - first) * block_size
    return _new_content((parent, tuple(token_ids[offset:offset + block_size]), index))
