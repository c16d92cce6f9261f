"""Start-up sizing: the first chunk and hop growth from measured rates, so playback started on the first chunk
never runs dry; the decode worker measures the rates and applies them to new streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omnivox.codecs.decode_worker import END, DecodeWorker
from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.startup import START_MARGIN, simulate_start, startup_options
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

FRAME_S = 2048 / 24000
DEFAULT = StreamingOptions()


def test_fast_rates_keep_the_default_start():
    assert startup_options(DEFAULT, gen_s=0.005, codec_s=0.003, frame_s=FRAME_S) == DEFAULT


@pytest.mark.parametrize(("gen_s", "codec_s"), [(0.02, 0.025), (0.03, 0.03), (0.04, 0.04), (0.05, 0.05)])
def test_slower_rates_get_a_start_that_never_runs_dry(gen_s, codec_s):
    """At these rates (about 1 and 2 served streams on this CPU) hops doubling from one frame run dry, as measured
    (benchmarks/speech.py: 77 ms / 1.1 s); the chosen start does not, even with the rates START_MARGIN times worse."""
    _, default_lateness = simulate_start(DEFAULT, gen_s, codec_s, FRAME_S)
    assert default_lateness > 0
    chosen = startup_options(DEFAULT, gen_s, codec_s, FRAME_S)
    first, lateness = simulate_start(chosen, gen_s * START_MARGIN, codec_s * START_MARGIN, FRAME_S)
    assert lateness <= 0 and chosen.first_hop_frames > 1
    # The earliest such start: one frame less in the first chunk would run dry with every growth tried.
    if chosen.first_hop_frames > 1:
        for growth in (2.0, 1.5, 1.25):
            smaller = StreamingOptions(first_hop_frames=chosen.first_hop_frames - 1, hop_growth=growth)
            assert simulate_start(smaller, gen_s * START_MARGIN, codec_s * START_MARGIN, FRAME_S)[1] > 0


def test_slower_than_real_time_keeps_the_earliest_first_audio():
    """No start keeps up when frames come slower than real time: a larger first chunk would only delay the audio."""
    assert startup_options(DEFAULT, gen_s=0.2, codec_s=0.1, frame_s=FRAME_S) == DEFAULT


def test_hop_growth():
    opts = StreamingOptions(first_hop_frames=2, hop_frames=16, hop_growth=1.5)
    assert [opts.hop(k) for k in range(7)] == [2, 3, 4, 6, 10, 15, 16]
    assert [DEFAULT.hop(k) for k in range(6)] == [1, 2, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="hop_growth"):
        StreamingOptions(hop_growth=0.5).validate(2048)


def test_worker_measures_rates_and_sizes_new_streams(tmp_path):
    path = save_random_snac(tmp_path / "snac", dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64))
    decoder = BatchedStreamDecoder(SnacDecoder.from_folder(path), ((0,), (1, 4), (2, 3, 5, 6)))
    frames = torch.randint(0, 4096, (12, 7), generator=torch.Generator().manual_seed(0)).tolist()

    async def main():
        worker = DecodeWorker(decoder)
        assert worker.startup_options() == decoder.options  # nothing measured yet
        first = worker.open()
        assert first.state.options == decoder.options
        for row in frames:
            worker.push(first, [row])
            await asyncio.sleep(0.03)  # a slow engine: a frame every 30 ms
        worker.finish(first)
        while await first.chunks.get() is not END:
            pass
        worker.close(first)
        unmeasured = worker.open(measured=False)
        worker.push(unmeasured, [frames[0]])
        await asyncio.sleep(0.5)
        worker.push(unmeasured, [frames[1]])  # waited on text: not a pace sample
        worker.close(unmeasured)
        stats = worker.stats
        await worker.shutdown()
        return worker, stats

    worker, stats = asyncio.run(main())
    assert 0.03 <= stats.gen_s_per_frame < 0.2 and stats.codec_s_per_frame > 0
    chosen = worker.startup_options()  # no stream open: the codec shared by the new one and one more that may follow
    expected = startup_options(decoder.options, stats.gen_s_per_frame, stats.codec_s_per_frame * 2, FRAME_S)
    assert chosen == expected
    fixed = DecodeWorker(decoder, sized_start=False)  # serve --speech-first-hop N: the options as given
    fixed.stats = stats
    assert fixed.startup_options() == decoder.options


def test_speech_part_sizes_the_start_unless_options_are_given(tmp_path):
    """`serve --speech-first-hop N` passes options: every stream starts with them; without, starts are sized."""
    from omnivox.services.parts.defaults import save_random_speech_model
    from omnivox.services.parts.speech_part import load_speech_part

    folder = save_random_speech_model(tmp_path / "speech", snac_config=dict(SNAC_24KHZ_CONFIG, encoder_dim=8,
                                                                            decoder_dim=64))  # fmt: skip
    vocab = 200_000
    assert load_speech_part(folder, vocab).worker.sized_start
    fixed = load_speech_part(folder, vocab, options=StreamingOptions(first_hop_frames=1))
    assert not fixed.worker.sized_start and fixed.worker.startup_options().first_hop_frames == 1
