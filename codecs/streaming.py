"""Streaming codec decoding: frames in as they are generated, audio chunks out, no clicks at the joins.

Each chunk comes from decoding a window of frames that reaches `left_context_frames` before the audio it emits and
`lookahead_frames` after it. Consecutive windows overlap by `crossfade_samples`, which the first window holds back and
the next one fades in (linear overlap-add; the fades sum to one).

How much context is enough: the SNAC 24 kHz decoder is convolutional (no attention), and its receptive field reaches
about 2.5 frames either side (first conv +-3 latent steps, then each block's transposed conv and residual units with
dilations 1, 3, 9: 3 + 5.9 + 0.7 + 0.2 + 0.1 ~ 9.9 latent steps of 4 per frame), but its outermost taps weigh almost
nothing: with two frames of context a window reproduces the whole-sequence decode to ~5e-8 (tests/test_codec_streaming,
random weights), with one frame to ~4e-6. The default is one frame each side: on the full-size random 24 kHz decoder
the streamed audio stays 3.5e-6 from the float32 one-shot decode (tests/codecs/test_codec_snac_fast.py holds it under 1e-5)
and windows of 1 + 16 + 1 frames instead of 2 + 16 + 2 took 10-20 % less codec time per audio second at 2 streams
(/tmp A/B in one process, load ~4.7: best of 3, 0.446 vs 0.559 s); the crossfade hides the small mismatch at joins.

Timeline (frames of F samples, O = crossfade_samples <= left_context F); chunk k ends at frame boundary b_k.
Chunks grow: b_0 = first_hop, then hops double up to hop_frames (1, 2, 4, 8, 8, ... frames), so that the first audio
leaves early and each later chunk has time to be generated while the previous ones play.

    window k decodes frames [ b_{k-1} - left_context , b_k + lookahead )
    emits samples          [ b_{k-1}F - O , b_k F - O )   (its first O samples crossfaded with window k-1's tail)
    holds back the tail    [ b_k F - O , b_k F )

After `finish()`, one last window emits everything that is left. `flush()` does the same without ending the stream:
a stream whose frames pause for outside input (text streamed in, a clause spoken and the next not yet written) emits
its held-back audio now instead of when the next frames come; the frames after a flush start a new run of windows
(left context from the frames before, no crossfade into the flushed tail, which went out whole), their hops growing
from the first one again (the listener has played everything it had).

Windows of all streams that are ready at the same time are decoded in one codec forward pass
(`BatchedStreamDecoder.decode_windows`). They need not have the same length (chunks grow, streams are at different
stages), so shorter windows are brought to the longest one's length with context beyond PAD_CONTEXT_FRAMES: more real
frames before the window (each window carries some history), or, for a window that is not its stream's last, copies of
its last frame after it. Padding is used only on a side where the window already has PAD_CONTEXT_FRAMES of context,
so it changes the emitted audio no more than that much context leaves (~4e-6 with one frame, rounding level with
two); a window that can be padded neither way gets its own pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnivox.codecs.snac import SnacDecoder

if TYPE_CHECKING:
    from omnivox.codecs.codec_graphs import StaticCodec


@dataclass(frozen=True)
class StreamingOptions:
    """Window and hop of the streaming decoder: smaller = earlier first audio, larger = fewer codec passes."""

    first_hop_frames: int = 1  # frames of audio in the first chunk (first audio after first_hop + lookahead frames)
    hop_frames: int = 16  # frames per chunk once the hops, doubling from first_hop_frames, reach it (16, not 8:
    # with two frames of context, windows of 2 + 16 + 2 frames decoded 1.25x the audio instead of 1.5x, 20 % less codec
    # time per audio second (benchmarks/codec.py); with one, 1 + 16 + 1 decode 1.125x; the hops double from the first)
    left_context_frames: int = 1  # frames decoded before the emitted audio (re-decoded, not emitted again)
    lookahead_frames: int = 1  # frames decoded after the emitted audio (waited for before emitting)
    crossfade_samples: int = 256  # overlap-add length at each join
    hop_growth: float = 2.0  # each hop is the first one times growth^index (rounded down), up to hop_frames

    def validate(self, frame_samples: int) -> None:
        for name in ("first_hop_frames", "hop_frames"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.hop_growth >= 1.0:
            raise ValueError(f"hop_growth must be >= 1, got {self.hop_growth!r}")
        for name in ("left_context_frames", "lookahead_frames", "crossfade_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        limit = min(self.first_hop_frames, self.hop_frames, self.left_context_frames) * frame_samples
        if self.crossfade_samples > limit:
            raise ValueError(
                f"crossfade_samples {self.crossfade_samples} exceeds {limit}: the crossfade must fit in the shortest "
                f"hop and in the left context ({frame_samples} samples per frame)"
            )

    def hop(self, index: int) -> int:
        """Frames of audio in chunk `index` (before the final one): first_hop, growing (doubling by default) up to
        hop_frames."""
        if self.hop_growth == 2.0:
            return max(1, min(self.hop_frames, self.first_hop_frames << min(index, 30)))
        return max(1, min(self.hop_frames, int(self.first_hop_frames * self.hop_growth ** min(index, 60))))

    def window_frames(self) -> int:
        """Frames in a steady-state window."""
        return self.left_context_frames + self.hop_frames + self.lookahead_frames


PAD_CONTEXT_FRAMES = 1  # real context beyond which other frames change a window's audio by ~4e-6 at most


@dataclass(frozen=True)
class DecodeWindow:
    """One codec pass for one stream: decode frames [start_frame, end_frame), emit [emit_start, emit_end) samples and
    hold back [emit_end, tail_end) for the next window's crossfade. Sample indices are absolute (stream timeline)."""

    stream: StreamDecoderState
    index: int  # 0, 1, 2 ... per stream; windows are applied in this order
    frames: torch.Tensor  # (end_frame - start_frame x codes_per_frame)
    start_frame: int
    end_frame: int
    emit_start: int
    emit_end: int
    tail_end: int
    final: bool  # decoded with no frames after it: the stream's last window, or a flush's
    history: torch.Tensor | None = None  # (h x codes_per_frame): the frames [start_frame - h, start_frame)

    @property
    def num_frames(self) -> int:
        return self.end_frame - self.start_frame

    def can_extend_left(self, frames: int, left_context: int) -> bool:
        h = 0 if self.history is None else self.history.shape[0]
        return frames <= h and left_context >= PAD_CONTEXT_FRAMES

    def can_pad_right(self, lookahead: int) -> bool:
        return not self.final and lookahead >= PAD_CONTEXT_FRAMES


