"""Fixed-shape codec passes (codecs/codec_graphs.py): the padded (batch, frames) bucket path equals the dynamic decode
(the eager twin here on CPU; CUDA graphs where OMNIVOX_TEST_DEVICE=cuda), streams through it equal the one-shot decode,
and the audio comes back on the host."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support.engines import device_under_test

from omnivox.codecs.codec_graphs import StaticCodec, frame_buckets_for
from omnivox.codecs.decode_worker import END, DecodeWorker
from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.snac_noise import _MASK32, _hash32, _hash32_int
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

LEVELS = ((0,), (1, 4), (2, 3, 5, 6))
F = 2048
DEVICE = device_under_test()


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = save_random_snac(tmp_path_factory.mktemp("snac"), dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64))
    return SnacDecoder.from_folder(path, device=DEVICE)


@pytest.fixture(scope="module")
def static(codec):
    s = StaticCodec(codec, LEVELS, frame_buckets=(4, 8, 12), batch_buckets=(1, 2, 4))
    assert not s.has_bucket(1, 4)  # nothing before build_all
    s.build_all()
    return s


def random_frames(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, n, 7), generator=torch.Generator().manual_seed(seed))


def test_noise_salt_without_a_tensor_is_the_same_hash():
    for x in [0, 1, 12345, 0xDEADBEEF, _MASK32]:
        assert _hash32_int(x) == int(_hash32(torch.tensor([x]))[0])


@pytest.mark.parametrize(("batch", "frames"), [(1, 4), (3, 8), (4, 12), (2, 4)])
def test_bucket_pass_equals_the_dynamic_decode(codec, static, batch, frames):
    """Padded batch rows change nothing in the real rows; the static frames -> codes path is the dynamic one's."""
    x = random_frames(batch, frames, seed=batch * 100 + frames)
    starts = torch.tensor([0, 5, 17, 2][:batch])
    assert static.has_bucket(batch, frames)
    with static.stream_context():
        got = static.to_host(list(static.decode(x.to(DEVICE), starts.to(DEVICE))))
    want = codec.decode_frames(x, LEVELS, starts).cpu()
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cpu" and g.shape == (frames * F,)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_shapes_without_a_bucket_are_refused(static):
    assert not static.has_bucket(1, 5) and not static.has_bucket(8, 4)
    with pytest.raises(RuntimeError, match="no codec bucket"):
        static.decode(random_frames(1, 5, 0).to(DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert frame_buckets_for(20) == (4, 8, 12, 16, 20)


def test_streams_through_buckets_equal_the_one_shot_decode(codec, static):
    """Three streams pushed frame by frame through a streaming decoder with the static codec: windows are padded to
    frame buckets where that is safe and go through bucket passes; the audio equals each stream's one-shot decode."""
    opts = StreamingOptions(hop_frames=8)  # windows up to 2 + 8 + 2 = 12 frames: the largest bucket
    dec = BatchedStreamDecoder(codec, LEVELS, opts, static=static)
    lengths = [13, 9, 4]
    all_frames = [random_frames(1, n, seed=40 + i)[0] for i, n in enumerate(lengths)]
    streams = [dec.open_stream() for _ in lengths]
    got: list[list[np.ndarray]] = [[] for _ in lengths]
    bucket_passes = 0
    real_decode = static.decode

    def counting(*args, **kwargs):
        nonlocal bucket_passes
        bucket_passes += 1
        return real_decode(*args, **kwargs)

    static.decode = counting
    try:
        for t in range(max(lengths) + 1):
            for s, frames, n in zip(streams, all_frames, lengths, strict=True):
                if t < n:
                    s.push_frame(frames[t].tolist())
                elif t == n:
                    s.finish()
            for s, chunks in dec.decode_ready(streams).items():
                got[streams.index(s)] += chunks
    finally:
        del static.decode
    assert all(s.done for s in streams) and bucket_passes >= 3
    for frames, chunks in zip(all_frames, got, strict=True):
        one_shot = codec.decode_frames(frames[None], LEVELS)[0].cpu().numpy()
        np.testing.assert_allclose(np.concatenate(chunks), one_shot, atol=1e-5, rtol=0)


def test_decode_worker_through_buckets_on_the_codec_device(codec, static):
    """The served path: the decode worker's own thread (the codec's device made current there) runs the bucket
    passes on the codec's stream and copies the audio to the host there; the event loop gets float32 host chunks
    equal to each stream's one-shot decode. On CUDA every pass ran with the codec's device current."""
    dec = BatchedStreamDecoder(codec, LEVELS, StreamingOptions(hop_frames=8), static=static)
    devices: list[int] = []
    real = dec.decode_windows

    def watched(windows):
        if DEVICE.type == "cuda":
            devices.append(torch.cuda.current_device())
        return real(windows)

    dec.decode_windows = watched
    all_frames = [random_frames(1, n, seed=60 + i)[0] for i, n in enumerate((11, 6))]

    async def main() -> tuple[list[list[np.ndarray]], DecodeWorker]:
        worker = DecodeWorker(dec)
        streams = [worker.open() for _ in all_frames]

        async def produce(stream, frames) -> None:
            for row in frames.tolist():
                worker.push(stream, [row])
                await asyncio.sleep(0)
            worker.finish(stream)

        async def drain(stream) -> list[np.ndarray]:
            chunks = []
            while (item := await stream.chunks.get()) is not END:
                assert not isinstance(item, BaseException), item
                chunks.append(item)
            return chunks

        producers = [asyncio.create_task(produce(s, f)) for s, f in zip(streams, all_frames, strict=True)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        await asyncio.gather(*producers)
        for s in streams:
            worker.close(s)
        await worker.shutdown()
        return results, worker

    results, worker = asyncio.run(main())
    for frames, chunks in zip(all_frames, results, strict=True):
        assert chunks and all(isinstance(c, np.ndarray) and c.dtype == np.float32 for c in chunks)
        one_shot = codec.decode_frames(frames[None], LEVELS)[0].cpu().numpy()
        np.testing.assert_allclose(np.concatenate(chunks), one_shot, atol=1e-5, rtol=0)
    if DEVICE.type == "cuda":
        assert devices and set(devices) == {worker.device.index}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: run with OMNIVOX_TEST_DEVICE=cuda on a GPU")
def test_cuda_graphs_replay_equals_eager(codec, static):
    assert static.use_graphs and all(b.graph is not None for b in static._buckets.values())
    eager = StaticCodec(codec, LEVELS, frame_buckets=(8,), batch_buckets=(2,), use_graphs=False)
    eager.build_all()
    x, starts = random_frames(2, 8, seed=7).to(DEVICE), torch.tensor([3, 11], device=DEVICE)
    with static.stream_context():
        graphed = static.to_host(list(static.decode(x, starts)))
    with eager.stream_context():
        plain = eager.to_host(list(eager.decode(x, starts)))
    for g, p in zip(graphed, plain, strict=True):
        torch.testing.assert_close(g, p, atol=1e-5, rtol=0)
