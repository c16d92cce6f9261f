"""Mimi decode: parity with transformers' MimiModel.decode, streaming == one-shot, batched streams == each alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support.mimi_checkpoints import TINY_MIMI_CONFIGS, save_tiny_mimi
from transformers import MimiModel

from omnivox.codecs.decode_worker import END, DecodeWorker
from omnivox.codecs.mimi import MimiDecoder
from omnivox.codecs.mimi_streaming import MimiStreamDecoder


@pytest.fixture(scope="module", params=sorted(TINY_MIMI_CONFIGS))
def mimi(request, tmp_path_factory) -> tuple[MimiModel, MimiDecoder]:
    path = save_tiny_mimi(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    reference = MimiModel.from_pretrained(path).eval()
    return reference, MimiDecoder.from_folder(path)


def random_codes(decoder: MimiDecoder, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, decoder.codebook_size, (batch, decoder.num_codebooks, frames), generator=g)  # (B x K x T)


def test_decode_equals_transformers(mimi):
    reference, decoder = mimi
    codes = random_codes(decoder, 2, 13, seed=0)  # 26 transformer steps: several sliding windows
    with torch.no_grad():
        expected = reference.decode(codes).audio_values[:, 0]  # (B x samples)
    audio = decoder.decode(codes)
    assert audio.shape == (2, 13 * decoder.frame_samples) == expected.shape
    assert expected.abs().max() > 0.1  # not a silent codec
    torch.testing.assert_close(audio, expected, atol=1e-4, rtol=0)
    # fewer codebooks than the codec has (semantic + some acoustic), as transformers allows
    with torch.no_grad():
        expected = reference.decode(codes[:, :3]).audio_values[:, 0]
    torch.testing.assert_close(decoder.decode(codes[:, :3]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streaming_equals_one_shot(mimi, chunk):
    _, decoder = mimi
    codes = random_codes(decoder, 2, 17, seed=1)
    one_shot = decoder.decode(codes)
    with decoder.streaming(2) as stream:
        parts = [stream.decode(codes[..., i : i + chunk]) for i in range(0, 17, chunk)]
    assert [p.shape[-1] for p in parts[:-1]] == [chunk * decoder.frame_samples] * (len(parts) - 1)
    torch.testing.assert_close(torch.cat(parts, dim=-1), one_shot, atol=1e-5, rtol=0)


def test_streams_batched_together_equal_each_alone(mimi):
    """Four streams of different lengths, pushed frame by frame and decoded in shared passes (states stacked), give
    each stream's one-shot audio; every stream's codec state is dropped after its last window."""
    _, decoder = mimi
    streamer = MimiStreamDecoder(decoder)
    lengths = (11, 6, 1, 9)
    frames = [random_codes(decoder, 1, n, seed=10 + i)[0].T for i, n in enumerate(lengths)]  # (T x K) each
    streams = [streamer.open_stream() for _ in lengths]
    chunks: list[list[np.ndarray]] = [[] for _ in lengths]
    for t in range(max(lengths)):
        for s, f in zip(streams, frames, strict=True):
            if t < f.shape[0]:
                s.push_frame(f[t].tolist())
            if t == f.shape[0] - 1:
                s.finish()
        for s, got in streamer.decode_ready(streams).items():
            chunks[streams.index(s)] += got
    assert all(s.done for s in streams) and streamer.open_states == 0
    for got, f in zip(chunks, frames, strict=True):
        expected = decoder.decode(f.T[None])[0].numpy()
        np.testing.assert_allclose(np.concatenate(got), expected, atol=1e-5, rtol=0)
    assert [len(c) for c in chunks[0]] == [n * decoder.frame_samples for n in (1, 2, 4, 4)]  # hops 1, 2, 4, rest


def test_decode_worker_streams_mimi_as_snac(mimi):
    """The decode worker (deadline-first passes, queues, ends) runs Mimi streams unchanged; a flush mid-stream emits
    what was pushed and the stream continues exactly."""
    _, decoder = mimi
    all_frames = [random_codes(decoder, 1, n, seed=20 + n)[0].T for n in (7, 3)]

    async def main():
        worker = DecodeWorker(MimiStreamDecoder(decoder))
        streams = [worker.open() for _ in all_frames]

        async def produce(stream, frames):
            for i, row in enumerate(frames.tolist()):
                worker.push(stream, [row])
                if i == 1:
                    worker.flush(stream)
                await asyncio.sleep(0)
            worker.finish(stream)

        async def drain(stream):
            items = []
            while (item := await stream.chunks.get()) is not END:
                assert not isinstance(item, BaseException), item
                items.append(item)
            return items

        producers = [asyncio.create_task(produce(s, f)) for s, f in zip(streams, all_frames, strict=True)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        await asyncio.gather(*producers)
        for s in streams:
            worker.close(s)
        await worker.shutdown()
        return results, worker.decoder.open_states

    results, open_states = asyncio.run(main())
    assert open_states == 0
    for got, frames in zip(results, all_frames, strict=True):
        expected = decoder.decode(frames.T[None])[0].numpy()
        np.testing.assert_allclose(np.concatenate(got), expected, atol=1e-5, rtol=0)


def test_bad_codes_are_refused(mimi):
    _, decoder = mimi
    codes = random_codes(decoder, 1, 2, seed=0)
    with pytest.raises(ValueError, match="codes must be in"):
        decoder.decode(codes + decoder.codebook_size)
    with pytest.raises(ValueError, match=r"B x K x T"):
        decoder.decode(codes[0])
    stream = MimiStreamDecoder(decoder).open_stream()
    with pytest.raises(ValueError, match="codes"):
        stream.push_frame([decoder.codebook_size] * decoder.num_codebooks)
