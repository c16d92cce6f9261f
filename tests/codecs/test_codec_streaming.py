"""Streaming codec decode: chunks == one-shot decode, seamless joins, batched streams == each alone, state freed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

LEVELS = ((0,), (1, 4), (2, 3, 5, 6))
SMALL_CONFIG = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=128)
F = 2048  # samples per frame at 24 kHz


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return SnacDecoder.from_folder(save_random_snac(tmp_path_factory.mktemp("snac"), SMALL_CONFIG, seed=2))


def random_frames(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (n, 7), generator=torch.Generator().manual_seed(seed))


def stream_frame_by_frame(dec: BatchedStreamDecoder, frames: torch.Tensor) -> list[np.ndarray]:
    """Push one frame at a time (as the engine produces them), decoding whatever is ready after each."""
    stream = dec.open_stream()
    chunks: list[np.ndarray] = []
    for row in frames.tolist():
        stream.push_frame(row)
        chunks += dec.decode_ready([stream]).get(stream, [])
    stream.finish()
    chunks += dec.decode_ready([stream]).get(stream, [])
    assert stream.done
    return chunks


def join_jumps(chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """|y[j] - y[j-1]| at every join j, and the largest sample-to-sample step in the 64 samples before each join."""
    y = np.concatenate(chunks)
    joins = np.cumsum([len(c) for c in chunks])[:-1]
    jumps = np.abs(y[joins] - y[joins - 1])
    local = np.array([np.abs(np.diff(y[j - 64 : j])).max() for j in joins])
    return jumps, local


def test_default_streaming_equals_one_shot_and_joins_are_seamless(codec):
    frames = random_frames(19, seed=1)
    one_shot = codec.decode_frames(frames[None], LEVELS)[0].numpy()
    dec = BatchedStreamDecoder(codec, LEVELS)  # 2 frames of context each side: the decoder's receptive field
    chunks = stream_frame_by_frame(dec, frames)
    y = np.concatenate(chunks)
    assert len(y) == len(one_shot) == 19 * F
    np.testing.assert_allclose(y, one_shot, atol=1e-5, rtol=0)  # everywhere, edges included
    # first chunk: first_hop (1 frame) minus the held-back crossfade; then hops of 2, 4, 8 frames; the rest at the end
    assert [len(c) for c in chunks] == [F - 256, 2 * F, 4 * F, 8 * F, 4 * F + 256]
    jumps, local = join_jumps(chunks)
    assert len(jumps) >= 4 and np.all(jumps <= local)
    # and each join's step is the one-shot signal's own step, to far below the signal's typical step
    joins = np.cumsum([len(c) for c in chunks])[:-1]
    step_error = np.abs((y[joins] - y[joins - 1]) - (one_shot[joins] - one_shot[joins - 1]))
    assert step_error.max() < 1e-3 * np.sqrt(np.mean(np.diff(one_shot) ** 2))


def test_short_context_streaming_stays_close_and_seamless(codec):
    """One frame of context: the windows differ slightly from the whole decode, the crossfade hides the joins."""
    frames = random_frames(15, seed=2)
    one_shot = codec.decode_frames(frames[None], LEVELS)[0].numpy()
    opts = StreamingOptions(first_hop_frames=2, hop_frames=3, left_context_frames=1, lookahead_frames=1)
    chunks = stream_frame_by_frame(BatchedStreamDecoder(codec, LEVELS, opts), frames)
    y = np.concatenate(chunks)
    scale = np.abs(one_shot).max()
    assert np.abs(y - one_shot).max() < 1e-3 * scale
    jumps, local = join_jumps(chunks)
    assert np.all(jumps <= local)


def test_join_check_catches_naive_chunking(codec):
    """The control for the join check: decoding chunks without context or crossfade does click."""
    frames = random_frames(15, seed=2)
    naive = StreamingOptions(first_hop_frames=2, hop_frames=3, left_context_frames=0, lookahead_frames=0,
                             crossfade_samples=0)  # fmt: skip
    chunks = stream_frame_by_frame(BatchedStreamDecoder(codec, LEVELS, naive), frames)
    jumps, local = join_jumps(chunks)
    assert np.any(jumps > local)


def test_concurrent_streams_batch_and_equal_each_alone(codec):
    dec = BatchedStreamDecoder(codec, LEVELS, StreamingOptions(hop_frames=3))
    lengths = [9, 13, 4]
    all_frames = [random_frames(n, seed=10 + i) for i, n in enumerate(lengths)]
    streams = [dec.open_stream() for _ in lengths]
    got: list[list[np.ndarray]] = [[] for _ in lengths]
    passes: list[int] = []
    real_decode = codec.decode
    calls = 0

    def counting_decode(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_decode(*args, **kwargs)

    codec.decode = counting_decode  # count forward passes of the real decoder
    try:
        for t in range(max(lengths) + 1):
            for s, frames, n in zip(streams, all_frames, lengths, strict=True):
                if t < n:
                    s.push_frame(frames[t].tolist())
                elif t == n:
                    s.finish()
            calls = 0
            ready = dec.decode_ready(streams)
            windows = sum(len(v) for v in ready.values())
            if windows:
                passes.append((windows, calls))
            for i, s in enumerate(streams):
                got[i] += ready.get(s, [])
    finally:
        del codec.decode
    assert all(s.done for s in streams)
    # Several streams' windows of equal length went through one forward pass together.
    # The three streams' first windows went through one forward pass together; later steps need a second pass only
    # for a window that can be padded neither way (the short stream's last window, which is also its first).
    assert passes[0] == (3, 1) and all(c <= 2 for _, c in passes)
    for frames, chunks in zip(all_frames, got, strict=True):
        alone = dec.decode_all(frames)
        # one frame of real context (the default): what shares a pass moves the audio by ~5e-6 at most
        np.testing.assert_allclose(np.concatenate(chunks), alone, atol=1e-5, rtol=0)
        one_shot = codec.decode_frames(frames[None], LEVELS)[0].numpy()
        np.testing.assert_allclose(alone, one_shot, atol=1e-5, rtol=0)


def test_windows_of_different_lengths_share_one_pass(codec):
    """Windows of streams at different stages (growing chunks, a just-started stream, a finishing one) decode in one
    forward pass, padded with context that cannot reach their audio: each equals its window decoded alone."""
    dec = BatchedStreamDecoder(codec, LEVELS)
    streams = []
    for i, (n, finish) in enumerate([(14, False), (3, False), (12, True)]):
        s = dec.open_stream()
        for row in random_frames(n, seed=20 + i).tolist():
            s.push_frame(row)
        if finish:
            s.finish()
        streams.append(s)
    windows = [w for s in streams for w in s.plan()]
    assert len({w.num_frames for w in windows}) >= 3 and windows[-1].final
    calls = 0
    real_decode = codec.decode

    def counting_decode(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_decode(*args, **kwargs)

    codec.decode = counting_decode  # count forward passes of the real decoder
    try:
        audio = dec.decode_windows(windows)
    finally:
        del codec.decode
    assert calls == 1
    for w, a in zip(windows, audio, strict=True):
        alone = codec.decode_frames(w.frames[None], LEVELS, torch.tensor([w.start_frame]))[0]
        assert a.shape == alone.shape == (w.num_frames * F,)
        used = slice(w.emit_start - w.start_frame * F, w.tail_end - w.start_frame * F)  # emitted + held-back tail
        # one frame of real context each side (the default): padding beyond it moves the audio by ~4e-6 at most
        torch.testing.assert_close(a[used], alone[used], atol=1e-5, rtol=0)


def test_close_and_reset_free_state(codec):
    dec = BatchedStreamDecoder(codec, LEVELS)
    s = dec.open_stream()
    for row in random_frames(8, seed=4).tolist():
        s.push_frame(row)
    assert dec.decode_ready([s])[s]
    assert s._tail is not None and s._frames
    s.reset()
    assert s.num_frames == 0 and s._tail is None and not s._frames and s.emitted_samples == 0
    for row in random_frames(3, seed=4).tolist():
        s.push_frame(row)
    s.close()
    assert s.closed and s._tail is None and not s._frames and s.plan() == []
    assert dec.decode_ready([s]) == {}
    with pytest.raises(RuntimeError):
        s.push_frame([0] * 7)


def test_options_and_input_are_validated(codec):
    with pytest.raises(ValueError, match="crossfade_samples"):
        BatchedStreamDecoder(codec, LEVELS, StreamingOptions(first_hop_frames=1, crossfade_samples=F + 1))
    with pytest.raises(ValueError, match="left context"):
        BatchedStreamDecoder(codec, LEVELS, StreamingOptions(left_context_frames=0, crossfade_samples=64))
    with pytest.raises(ValueError, match="hop_frames"):
        BatchedStreamDecoder(codec, LEVELS, StreamingOptions(hop_frames=0))
    with pytest.raises(ValueError, match="frame layout"):
        BatchedStreamDecoder(codec, ((0,), (1, 2)))
    s = BatchedStreamDecoder(codec, LEVELS).open_stream()
    with pytest.raises(ValueError, match="7 codes"):
        s.push_frame([1, 2, 3])
    s.finish()
    assert s.plan() == [] and s.done  # no frames, no audio


def test_window_length_is_constant_in_steady_state(codec):
    opts = StreamingOptions(first_hop_frames=1, hop_frames=2, left_context_frames=2, lookahead_frames=1)
    s = BatchedStreamDecoder(codec, LEVELS, opts).open_stream()
    for row in random_frames(20, seed=6).tolist():
        s.push_frame(row)
    windows = s.plan()
    assert [w.end_frame - w.start_frame for w in windows[2:]] == [opts.window_frames()] * (len(windows) - 2)
    assert [w.emit_start for w in windows[1:]] == [w.emit_end for w in windows[:-1]]  # contiguous, no gaps


def test_old_frames_are_trimmed_and_a_long_stream_still_equals_one_shot(codec):
    """A stream keeps only the frames later windows can still read (left context plus a window of history for padding),
    not every frame it ever received: memory stays flat over a long utterance, and the audio stays exact."""
    n = 96
    frames = random_frames(n, seed=9)
    dec = BatchedStreamDecoder(codec, LEVELS)
    opts = dec.open_stream().options
    stream = dec.open_stream()
    chunks: list[np.ndarray] = []
    held = []
    for row in frames.tolist():
        stream.push_frame(row)
        chunks += dec.decode_ready([stream]).get(stream, [])
        held.append(len(stream._frames))
    stream.finish()
    chunks += dec.decode_ready([stream]).get(stream, [])
    # Not yet emitted (at most a hop plus the lookahead) + left context + one window of history + the frame in hand.
    bound = opts.hop_frames + opts.lookahead_frames + opts.left_context_frames + opts.window_frames() + 1
    assert max(held) <= bound < n, (max(held), bound)
    assert held[-1] < n // 2  # trimmed as it went, not only at the end
    np.testing.assert_allclose(np.concatenate(chunks), codec.decode_frames(frames[None], LEVELS)[0].numpy(), atol=1e-5)


def test_flush_emits_every_frame_so_far_and_the_stream_goes_on(codec):
    """A flush (a clause spoken, the next one's text not written yet) sends all audio of the frames received so far,
    nothing held back; the frames after it continue the same stream, which still ends at exactly frames x F."""
    frames = random_frames(19, seed=4)
    one_shot = codec.decode_frames(frames[None], LEVELS)[0].numpy()
    dec = BatchedStreamDecoder(codec, LEVELS)
    stream = dec.open_stream()
    stream.flush()  # nothing received: no (empty) window
    assert dec.decode_ready([stream]) == {}
    chunks: list[np.ndarray] = []
    for row in frames[:6].tolist():
        stream.push_frame(row)
        chunks += dec.decode_ready([stream]).get(stream, [])
    assert sum(len(c) for c in chunks) < 6 * F  # held back: the lookahead frame and the crossfade
    stream.flush()
    stream.push_frame(frames[6].tolist())  # pushed after the flush was asked for: not part of it
    chunks += dec.decode_ready([stream]).get(stream, [])
    assert sum(len(c) for c in chunks) == 6 * F and not stream.done
    assert dec.decode_ready([stream]) == {}  # a flush is planned once
    for row in frames[7:].tolist():
        stream.push_frame(row)
        chunks += dec.decode_ready([stream]).get(stream, [])
    stream.finish()
    chunks += dec.decode_ready([stream]).get(stream, [])
    assert stream.done
    # hops of 1 and 2 frames, the flush (to frame 6, the crossfade held before it included), then hops from 1 again
    assert [len(c) for c in chunks] == [F - 256, 2 * F, 3 * F + 256, F - 256, 2 * F, 4 * F, 6 * F + 256]
    y = np.concatenate(chunks)
    assert len(y) == len(one_shot) == 19 * F
    # Before the flush the audio is that of the 6 frames alone (as if the stream had ended there: the last frame
    # decoded without right context); after it, the one-shot decode's (its left context is the frames before).
    alone = codec.decode_frames(frames[None, :6], LEVELS)[0].numpy()
    np.testing.assert_allclose(y[: 6 * F], alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(y[6 * F :], one_shot[6 * F :], atol=1e-5, rtol=0)
