"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and a prefix cache of full blocks.

A full block is identified by a chained hash: hash(parent block's hash, its token ids, the content hashes of the
embedding segments it covers). Freed blocks keep their hash and content until they are reused, so a later request with
the same prefix finds them; reuse takes the least recently freed block first (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra: tuple = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(repr((tuple(token_ids), extra)).encode())
    return h.digest()


@dataclass(frozen=True)
class KVUsage:
    free_blocks: int  # blocks that can be handed out now (cached-but-unused blocks count as free)
    total_blocks: int
    block_size: int
    cached_blocks: int = 0  # blocks holding a prefix-cache entry (in use or free)


class BlockPool:
    """Hands out block ids. Invariant: a block is either referenced (ref_count > 0) or in the free queue.

    `null_block` (= num_blocks, one past the pool's ids) is the id that stands in a block table for a block released
    behind a sliding window: the runner's cache holds one block more than the pool (its scratch block), so the id is
    addressable, but the pool never hands it out, counts it, or caches it, and no attention ever reads its keys."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front = evict first
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self.null_block = num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its prefix-cache entry
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def acquire_cached(self, block_id: int) -> None:
        """Take a reference on a block found in the prefix cache (it may be sitting in the free queue)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record a full block in the prefix cache (first writer wins for duplicate content)."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Pass a request's table tail-first so that its last blocks,
        the least likely to be shared, are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def usage(self) -> KVUsage:
        return KVUsage(len(self.free), len(self.blocks), self.block_size, len(self.cached))

    def check_integrity(self) -> None:
        """Assert the pool's invariants (tests call this)."""
        for block in self.blocks:
            in_free = block.block_id in self.free
            assert (block.ref_count == 0) == in_free, f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h
