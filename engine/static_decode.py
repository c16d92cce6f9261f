"""Decode steps with static shapes, replayed as CUDA graphs on a GPU.

A decode-only step is padded to a bucket of batch sizes and of context lengths (in blocks), so that every tensor
has one of a few fixed shapes and lives at a fixed address. On CUDA each (batch, blocks) bucket is captured once as a
CUDA graph and replayed: one launch instead of hundreds of small kernels per step. On CPU the very same padded
computation runs eagerly; that is the twin the tests compare against the dynamic path.

Padded rows read and write a scratch block that the block pool never hands out, so they cannot touch real requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from omnivox.models.attention import AttentionMetadata
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)


def _buckets(limit: int, small: Sequence[int] = (1, 2, 4, 8)) -> list[int]:
    sizes = [b for b in small if b < limit]
    b = 16
    while b < limit:
        sizes.append(b)
        b += 16 if b < 64 else 64
    return sizes + [limit]


class StaticDecoder:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batch_buckets = _buckets(max_batch)
        self.block_buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < max_blocks]
        self.block_buckets.append(max_blocks)
        dev = kv_caches[0][0].device
        self.device = dev
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.long, device=dev)
        self.block_tables = torch.full((max_batch, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self.max_batch = max_batch
        self.num_runs = 0  # decode steps served by this path

    def fits(self, batch: int, max_context: int) -> bool:
        return batch <= self.max_batch and -(-max_context // self.block_size) <= self.block_buckets[-1]

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The padded decode step over the static buffers: logits [batch, vocab]."""
        span = blocks * self.block_size
        lens = self.context_lens[:batch]
        mask = (torch.arange(span, device=self.device)[None, :] < lens[:, None]).view(batch, 1, 1, span)
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:batch],
            num_decode=batch,
            decode_block_tables=self.block_tables[:batch, :blocks],
            decode_mask=mask,
            decode_lens=lens,
            prefills=[],
        )
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One decode token per request; returns logits [len(token_ids), vocab]."""
        n = len(token_ids)
        bs = self.block_size
        self.num_runs += 1
        batch = next(b for b in self.batch_buckets if b >= n)
        need = max(-(-(p + 1) // bs) for p in positions)
        blocks = next(b for b in self.block_buckets if b >= need)
        scratch = self.scratch_block
        # Host-side staging, one copy per buffer.
        table = torch.full((batch, blocks), scratch, dtype=torch.long)
        for i, bt in enumerate(block_tables):
            k = min(len(bt), blocks)
            table[i, :k] = torch.tensor(bt[:k])
        pos = torch.zeros(batch, dtype=torch.long)
        pos[:n] = torch.tensor(positions)
        ids = torch.zeros(batch, dtype=torch.long)
        ids[:n] = torch.tensor(token_ids)
        slot = torch.full((batch,), scratch * bs, dtype=torch.long)
        slot[:n] = table[torch.arange(n), pos[:n] // bs] * bs + pos[:n] % bs
        lens = torch.ones(batch, dtype=torch.long)
        lens[:n] = pos[:n] + 1
        self.block_tables[:batch, :blocks].copy_(table, non_blocking=True)
        self.input_ids[:batch].copy_(ids, non_blocking=True)
        self.positions[:batch].copy_(pos, non_blocking=True)
        self.slot_mapping[:batch].copy_(slot, non_blocking=True)
        self.context_lens[:batch].copy_(lens, non_blocking=True)
        if not self.use_graphs:
            return self._forward(batch, blocks)[:n]
        key = (batch, blocks)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, blocks)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _capture(self, batch: int, blocks: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and the allocator outside the graph
                self._forward(batch, blocks)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._forward(batch, blocks)
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        log.debug("captured decode graph batch=%d blocks=%d", batch, blocks)
        return graph, out
