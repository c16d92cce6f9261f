"""DecodeWorker: concurrent producers on one event loop, batched codec passes, ends, closes and failures."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from omnivox.codecs.decode_worker import END, DecodeWorker, thread_device
from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

LEVELS = ((0,), (1, 4), (2, 3, 5, 6))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = save_random_snac(tmp_path_factory.mktemp("snac"), dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64))
    return BatchedStreamDecoder(SnacDecoder.from_folder(path), LEVELS, StreamingOptions(hop_frames=2))


async def drain(stream) -> list:
    items = []
    while (item := await stream.chunks.get()) is not END:
        items.append(item)
        if isinstance(item, BaseException):
            break
    return items


@pytest.mark.parametrize("one_window_per_pass", [False, True])  # GPU: each stream's next window together; CPU: one
def test_concurrent_streams_are_decoded_in_shared_passes(decoder, one_window_per_pass):
    g = torch.Generator().manual_seed(0)
    all_frames = [torch.randint(0, 4096, (n, 7), generator=g) for n in (7, 9, 0, 5)]

    async def main():
        worker = DecodeWorker(decoder)
        assert worker.one_window_per_pass  # a CPU codec
        worker.one_window_per_pass = one_window_per_pass
        streams = [worker.open() for _ in all_frames]

        async def produce(stream, frames):
            for row in frames.tolist():  # one frame per "engine step", all producers interleaved
                worker.push(stream, [row])
                await asyncio.sleep(0)
            worker.finish(stream)

        producers = [asyncio.create_task(produce(s, f)) for s, f in zip(streams, all_frames, strict=True)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        await asyncio.gather(*producers)
        for s in streams:
            worker.close(s)
        assert worker.open_streams == 0
        await worker.shutdown()
        return results, worker.stats

    results, stats = asyncio.run(main())
    for frames, chunks in zip(all_frames, results, strict=True):
        got = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        assert got.shape == (len(frames) * 2048,)
        if len(frames):
            # shared passes: ~4e-6 from each stream alone with one frame of context (the default)
            np.testing.assert_allclose(got, decoder.decode_all(frames), atol=1e-5, rtol=0)
    if one_window_per_pass:  # earliest deadline first, never a stream's backlog in one pass
        assert stats.max_batch == 1 and stats.passes == stats.windows
    else:
        assert stats.max_batch > 1 and stats.passes < stats.windows


def test_the_stream_whose_playback_runs_dry_first_is_due_first(decoder):
    async def main():
        worker = DecodeWorker(decoder)
        fresh, playing, ahead = worker.open(), worker.open(), worker.open()
        now = fresh.opened_at
        playing.first_chunk_at, ahead.first_chunk_at = now - 1.0, now - 1.0
        playing.state.emitted_samples, ahead.state.emitted_samples = 24000 // 2, 24000 * 3
        rate = worker.sample_rate
        # played 1 s of 0.5 s given: overdue; a new stream: due since it opened; 3 s given: due in 2 s
        assert playing.deadline(rate) < fresh.deadline(rate) < ahead.deadline(rate)
        for s in (fresh, playing, ahead):
            worker.close(s)
        await worker.shutdown()

    asyncio.run(main())


def test_a_stream_is_decoding_until_every_pushed_frame_is_audio(decoder):
    """AudioStream.decoding, a speech stream's work for the step arbiter once its engine is done (engine/arbiter.py):
    frames pushed and finished but not decoded yet: decoding; after its last chunk: not. A stream flushed and waiting
    for more frames (streamed text between clauses): not decoding once its flushed audio is out."""
    frames = torch.randint(0, 4096, (5, 7), generator=torch.Generator().manual_seed(1)).tolist()

    async def main():
        worker = DecodeWorker(decoder)
        done = worker.open()
        assert not done.decoding  # nothing pushed
        worker.push(done, frames)
        worker.finish(done)
        assert done.decoding  # the engine is done, the codec has not run yet
        assert sum(len(c) for c in await drain(done)) == 5 * 2048 and not done.decoding
        waiting = worker.open()
        worker.push(waiting, frames[:3])
        worker.flush(waiting)
        assert waiting.decoding
        out = 0
        while out < 3 * 2048:
            out += len(await waiting.chunks.get())
        assert not waiting.decoding  # its flushed audio is out: it waits on its text, not on the codec
        worker.push(waiting, frames[3:])
        assert waiting.decoding
        worker.finish(waiting)
        assert sum(len(c) for c in await drain(waiting)) == 2 * 2048 and not waiting.decoding
        for stream in (done, waiting):
            worker.close(stream)
        await worker.shutdown()

    asyncio.run(main())


def test_a_bad_frame_fails_only_its_producer_and_close_drops_state(decoder):
    async def main():
        worker = DecodeWorker(decoder)
        good, bad = worker.open(), worker.open()
        with pytest.raises(ValueError, match="codes must be in"):
            worker.push(bad, [[0, 1, 2, 3, 4, 5, 4096]])
        worker.close(bad)
        worker.push(good, [[1] * 7, [2] * 7])
        worker.finish(good)
        chunks = await drain(good)
        assert sum(len(c) for c in chunks) == 2 * 2048
        abandoned = worker.open()
        worker.push(abandoned, [[3] * 7] * 4)
        await asyncio.wait_for(abandoned.chunks.get(), 60)  # decoding has begun: it holds frames and a tail
        assert abandoned.state._tail is not None and abandoned.state._frames
        worker.close(abandoned)  # a cancelled request: its frames and tail are dropped
        assert abandoned.state._tail is None and not abandoned.state._frames
        worker.close(good)
        assert worker.open_streams == 0
        await worker.shutdown()

    asyncio.run(main())


def test_passes_run_in_the_codec_thread_on_the_codec_device(decoder, monkeypatch):
    """The worker's own thread makes the codec's device current once, when it starts (`--device cuda:1`: a thread
    starts on cuda:0), and every codec pass runs in it: not on the event loop, not in asyncio's shared pool. torch's
    set_device is recorded instead of called, so this runs without a GPU; the audio equals a CPU worker's."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    decode = decoder.decode_windows

    def watched(windows):
        calls.append((threading.current_thread().name, "pass"))
        return decode(windows)

    monkeypatch.setattr(decoder, "decode_windows", watched)
    frames = torch.randint(0, 4096, (6, 7), generator=torch.Generator().manual_seed(3))

    async def run(device):
        worker = DecodeWorker(decoder, device=device)
        stream = worker.open()
        for row in frames.tolist():
            worker.push(stream, [row])
            await asyncio.sleep(0)
        worker.finish(stream)
        chunks = await drain(stream)
        worker.close(stream)
        await worker.shutdown()
        return np.concatenate(chunks)

    on_gpu1 = asyncio.run(run("cuda:1"))
    assert calls[0][1] == torch.device("cuda:1") and [c for _, c in calls[1:]] == ["pass"] * (len(calls) - 1)
    assert len(calls) > 2 and all(name.startswith("omnivox-codec") for name, _ in calls)
    calls.clear()
    on_cpu = asyncio.run(run(None))  # the codec's own device: the CPU, no set_device
    assert calls and all(c == "pass" and name.startswith("omnivox-codec") for name, c in calls)
    np.testing.assert_array_equal(on_gpu1, on_cpu)
    assert thread_device("cuda:1") == torch.device("cuda", 1) and thread_device("cpu") == torch.device("cpu")
