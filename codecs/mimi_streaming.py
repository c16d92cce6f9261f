"""Mimi streams for the decode worker: the same planning as SNAC's (codecs/streaming.py), exact chunks instead of
overlapping windows.

A stream is a `StreamDecoderState` planned with no left context, no lookahead and no crossfade (Mimi is causal and its
decoder carries state, codecs/mimi.py), so each window is just the stream's next frames and its audio is emitted whole;
chunks still grow (first hop 1 frame, doubling) so the first audio leaves after one frame. Each stream's codec state
(`MimiDecodeState`) lives here, keyed by the stream, and is only touched in the codec pass (the worker's thread).

`decode_windows` decodes the windows of many streams together: one pass per distinct window length, the streams'
states stacked into one batch for it and split back after. A stream's windows must come in order and each exactly
once (the worker sends one window per stream a pass; `decode_ready` here sends them round by round).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from omnivox.codecs.mimi import MimiDecoder, MimiDecodeState
from omnivox.codecs.streaming import DecodeWindow, StreamDecoderState, StreamingOptions, WindowedStreamDecoder

# Exact streaming needs no context around a window. Hops of 1, 2, 4, 8 frames (80 ms each): the first audio after one
# frame; past 8 frames a pass's fixed cost is already small against its frames (tests/codecs/test_codec_mimi.py times none
# of this; benchmarks/csm.py reports the codec time per audio second).
MIMI_STREAMING = StreamingOptions(
    first_hop_frames=1, hop_frames=8, left_context_frames=0, lookahead_frames=0, crossfade_samples=0
)


class MimiStreamDecoder(WindowedStreamDecoder):
    """Decodes the ready windows of many Mimi streams together (the decode worker's decoder for a Mimi codec)."""

    def __init__(
        self, codec: MimiDecoder, options: StreamingOptions | None = None, num_codebooks: int | None = None
    ) -> None:
        """num_codebooks: codes per frame (the first ones of the codec's; default all of them)."""
        self.codec = codec
        self.options = options or MIMI_STREAMING
        if self.options.left_context_frames or self.options.lookahead_frames or self.options.crossfade_samples:
            raise ValueError("Mimi streams decode exactly: no left context, lookahead or crossfade")
        self.options.validate(codec.frame_samples)
        self.codes_per_frame = num_codebooks or codec.num_codebooks
        if not codec.num_semantic <= self.codes_per_frame <= codec.num_codebooks:
            raise ValueError(f"{self.codes_per_frame} codes per frame for a Mimi codec of {codec.num_codebooks}")
        self._states: weakref.WeakKeyDictionary[StreamDecoderState, tuple[MimiDecodeState, int]] = (
            weakref.WeakKeyDictionary()
        )  # stream -> (its codec state, frames decoded)

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    @property
    def open_states(self) -> int:
        """Streams holding codec state (a finished stream's is dropped after its last window)."""
        self._drop_ended()
        return len(self._states)

    def open_stream(self, options: StreamingOptions | None = None) -> StreamDecoderState:
        return StreamDecoderState(
            options or self.options, self.codec.frame_samples, self.codes_per_frame, self.codec.codebook_size
        )

    def _decode_round(self, windows: Sequence[DecodeWindow]) -> list[torch.Tensor]:
        """Windows of distinct streams -> audio per window; grouped by length, one batched pass per group."""
        out: list[torch.Tensor | None] = [None] * len(windows)
        by_length: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_length.setdefault(w.num_frames, []).append(i)
        for length, idx in by_length.items():
            states = []
            for i in idx:
                w = windows[i]
                state, decoded = self._states.get(w.stream) or (self.codec.new_state(1), 0)
                if decoded != w.start_frame:
                    raise RuntimeError(f"window starts at frame {w.start_frame}, the stream decoded {decoded}")
                states.append(state)
            batch = MimiDecodeState.cat(states)
            codes = torch.stack([windows[i].frames for i in idx]).transpose(1, 2)  # (B x K x T)
            audio = self.codec.decode_chunk(codes, batch) if length else None
            for row, (i, state) in enumerate(zip(idx, batch.split(), strict=True)):
                w = windows[i]
                out[i] = audio[row].cpu() if audio is not None else torch.zeros(0)
                self._states[w.stream] = (state, w.end_frame)
        self._drop_ended()
        return out  # type: ignore[return-value]

    def _drop_ended(self) -> None:
        """Forget the codec state of closed streams and of finished ones decoded to their last frame (the rest go
        with their stream: the map holds streams weakly)."""
        for stream, (_, decoded) in list(self._states.items()):
            if stream.closed or stream.finished and decoded >= stream.num_frames:
                del self._states[stream]

    def decode_windows(self, windows: Sequence[DecodeWindow]) -> list[torch.Tensor]:
        """The codec passes (run in the worker's thread): audio (num_frames * frame_samples,) per window, in order.
        Several windows of one stream are decoded one after another (round by round)."""
        self._drop_ended()
        out: list[torch.Tensor | None] = [None] * len(windows)
        rounds: list[list[int]] = []
        seen: dict[int, int] = {}
        for i, w in enumerate(windows):
            r = seen.get(id(w.stream), 0)
            seen[id(w.stream)] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for idx in rounds:
            for i, audio in zip(idx, self._decode_round([windows[i] for i in idx]), strict=True):
                out[i] = audio
        return out  # type: ignore[return-value]
