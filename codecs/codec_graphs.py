"""Codec passes with fixed shapes, on the codec's own CUDA stream, replayed as CUDA graphs on a GPU.

A codec pass decodes a batch of windows of equal length (codecs/streaming.py). Here the batch is padded to a bucket of
batch sizes and the windows to a bucket of frame counts (the streaming decoder pads windows with context that cannot
change their audio, see `BatchedStreamDecoder.decode_windows`; padded batch rows are dummies whose audio is dropped),
so that every pass has one of a few shapes. On CUDA each (batch, frames) bucket is captured once as a CUDA graph and
replayed: one launch instead of the decoder's ~300 small kernels per pass. On CPU the very same padded computation
runs eagerly: the twin the tests compare with the dynamic decode.

Every bucket is built at load (`build_all`, largest first so that the graph memory pool is sized once by the
largest), before the server reports SERVING, as engine/static_decode.py does for decode steps and as nano-vllm and
vLLM capture theirs: a capture while serving would race the engine's kernels on other threads. A shape with no bucket
takes the dynamic path (`SnacDecoder.decode_unchecked` on the same stream); nothing is captured after `build_all`.

The codec's work runs on its own CUDA stream, so that it overlaps the engine's decode steps on the default stream
instead of queueing behind them, and the device-to-host copy of the audio happens on that stream, into pinned host
memory, in the codec worker's thread (`to_host`): the event loop only ever sees CPU tensors and never waits on the
GPU (a `.cpu()` on the event loop would block every stream's writes for the length of a codec pass).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from omnivox.codecs.snac import SnacDecoder

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)


def frame_buckets_for(window_frames: int, smallest: int = 4) -> tuple[int, ...]:
    """Frame buckets for a streaming decoder whose steady-state window is `window_frames`: multiples of 4 up to it
    (the start-up windows grow from a few frames) and the steady window itself, where most passes land."""
    return tuple(sorted({*range(smallest, window_frames, 4), window_frames}))


class _Bucket:
    """The static tensors of one (batch, frames) shape, and its CUDA graph when captured."""

    def __init__(self, batch: int, frames: int, codes_per_frame: int, frame_samples: int, device: torch.device):
        self.batch, self.frames = batch, frames
        self.frames_in = torch.zeros(batch, frames, codes_per_frame, dtype=torch.int64, device=device)  # (B x T x 7)
        self.starts_in = torch.zeros(batch, dtype=torch.int64, device=device)  # (B,) first frame of each row
        self.audio_out: torch.Tensor | None = None  # (B x T*frame_samples), written by the pass
        self.graph: torch.cuda.CUDAGraph | None = None
        self.samples = frames * frame_samples


class StaticCodec:
    """Fixed-shape codec passes over a `SnacDecoder` (see the module docstring). Thread-safe through the decoder's
    lock for the dynamic path; `decode` itself runs in the codec worker's thread, one pass at a time."""

    def __init__(
        self,
        codec: SnacDecoder,
        frame_levels: Sequence[Sequence[int]],
        frame_buckets: Sequence[int],
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        use_graphs: bool | None = None,
    ) -> None:
        self.codec = codec
        self.device = codec.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the codec on a CUDA device")
        self.frame_buckets = tuple(sorted(set(int(t) for t in frame_buckets)))
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.codes_per_frame = codec.shape.codes_per_frame
        # frames -> codes per level without Python lists in the pass (an index built from a list is a host copy,
        # not allowed while capturing): (B x T x 7) -index_select-> (B x T x n_i) -> (B x T*n_i).
        self._level_index = [torch.tensor(list(p), dtype=torch.int64, device=self.device) for p in frame_levels]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self.built = False

    # --- shapes ---
    def frame_bucket(self, frames: int) -> int | None:
        """The smallest frame bucket that holds `frames`, or None (longer than every bucket)."""
        return next((t for t in self.frame_buckets if t >= frames), None)

    def batch_bucket(self, batch: int) -> int | None:
        return next((b for b in self.batch_buckets if b >= batch), None)

    def stream_context(self) -> contextlib.AbstractContextManager:
        """Run on the codec's own CUDA stream (nothing on CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    # --- the pass ---
    def _forward(self, frames: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """frames (B x T x 7) int64, starts (B,) int64, both on the device -> audio (B x T*frame_samples)."""
        batch, count = frames.shape[0], frames.shape[1]
        codes = [frames.index_select(2, idx).reshape(batch, count * idx.numel()) for idx in self._level_index]
        return self.codec.decode_unchecked(codes, starts * self.codec.shape.latent_steps_per_frame)

    def build_all(self) -> None:
        """Build every bucket, largest first; on CUDA, warm each up once and capture it as a CUDA graph."""
        shapes = sorted(((b, t) for b in self.batch_buckets for t in self.frame_buckets), reverse=True)
        frame_samples = self.codec.frame_samples
        with self.stream_context(), torch.inference_mode():
            for b, t in shapes:
                bucket = _Bucket(b, t, self.codes_per_frame, frame_samples, self.device)
                if self.use_graphs:
                    self._forward(bucket.frames_in, bucket.starts_in)  # warm-up: allocator, kernels chosen
                    torch.cuda.current_stream().synchronize()
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: another model loading on another thread must not break this capture.
                    with torch.cuda.graph(
                        graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"
                    ):
                        bucket.audio_out = self._forward(bucket.frames_in, bucket.starts_in)
                    self._pool = graph.pool()  # every later (smaller) bucket shares the largest one's pool
                    bucket.graph = graph
                self._buckets[(b, t)] = bucket
            if self.stream is not None:
                self.stream.synchronize()
        self.built = True
        log.info("codec: %d (batch, frames) buckets built%s", len(shapes), " as CUDA graphs" if self.use_graphs else "")

    def has_bucket(self, batch: int, frames: int) -> bool:
        b = self.batch_bucket(batch)
        return self.built and b is not None and (b, frames) in self._buckets

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """frames (B x T x 7) int64 codes (valid: the streams checked them), starts (B,) -> audio (B x T*F) on the
        device. T must be a frame bucket and B at most the largest batch bucket (`has_bucket`); the caller runs this
        inside `stream_context()`."""
        batch, count = frames.shape[0], frames.shape[1]
        b = self.batch_bucket(batch)
        bucket = self._buckets.get((b, count)) if b is not None else None
        if bucket is None:
            raise RuntimeError(f"no codec bucket for batch {batch} x {count} frames (buckets are built at load)")
        bucket.frames_in[:batch].copy_(frames, non_blocking=True)
        bucket.starts_in[:batch].copy_(starts, non_blocking=True)
        if batch < b:  # dummy rows: any valid codes; their audio is dropped
            bucket.frames_in[batch:].zero_()
            bucket.starts_in[batch:].zero_()
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.audio_out is not None
            out = bucket.audio_out
        else:  # the eager twin: the same padded computation, on CPU (or CUDA without graphs)
            out = self._forward(bucket.frames_in, bucket.starts_in)
        return out[:batch]  # a view of the static output: copy it (to_host) before the next pass

    def to_host(self, audio: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Audio tensors of one pass -> CPU float32 tensors: on CUDA, one copy on the codec stream into pinned host
        memory, waited for here (the worker thread), not on the event loop."""
        if self.device.type != "cuda":
            return [a.float() for a in audio]
        lengths = [a.numel() for a in audio]
        flat = torch.cat([a.reshape(-1).float() for a in audio])
        host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the codec stream, inside stream_context()
        return list(host.split(lengths))
