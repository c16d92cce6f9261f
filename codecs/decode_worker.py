"""One asyncio task per codec that decodes the ready windows of every open stream together.

Producers (one per audio stream, on the event loop) push frames as the engine yields them; the worker wakes up,
plans the windows every stream can decode now, runs the next window of each stream through the codec in one batched
call in a worker thread (on a CPU: only the window whose stream's playback runs dry first), and hands each stream its chunks through an asyncio queue. While a codec pass runs, more
frames arrive; a stream whose frames got ahead of the codec keeps its later windows queued, so each pass delivers every
stream's earliest missing audio (taking a whole backlog in one pass held the first of it back until the last was
decoded: at 2 streams the playback ran dry seconds at RTF 0.8).
Stream state is planned and applied on the event loop only; the codec forward alone runs in the thread.

The thread is the worker's own (one pass at a time, never queued behind other `asyncio.to_thread` work), and on CUDA
it makes the codec's device its current one once, at its start, as the engine's and the encoders' threads do: with
`--device cuda:1` a thread would otherwise start on cuda:0. On a GPU the pass runs on the codec's own CUDA stream
and copies its audio to the host in that thread (codecs/codec_graphs.py): the event loop only sees CPU tensors.

Start-up: the worker measures how fast frames arrive per stream (the engine's pace at the current load) and how long
a codec pass takes per decoded frame, and sizes each new stream's first chunk and hop growth from them
(`codecs/startup.py`), so that playback started on the first chunk does not run dry. Until both are
measured, streams start with the decoder's options (first hop 1 frame, hops doubling).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from omnivox.codecs.startup import startup_options
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamDecoderState, StreamingOptions

log = logging.getLogger(__name__)

END = None  # put on a stream's queue after its last chunk


@dataclass
class AudioStream:
    """A stream's codec state and the queue its chunks (np.float32 arrays), then END or an exception, arrive on."""

    state: StreamDecoderState
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: bool = False
    codec_span: tuple[float, float] | None = None  # time.monotonic() of its first pass's start, last pass's end
    measured: bool = True  # its frame pace feeds the worker's rate (False: frames wait on outside input, e.g. text)
    last_push: float | None = None  # time.monotonic() of its last push that carried frames
    pending: deque = field(default_factory=deque)  # planned windows not yet decoded, in order
    opened_at: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None  # time.monotonic() when its first chunk was queued (playback starts)

    @property
    def decoding(self) -> bool:
        """Frames were pushed whose audio the codec has not queued yet: its planned windows and frames not decoded.
        Under load the codec, not the engine, is what a speech stream waits on (issue 33, mixed_load on 2 cores:
        over a 23.6 s round of two 9.8 s utterances the engine thread was runnable 8 s, the codec's 19 s)."""
        return not self.ended and self.state.num_frames * self.state.frame_samples > self.state.emitted_samples

    def deadline(self, sample_rate: int) -> float:
        """When its playback, started at the first chunk, would have played all it was given: its next chunk is
        due then (a stream without audio yet: due since it opened)."""
        if self.first_chunk_at is None:
            return self.opened_at
        return self.first_chunk_at + self.state.emitted_samples / sample_rate


@dataclass
class DecodeStats:
    passes: int = 0  # decode_windows calls
    windows: int = 0  # windows decoded
    max_batch: int = 0  # most windows in one call
    decode_seconds: float = 0.0  # wall time of the codec passes
    gen_s_per_frame: float | None = None  # EWMA: wall seconds between a stream's frames (the engine's pace)
    codec_s_per_frame: float | None = None  # EWMA: codec pass seconds per frame of its longest window, per window


RATE_EWMA = 0.2  # weight of a new sample in the measured rates


