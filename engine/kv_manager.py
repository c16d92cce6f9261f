"""Maps requests onto the block pool: prefix-cache lookup at admission, growth as tokens are computed, freeing.

Sliding windows: when every layer of the model slides (Mistral; Qwen2 / Qwen3 with every layer marked
"sliding_attention"), a block whose tokens all lie before the next computed position's window is read by no layer
again. `allocate` releases such blocks first (as vLLM's SlidingWindowManager does), so a long generation holds about
window / block_size + 1 blocks instead of its whole context. Their block-table entries become the pool's `null_block`
(positions keep their index; every attention path starts reading at the window). A released block keeps its prefix-
cache entry until it is reused, like any freed block: its content is still exactly what its hash names; a prefix
hit needs only the blocks its next position's window reads. With some layers attending to everything (Qwen2 with
max_window_layers) every block stays, since those layers read them all.
"""

from __future__ import annotations

from omnivox.engine.block_pool import BlockPool, hash_block
from omnivox.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, sliding_window: int | None = None) -> None:
        """sliding_window: the window of a model whose every layer slides (None: blocks are held to the end)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.pool = pool
        self.block_size = pool.block_size
        self.sliding_window = sliding_window

    def _block_extra(self, req: Request, index: int) -> tuple:
        """Content hashes of the embedding segments that overlap block `index` (part of the block's identity); the
        first block also carries an encoder-decoder request's encoder input and the request's cache salt (every later
        hash chains from it, so the salt costs nothing past the first block; vLLM's `cache_salt` does the same)."""
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        extra = tuple((s.key, s.start - lo) for s in req.segments if s.start < hi and s.end > lo)
        if index == 0:
            if req.encoder_input is not None:
                extra += (("encoder", req.encoder_input.key),)
            if req.cache_salt:  # unsalted requests keep the hashes they always had
                extra += (("salt", req.cache_salt),)
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

        At least one token is always left to compute, since its logits are needed. Under a sliding window (every
        layer) a prefix of n blocks needs only the blocks the next position's window reads: earlier blocks may have
        been evicted since they were released (the entries become the null block), as vLLM's sliding-window hit
        search allows. A block's hash chains every token before it, so a hit anywhere means the same prefix."""
        assert not req.block_table
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        found = [self.pool.lookup(h) for h in req.block_hashes[:max_blocks]]
        n = run = 0  # n: blocks of the longest usable prefix; run: consecutive hits ending at block i
        for i, block_id in enumerate(found):
            run = run + 1 if block_id is not None else 0
            if self.sliding_window is None and not run:
                break
            if run and run >= i + 1 - self.skippable_blocks((i + 1) * self.block_size):
                n = i + 1
        skip = self.skippable_blocks(n * self.block_size)
        hits = [b for b in found[skip:n] if b is not None]
        assert len(hits) == n - skip
        for block_id in hits:
            self.pool.acquire_cached(block_id)
        req.block_table = [self.pool.null_block] * skip + hits
        req.num_registered_blocks = n
        req.num_skipped_blocks = skip
        return n * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def skippable_blocks(self, num_computed: int) -> int:
        """Leading blocks no layer reads again once positions from num_computed on are computed (0 without a
        window): the next query, at num_computed, sees keys from num_computed - window + 1 on."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def free_behind_window(self, req: Request) -> None:
        """Release the blocks behind the sliding window of the request's next computed position (tail-first, as
        `BlockPool.release` asks); their entries become the null block. They leave the cache least recently released
        first, so a follow-up turn finds the last ones (what `match_prefix` needs under a window)."""
        skip = min(self.skippable_blocks(req.num_computed_tokens), len(req.block_table))
        if skip <= req.num_skipped_blocks:
            return
        released = req.block_table[req.num_skipped_blocks : skip]
        self.pool.release(list(reversed(released)))
        req.block_table[req.num_skipped_blocks : skip] = [self.pool.null_block] * len(released)
        req.num_skipped_blocks = skip

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold num_new_tokens more, after releasing the blocks behind a sliding window
        (which never changes what the request computes); False (the table not grown) when the pool is short."""
        self.free_behind_window(req)
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
        assert self.skippable_blocks(num_computed) >= req.num_skipped_blocks, "rollback behind released blocks"
        req.num_computed_tokens = num_computed
        keep = -(-num_computed // self.block_size)
        if len(req.block_table) > keep:
            self.pool.release(list(reversed(req.block_table[keep:])))
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        self.pool.release(list(reversed(req.block_table[req.num_skipped_blocks :])))
        req.block_table = []
        req.num_skipped_blocks = 0
        req.num_registered_blocks = 0  # block_hashes stay valid: a recompute sees the same tokens
