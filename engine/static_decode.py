"""Decode steps with static shapes, replayed as CUDA graphs on a GPU.

A decode-only step is padded to a bucket of batch sizes and of context lengths (in blocks), so that every tensor
has one of a few fixed shapes and lives at a fixed address. On CUDA each (batch, blocks) bucket is captured once as a
CUDA graph and replayed: one launch instead of hundreds of small kernels per step. On CPU the very same padded
computation runs eagerly; that is the twin the tests compare against the dynamic path.

Every bucket is built at load (`build_all`, largest first so that the graph memory pool is sized once by the largest),
before the server reports SERVING, as nano-vllm and vLLM do: a capture while serving would race the codec worker,
host copies and embedding lookups on other threads ("operation not permitted when stream is capturing") and fail
every request of that step. After `build_all` a bucket that was not built is refused, never captured.

The bucket list is bounded (`max_graph_blocks` blocks of context): longer decode steps run on the dynamic path.

Padded rows read and write a scratch block that the block pool never hands out, so they cannot touch real requests.

Host staging: the step's ids, positions, slots, context lengths and block tables are written into one persistent
host buffer (pinned on CUDA) laid out exactly like one device buffer, and moved with a single non-blocking copy (the
previous version built six small tensors and made five pageable copies per step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from omnivox.models.attention import AttentionMetadata, paged_block_mask
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)

# 256 blocks of 16 = 4096 tokens of context: 8 batch x 9 block buckets = 72 graphs for max_num_seqs=64.
DEFAULT_MAX_GRAPH_BLOCKS = 256


def _buckets(limit: int, small: Sequence[int] = (1, 2, 4, 8)) -> list[int]:
    sizes = [b for b in small if b < limit]
    b = 16
    while b < limit:
        sizes.append(b)
        b += 16 if b < 64 else 64
    return sizes + [limit]


def block_buckets(max_blocks: int, max_graph_blocks: int = DEFAULT_MAX_GRAPH_BLOCKS) -> list[int]:
    """Context buckets in blocks: powers of two up to min(max_blocks, max_graph_blocks), which is always the last."""
    top = max(1, min(max_blocks, max_graph_blocks))
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < top]
    return sizes + [top]


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
        max_graph_blocks: int = DEFAULT_MAX_GRAPH_BLOCKS,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batch_buckets = _buckets(max_batch)
        self.block_buckets = block_buckets(max_blocks, max_graph_blocks)
        width = self.block_buckets[-1]
        dev = kv_caches[0][0].device
        self.device = dev
        self.max_batch = max_batch
        # One flat long buffer: [ids | positions | slots | context lens | block tables (max_batch x width)].
        n = max_batch
        size = 4 * n + n * width
        self._host = torch.empty(size, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._staged = torch.empty(size, dtype=torch.long, device=dev)
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy (the host buffer is reused)
        self._host_views = self._split(self._host, n, width)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables = self._split(
            self._staged, n, width
        )
        self._fill_padding(self._host_views, 0, n)
        self._staged.copy_(self._host)
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self._capture_stream: torch.cuda.Stream | None = None  # warm-up and capture, on this decoder's device
        self.built: set[tuple[int, int]] = set()  # buckets built (captured on CUDA, run once eagerly elsewhere)
        self.frozen = False  # set by build_all: no bucket is built after load
        self.use_flex = False  # decode attention reads the cache in place (set by the runner before build_all)
        self.num_runs = 0  # decode steps served by this path

    @staticmethod
    def _split(flat: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, ...]:
        ids, pos, slots, lens = (flat[i * n : (i + 1) * n] for i in range(4))
        return ids, pos, slots, lens, flat[4 * n :].view(n, width)

    def _fill_padding(self, views: tuple[torch.Tensor, ...], start: int, end: int) -> None:
        """Rows [start, end) as padding: token 0 at position 0 reading and writing the scratch block."""
        ids, pos, slots, lens, table = views
        ids[start:end] = 0
        pos[start:end] = 0
        slots[start:end] = self.scratch_block * self.block_size
        lens[start:end] = 1
        table[start:end] = self.scratch_block

    def reset(self) -> None:
        """Forget every built bucket (the runner switched its decode attention before serving)."""
        self.graphs.clear()
        self.built.clear()
        self.graph_pool = None
        self.frozen = False

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch, blocks) bucket, largest first."""
        return [(b, k) for b in reversed(self.batch_buckets) for k in reversed(self._context_buckets())]

    def _context_buckets(self) -> list[int]:
        """The gathered path copies `blocks` blocks per row, so it wants a bucket near each context length; the flex
        path reads only each row's own blocks whatever the table's width: one width serves (8 graphs, not 72)."""
        return self.block_buckets[-1:] if self.use_flex else self.block_buckets

    def fits(self, batch: int, max_context: int) -> bool:
        return batch <= self.max_batch and -(-max_context // self.block_size) <= self.block_buckets[-1]

    def build_all(self) -> None:
        """Build every bucket now (at load), largest first; afterwards no bucket is ever captured again."""
        for batch, blocks in self.buckets():
            self._build(batch, blocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.frozen = True
        log.info(
            "decode buckets built: %d (%s), batch <= %d, context <= %d tokens",
            len(self.built),
            "CUDA graphs" if self.use_graphs else "eager",
            self.max_batch,
            self.block_buckets[-1] * self.block_size,
        )

    def _build(self, batch: int, blocks: int) -> None:
        key = (batch, blocks)
        if key in self.built:
            return
        if self.frozen:
            raise RuntimeError(f"decode bucket {key} was not built at load; capturing while serving is refused")
        if self.use_graphs:
            self.graphs[key] = self._capture(batch, blocks)
        else:
            with torch.inference_mode():
                self._forward(batch, blocks)  # the eager twin: the same shapes run once, writing only scratch
        self.built.add(key)

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
        if self.use_flex:  # padded to max_batch rows: every bucket shares the one compiled attention kernel
            n_blocks = self.kv_caches[0][0].shape[0] // self.block_size
            meta.decode_block_mask = paged_block_mask(
                meta.decode_block_tables, lens, self.block_size, n_blocks, self.max_batch
            )
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def stage(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> tuple[int, int]:
        """Write one step into the host buffer and copy it to the device in one go; returns its (batch, blocks)."""
        n = len(token_ids)
        bs = self.block_size
        batch = next(b for b in self.batch_buckets if b >= n)
        blocks = next(b for b in self._context_buckets() if b >= max(p // bs + 1 for p in positions))
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        ids, pos, slots, lens, table = self._host_views
        width = table.shape[1]
        rows = [bt[:width] + [self.scratch_block] * (width - len(bt[:width])) for bt in block_tables]
        table[:n] = torch.tensor(rows, dtype=torch.long)
        pos[:n] = torch.tensor(positions, dtype=torch.long)
        ids[:n] = torch.tensor(token_ids, dtype=torch.long)
        p = pos[:n]
        slots[:n] = table[:n].gather(1, (p // bs).unsqueeze(1)).squeeze(1) * bs + p % bs
        lens[:n] = p + 1
        self._fill_padding(self._host_views, n, batch)
        self._staged.copy_(self._host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return batch, blocks

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One decode token per request; returns logits [len(token_ids), vocab]."""
        n = len(token_ids)
        self.num_runs += 1
        batch, blocks = self.stage(token_ids, positions, block_tables)
        self._build(batch, blocks)  # a no-op after build_all; raises for a bucket it did not build
        if not self.use_graphs:
            return self._forward(batch, blocks)[:n]
        graph, out = self.graphs[(batch, blocks)]
        graph.replay()
        return out[:n]

    def _capture(self, batch: int, blocks: int):
        # Our own side stream: torch.cuda.graph's default capture stream is one per process, made on whichever device
        # was current at the first capture (a second model on another GPU would capture on the first one's stream).
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up kernels and the allocator outside the graph
                self._forward(batch, blocks)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a model loads (and captures) while the models loaded before it already serve; in the default
        # "global" mode their engine and encoder threads' allocations and syncs would invalidate this capture (and
        # fail their own step with "operation not permitted when stream is capturing"). This thread's calls are still
        # checked; the capture stream is a non-blocking one, so other threads' default-stream kernels do not join it.
        with (
            torch.inference_mode(),
            torch.cuda.graph(graph, pool=self.graph_pool, stream=stream, capture_error_mode="thread_local"),
        ):
            out = self._forward(batch, blocks)
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        log.debug("captured decode graph batch=%d blocks=%d", batch, blocks)
        return graph, out