def thread_device(device: torch.device | str) -> torch.device:
    """The device a worker thread makes current: a CUDA device with its index (`torch.device("cuda")` is the
    current device of the thread that loaded the codec, and torch.cuda.set_device refuses a device without one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DecodeWorker:
    def __init__(
        self, decoder: BatchedStreamDecoder, sized_start: bool = True, device: torch.device | str | None = None
    ) -> None:
        """device: where the codec runs (default: the codec's own device); made current in the codec thread."""
        self.decoder = decoder
        self.sized_start = sized_start  # False: every stream starts with the decoder's options
        self.device = thread_device(device if device is not None else getattr(decoder.codec, "device", "cpu"))
        self._thread: ThreadPoolExecutor | None = None  # the codec passes' own thread, started with the first pass
        self.stats = DecodeStats()
        self._streams: dict[StreamDecoderState, AudioStream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # On a CPU a pass costs about the same per window (compute-bound), so batching windows saves nothing and
        # delays the most urgent one: one window a pass, earliest deadline first. On a GPU, one of each stream.
        self.one_window_per_pass = torch.device(getattr(decoder.codec, "device", "cpu")).type == "cpu"

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    def _codec_thread(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="omnivox-codec", initializer=self._thread_start)
        return self._thread

    def _thread_start(self) -> None:
        if self.device.type == "cuda":  # this thread's kernels, allocations and streams: on the codec's device
            torch.cuda.set_device(self.device)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="codec-decode-worker")

    def startup_options(self) -> StreamingOptions:
        """A new stream's options: first chunk and hop growth sized from the measured rates (the decoder's own
        options until both rates are measured)."""
        base, s = self.decoder.options, self.stats
        if not self.sized_start or s.gen_s_per_frame is None or s.codec_s_per_frame is None:
            return base
        frame_s = self.decoder.codec.frame_samples / self.decoder.sample_rate
        # A pass costs about the same per window (CPU: compute-bound), and the new stream's windows share the codec
        # with every open stream's and with one more that may open right after it (streams often arrive together: a
        # first stream sized for itself alone ran dry ~50 ms when a second opened next to it).
        codec_s = s.codec_s_per_frame * (len(self._streams) + 2)
        return startup_options(base, s.gen_s_per_frame, codec_s, frame_s)

    def open(self, options: StreamingOptions | None = None, measured: bool = True) -> AudioStream:
        """A new stream (call from the event loop); `options` None: sized from the measured rates. `measured`
        False for a stream whose frames wait on outside input (text streamed in): its pace is not the engine's."""
        self._ensure_running()
        stream = AudioStream(self.decoder.open_stream(options or self.startup_options()), measured=measured)
        self._streams[stream.state] = stream
        return stream

    @staticmethod
    def _ewma(old: float | None, sample: float) -> float:
        return sample if old is None else (1.0 - RATE_EWMA) * old + RATE_EWMA * sample

    def push(self, stream: AudioStream, frames: list[list[int]]) -> None:
        for frame in frames:
            stream.state.push_frame(frame)
        if frames and stream.measured:
            now = time.monotonic()
            if stream.last_push is not None:  # the first push comes after the prefill: not the pace
                pace = (now - stream.last_push) / len(frames)
                self.stats.gen_s_per_frame = self._ewma(self.stats.gen_s_per_frame, pace)
            stream.last_push = now
        if frames and self._wake is not None:
            self._wake.set()

    def finish(self, stream: AudioStream) -> None:
        """No more frames: the rest of the audio, then END, will arrive on the queue."""
        stream.state.finish()
        if self._wake is not None:
            self._wake.set()

    def flush(self, stream: AudioStream) -> None:
        """Decode and send every frame pushed so far without waiting for more (the stream stays open)."""
        stream.state.flush()
        if self._wake is not None:
            self._wake.set()

    def close(self, stream: AudioStream) -> None:
        """Forget the stream (finished or cancelled): its frames, tail and queue are dropped."""
        stream.state.close()
        self._streams.pop(stream.state, None)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._thread is not None:
            self._thread.shutdown(wait=False)  # a pass still running finishes there; nothing reads it
            self._thread = None
        for stream in list(self._streams.values()):
            self.close(stream)

    def _deliver_ends(self) -> None:
        for stream in list(self._streams.values()):
            if not stream.ended and stream.state.done:
                stream.ended = True
                stream.chunks.put_nowait(END)

    def _fail(self, streams: list[AudioStream], exc: BaseException) -> None:
        for stream in streams:
            if not stream.ended:
                stream.ended = True
                stream.chunks.put_nowait(exc)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                for state, stream in list(self._streams.items()):
                    stream.pending.extend(state.plan())
                # One window per stream a pass: a stream's next chunk is never held back behind its own later
                # windows (a backlog decoded in one pass arrived all at once, after the playback had run dry).
                ready = [stream for stream in self._streams.values() if stream.pending]
                if self.one_window_per_pass and ready:
                    ready = [min(ready, key=lambda st: st.deadline(self.sample_rate))]
                windows = [stream.pending.popleft() for stream in ready]
            except Exception as exc:  # a bug in planning fails the open streams, never leaves them waiting
                log.exception("codec window planning failed")
                self._fail(list(self._streams.values()), exc)
                continue
            if windows:
                involved = list({id(s): s for w in windows if (s := self._streams.get(w.stream))}.values())
                try:
                    started, mono = time.perf_counter(), time.monotonic()
                    loop = asyncio.get_running_loop()
                    audio = await loop.run_in_executor(self._codec_thread(), self.decoder.decode_windows, windows)
                    elapsed = time.perf_counter() - started
                    self.stats.decode_seconds += elapsed
                    longest = max(w.num_frames for w in windows)
                    per_frame = elapsed / (longest * len(windows))
                    self.stats.codec_s_per_frame = self._ewma(self.stats.codec_s_per_frame, per_frame)
                    for s in involved:
                        s.codec_span = (s.codec_span[0] if s.codec_span else mono, time.monotonic())
                    self.stats.passes += 1
                    self.stats.windows += len(windows)
                    self.stats.max_batch = max(self.stats.max_batch, len(windows))
                    for w, a in zip(windows, audio, strict=True):
                        stream = self._streams.get(w.stream)
                        if stream is None or stream.ended:  # closed while its window was decoding
                            continue
                        chunk: np.ndarray = w.stream.apply(w, a)
                        if len(chunk):
                            if stream.first_chunk_at is None:
                                stream.first_chunk_at = time.monotonic()
                            stream.chunks.put_nowait(chunk)
                except Exception as exc:  # a broken codec fails the streams it was decoding, not the server
                    log.exception("codec decode failed")
                    self._fail(involved, exc)
            if any(stream.pending for stream in self._streams.values()):
                self._wake.set()  # the backlog's next windows, without waiting for new frames
            self._deliver_ends()
