"""Maps requests onto the block pool: prefix-cache lookup at admission, growth as tokens are computed, freeing."""

from __future__ import annotations

from omnivox.engine.block_pool import BlockPool, hash_block
from omnivox.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def _block_extra(self, req: Request, index: int) -> tuple:
        """Content hashes of the embedding segments that overlap block `index` (part of the block's identity); the
        first block also carries an encoder-decoder request's encoder input (every later hash chains from it)."""
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        extra = tuple((s.key, s.start - lo) for s in req.segments if s.start < hi and s.end > lo)
        if index == 0 and req.encoder_input is not None:
            extra += (("encoder", req.encoder_input.key),)
        return extra

    def _hash_of(self, req: Request, index: int) -> bytes:
        parent = req.block_hashes[index - 1] if index else None
        lo = index * self.block_size
        return hash_block(parent, req.token_slice(lo, lo + self.block_size), self._block_extra(req, index))

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        while len(req.block_hashes) < num_full_blocks:
            req.block_hashes.append(self._hash_of(req, len(req.block_hashes)))

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the request's longest cached prefix; returns the number of tokens they hold.

        At least one token is always left to compute, since its logits are needed.
        """
        assert not req.block_table
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits = []
        for h in req.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        for block_id in hits:
            self.pool.acquire_cached(block_id)
        req.block_table = hits
        req.num_registered_blocks = len(hits)
        return len(hits) * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold num_new_tokens more; False (nothing changed) when the pool is short."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            req.block_table.extend(self.pool.allocate(need))
        return True

    def commit_computed(self, req: Request) -> None:
        """Register the request's newly full blocks in the prefix cache after a step computed them.

        Only committed tokens count (`num_computed_tokens` never covers drafts after verification), so a block that
        holds a draft's K/V is never hashed."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        self._extend_hashes(req, full)
        for i in range(req.num_registered_blocks, full):
            self.pool.register(req.block_table[i], req.block_hashes[i])
        req.num_registered_blocks = full

    def rollback(self, req: Request, num_computed: int) -> None:
        """Take the request's computed length back to num_computed (rejected drafts), freeing blocks past it."""
        assert 0 <= num_computed <= req.num_tokens, "rollback past the committed tokens"
        assert num_computed >= req.num_registered_blocks * self.block_size, "rollback into prefix-cached blocks"
        req.num_computed_tokens = num_computed
        keep = -(-num_computed // self.block_size)
        if len(req.block_table) > keep:
            self.pool.release(list(reversed(req.block_table[keep:])))
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        self.pool.release(list(reversed(req.block_table)))
        req.block_table = []
        req.num_registered_blocks = 0  # block_hashes stay valid: a recompute sees the same tokens