class StreamDecoderState:
    """Codec state of one audio stream: received frames, planned windows, emitted samples and the held-back tail.

    Not thread-safe: push, plan and apply from one thread (the codec forward itself may run elsewhere).
    """

    def __init__(
        self, options: StreamingOptions, frame_samples: int, codes_per_frame: int, codebook_size: int | None = None
    ) -> None:
        options.validate(frame_samples)
        self.options = options
        self.frame_samples = frame_samples
        self.codes_per_frame = codes_per_frame
        self.codebook_size = codebook_size  # when set, push_frame rejects codes outside [0, codebook_size)
        self.closed = False
        self.reset()

    def reset(self) -> None:
        """Forget everything: ready for a new utterance."""
        self._frames: list[Sequence[int]] = []  # frames [self._frame_offset, self.num_frames)
        self._frame_offset = 0
        self.num_frames = 0
        self.finished = False
        self._planned_boundary = 0  # frame boundary b of the last planned window
        self._planned_until = 0  # sample where the next planned window starts emitting
        self._planned_windows = 0
        self._final_planned = False
        self._flush_frames = 0  # frames received when flush() was last called
        self._hop_origin = 0  # the window index the hops grow from: 0, then the first window after each flush
        self._applied_windows = 0
        self.emitted_samples = 0
        self._tail: torch.Tensor | None = None

    def close(self) -> None:
        """Drop all state; the stream takes no more frames and plans no more windows."""
        self.reset()
        self.closed = True
        self._final_planned = True

    @property
    def done(self) -> bool:
        """True once every planned window was applied and nothing is left to plan."""
        return self._final_planned and self._applied_windows == self._planned_windows

    def push_frame(self, frame: Sequence[int]) -> None:
        if self.closed or self.finished:
            raise RuntimeError("push_frame on a finished or closed stream")
        if len(frame) != self.codes_per_frame:
            raise ValueError(f"a frame has {self.codes_per_frame} codes, got {len(frame)}")
        codes = tuple(int(c) for c in frame)
        if self.codebook_size is not None and not all(0 <= c < self.codebook_size for c in codes):
            raise ValueError(f"codes must be in [0, {self.codebook_size}), got {list(codes)}")
        self._frames.append(codes)
        self.num_frames += 1

    def finish(self) -> None:
        """No more frames: the next plan includes the last window."""
        self.finished = True

    def flush(self) -> None:
        """The next plan emits the audio of every frame received so far (no lookahead, nothing held back for a
        crossfade); more frames may follow, and those pushed before that plan are not flushed with them."""
        self._flush_frames = self.num_frames

    def _window_frames(self, start: int, end: int) -> torch.Tensor:
        rows = self._frames[start - self._frame_offset : end - self._frame_offset]
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), self.codes_per_frame)

    def _make_window(self, emit_end: int, tail_end: int, end_frame: int, final: bool) -> DecodeWindow:
        f, opt = self.frame_samples, self.options
        start_frame = max(0, -(-self._planned_until // f) - opt.left_context_frames)
        history_from = max(self._frame_offset, start_frame - opt.window_frames())
        window = DecodeWindow(
            stream=self,
            index=self._planned_windows,
            frames=self._window_frames(start_frame, end_frame),
            start_frame=start_frame,
            end_frame=end_frame,
            emit_start=self._planned_until,
            emit_end=emit_end,
            tail_end=tail_end,
            final=final,
            history=self._window_frames(history_from, start_frame),
        )
        self._planned_windows += 1
        self._planned_until = emit_end
        # The next window starts at emit_end - L frames; keep a window's worth of history before that for padding.
        keep_from = max(0, -(-emit_end // f) - opt.left_context_frames - opt.window_frames())
        if keep_from > self._frame_offset:
            del self._frames[: keep_from - self._frame_offset]
            self._frame_offset = keep_from
        return window

    def plan(self) -> list[DecodeWindow]:
        """The windows that the frames received so far allow, in order (each is returned once)."""
        if self._final_planned:
            return []
        f, opt = self.frame_samples, self.options
        windows = []
        while True:
            boundary = self._planned_boundary + opt.hop(self._planned_windows - self._hop_origin)
            if self.num_frames < boundary + opt.lookahead_frames:
                break
            windows.append(
                self._make_window(
                    boundary * f - opt.crossfade_samples, boundary * f, boundary + opt.lookahead_frames, final=False
                )
            )
            self._planned_boundary = boundary
        if self.finished:
            end = self.num_frames * f
            if end > self._planned_until:
                windows.append(self._make_window(end, end, self.num_frames, final=True))
            self._final_planned = True
        elif (n := self._flush_frames) * f > self._planned_until:
            windows.append(self._make_window(n * f, n * f, n, final=True))
            self._planned_boundary = n  # the next hop counts from the flushed end
            self._hop_origin = self._planned_windows  # and is a first hop again: the listener's buffer ran out
        return windows

    def apply(self, window: DecodeWindow, audio: torch.Tensor) -> np.ndarray:
        """Audio of `window` (decoded frames, (end_frame - start_frame) * frame_samples) -> the chunk to emit."""
        if window.stream is not self:
            raise ValueError("window of another stream")
        if self.closed:
            return np.zeros(0, dtype=np.float32)
        if window.index != self._applied_windows:
            raise RuntimeError(f"windows applied out of order: got {window.index}, expected {self._applied_windows}")
        base = window.start_frame * self.frame_samples
        if audio.shape[-1] != (window.end_frame - window.start_frame) * self.frame_samples:
            raise ValueError("decoded audio does not match the window length")
        seg = audio[window.emit_start - base : window.tail_end - base].float().cpu().clone()
        if self._tail is not None and self._tail.numel():
            n = self._tail.numel()
            fade_in = (torch.arange(n, dtype=torch.float32) + 0.5) / n
            seg[:n] = self._tail * (1.0 - fade_in) + seg[:n] * fade_in
        emit = window.emit_end - window.emit_start
        chunk, self._tail = seg[:emit], seg[emit:]
        self.emitted_samples = window.emit_end
        self._applied_windows += 1
        return chunk.numpy()


class WindowedStreamDecoder:
    """What every stream decoder of the decode worker shares: plan each open stream's ready windows, decode them
    together (`decode_windows`, the subclass's codec pass) and apply the audio back to its stream."""

    def open_stream(self, options: StreamingOptions | None = None) -> StreamDecoderState:
        raise NotImplementedError

    def decode_windows(self, windows: Sequence[DecodeWindow]) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode_ready(self, streams: Iterable[StreamDecoderState]) -> dict[StreamDecoderState, list[np.ndarray]]:
        """Plan, decode (batched across streams) and apply every ready window; chunks per stream, in order."""
        windows = [w for s in streams if not s.closed for w in s.plan()]
        out: dict[StreamDecoderState, list[np.ndarray]] = {}
        if not windows:
            return out
        for w, audio in zip(windows, self.decode_windows(windows), strict=True):
            out.setdefault(w.stream, []).append(w.stream.apply(w, audio))
        return out

    def decode_all(self, frames: torch.Tensor) -> np.ndarray:
        """Stream a whole frame sequence (T x codes_per_frame) through one stream and join the chunks: a helper for
        offline use and for tests."""
        stream = self.open_stream()
        for row in frames.tolist():
            stream.push_frame(row)
        stream.finish()
        chunks = self.decode_ready([stream]).get(stream, [])
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


class BatchedStreamDecoder(WindowedStreamDecoder):
    """Decodes the ready windows of many streams together: one codec forward pass per distinct window length."""

    def __init__(
        self,
        codec: SnacDecoder,
        frame_levels: Sequence[Sequence[int]],
        options: StreamingOptions | None = None,
        static: StaticCodec | None = None,
    ) -> None:
        self.codec = codec
        self.static = static  # fixed-shape passes (CUDA graphs on a GPU), built by the caller; None: dynamic only
        self.frame_levels = tuple(tuple(int(p) for p in level) for level in frame_levels)
        self.codes_per_frame = sum(len(level) for level in self.frame_levels)
        if self.codes_per_frame != codec.shape.codes_per_frame:
            raise ValueError(
                f"frame layout has {self.codes_per_frame} codes, the codec's frames have {codec.shape.codes_per_frame}"
            )
        self.options = options or StreamingOptions()
        self.options.validate(codec.frame_samples)

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def open_stream(self, options: StreamingOptions | None = None) -> StreamDecoderState:
        return StreamDecoderState(
            options or self.options, self.codec.frame_samples, self.codes_per_frame, self.codec.shape.codebook_size
        )

    def decode_windows(self, windows: Sequence[DecodeWindow]) -> list[torch.Tensor]:
        """The codec pass alone (safe to run in a worker thread): audio per window, in order.

        Windows are padded to the longest one's length where that cannot change their audio (see the module
        docstring), so that they share one forward pass; a window that cannot be padded goes in a pass of its own
        length. Returns exactly (num_frames * frame_samples,) per window.
        """
        if not windows:
            return []
        target = max(w.num_frames for w in windows)
        if self.static is not None and (bucket := self.static.frame_bucket(target)) is not None:
            target = bucket  # padded to a fixed shape where that is safe, as to the longest window
        jobs: list[tuple[torch.Tensor, int]] = []
        offsets: list[int] = []  # frames of left extension per window
        for w in windows:
            need = target - w.num_frames
            opts = w.stream.options
            frames, start, left = w.frames, w.start_frame, 0
            if need and w.can_extend_left(need, opts.left_context_frames):
                assert w.history is not None
                frames, start, left = torch.cat([w.history[-need:], frames]), start - need, need
            elif need and w.can_pad_right(opts.lookahead_frames):
                frames = torch.cat([frames, frames[-1:].expand(need, -1)])
            jobs.append((frames, start))
            offsets.append(left)
        audio = (
            self._decode_jobs(jobs) if self.static is not None else self.codec.decode_windows(jobs, self.frame_levels)
        )
        if self.codec.device.type != "cpu" and self.static is None:
            audio = [a.cpu() for a in audio]  # here, in the worker's thread, not on the event loop
        f = self.codec.frame_samples
        return [a[left * f : (left + w.num_frames) * f] for a, w, left in zip(audio, windows, offsets, strict=True)]

    def _decode_jobs(self, jobs: Sequence[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """The static codec's passes: jobs grouped by length, each group in batches of at most the largest batch
        bucket, through a bucket where one fits and the dynamic decode otherwise; all on the codec's stream, the audio
        copied to the host before returning."""
        static = self.static
        assert static is not None
        out: list[torch.Tensor | None] = [None] * len(jobs)
        by_length: dict[int, list[int]] = {}
        for i, (frames, _) in enumerate(jobs):
            by_length.setdefault(int(frames.shape[0]), []).append(i)
        step = static.batch_buckets[-1]
        with static.stream_context():
            for length, idx in by_length.items():
                if length == 0:
                    for i in idx:
                        out[i] = torch.zeros(0)
                    continue
                for lo in range(0, len(idx), step):
                    part = idx[lo : lo + step]
                    frames = torch.stack([jobs[i][0] for i in part]).to(self.codec.device)  # (B x T x 7)
                    starts = torch.tensor([jobs[i][1] for i in part], dtype=torch.int64).to(self.codec.device)
                    if static.has_bucket(len(part), length):
                        audio = static.decode(frames, starts)
                    else:
                        audio = self.codec.decode_frames(frames, self.frame_levels, starts)
                    for row, i in zip(static.to_host(list(audio)), part, strict=True):
                        out[i] = row
        return out  # type: ignore[return-value]
