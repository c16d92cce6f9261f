"""SnacDecoder against the `snac` package's own decode, on random weights saved in the published format."""

from __future__ import annotations

import pytest
import torch
from snac import SNAC
from snac.layers import NoiseBlock

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.snac_frames import codes_to_frames, frames_to_codes
from omnivox.codecs.snac_noise import PositionalNoise

ORPHEUS_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))
# The 24 kHz shape with narrow channels: same rates, framing and receptive field, a fraction of the compute.
SMALL_CONFIG = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)


@pytest.fixture(scope="module")
def snac24(tmp_path_factory):
    return save_random_snac(tmp_path_factory.mktemp("snac24"), seed=0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return save_random_snac(tmp_path_factory.mktemp("snac_small"), SMALL_CONFIG, seed=1)


def random_codes(batch: int, frames: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (batch, frames * n), generator=g) for n in (1, 2, 4)]


class ReplayGlobalNoise:
    """The noise `snac` draws: torch.randn((B, 1, T)) per noise block, in order, after torch.manual_seed(seed)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, layer, start_steps, num_steps, dtype, device):
        return torch.randn((start_steps.shape[0], 1, num_steps), generator=self.gen).to(dtype)


def test_published_24khz_shape_decodes_like_snac_with_its_noise(snac24):
    """Same weights, same codes, the same noise draws: our folded-weight decoder == SNAC.decode."""
    ref = SNAC.from_pretrained(str(snac24)).eval()
    assert ref.hop_length == 512 and ref.vq_strides == [4, 2, 1]
    codes = random_codes(2, 3)
    torch.manual_seed(1234)
    with torch.inference_mode():
        expected = ref.decode(codes)[:, 0]
    ours = SnacDecoder.from_folder(snac24, noise=ReplayGlobalNoise(1234))
    got = ours.decode(codes)
    assert got.shape == (2, 3 * 2048) == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    assert expected.abs().max() > 1e-3  # not a silent decoder


def test_noise_off_equals_snac_with_zero_noise_gain(small):
    ref = SNAC.from_pretrained(str(small)).eval()
    for m in ref.modules():
        if isinstance(m, NoiseBlock):  # weight norm magnitude 0 -> the noise term vanishes
            m.linear.parametrizations.weight.original0.data.zero_()
    codes = random_codes(1, 4, seed=3)
    with torch.inference_mode():
        expected = ref.decode(codes)[:, 0]
    got = SnacDecoder.from_folder(small, noise="off").decode(codes)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    # and the noise does something
    noisy = SnacDecoder.from_folder(small).decode(codes)
    assert (noisy - got).abs().max() > 1e-4


def test_legacy_weight_norm_names_load_to_the_same_decoder(tmp_path, small):
    legacy = save_random_snac(tmp_path / "legacy", SMALL_CONFIG, seed=1, legacy_weight_norm=True)
    sd = torch.load(legacy / "pytorch_model.bin", weights_only=True)
    assert any(k.endswith("weight_g") for k in sd) and not any("parametrizations" in k for k in sd)
    codes = random_codes(1, 2)
    a = SnacDecoder.from_folder(small).decode(codes)
    b = SnacDecoder.from_folder(legacy).decode(codes)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_decoding_is_deterministic_and_window_invariant(small):
    """Positional noise: decoding frames [s, e) placed at start frame s reproduces the whole decode there."""
    dec = SnacDecoder.from_folder(small)
    frames = codes_to_frames(random_codes(1, 12, seed=5), ORPHEUS_LEVELS)  # (1 x 12 x 7)
    full = dec.decode_frames(frames, ORPHEUS_LEVELS)[0]
    again = dec.decode_frames(frames, ORPHEUS_LEVELS)[0]
    assert torch.equal(full, again)
    s, e = 3, 11  # two frames of context on each side of frames [5, 9)
    window = dec.decode_frames(frames[:, s:e], ORPHEUS_LEVELS, torch.tensor([s]))[0]
    torch.testing.assert_close(window[2 * 2048 : 6 * 2048], full[5 * 2048 : 9 * 2048], atol=1e-6, rtol=0)
    # A different noise seed is a different (deterministic) signal.
    other = SnacDecoder.from_folder(small, noise_seed=7).decode_frames(frames, ORPHEUS_LEVELS)[0]
    assert (other - full).abs().max() > 1e-5


def test_batched_windows_equal_each_decoded_alone(small):
    dec = SnacDecoder.from_folder(small)
    g = torch.Generator().manual_seed(9)
    windows = [
        (torch.randint(0, 4096, (5, 7), generator=g), 0),
        (torch.randint(0, 4096, (5, 7), generator=g), 17),
        (torch.randint(0, 4096, (3, 7), generator=g), 2),  # another length: its own pass
        (torch.randint(0, 4096, (5, 7), generator=g), 4),
    ]
    batched = dec.decode_windows(windows, ORPHEUS_LEVELS)
    for (frames, start), audio in zip(windows, batched, strict=True):
        alone = dec.decode_frames(frames[None], ORPHEUS_LEVELS, torch.tensor([start]))[0]
        assert audio.shape == (frames.shape[0] * 2048,)
        torch.testing.assert_close(audio, alone, atol=1e-6, rtol=0)


def test_frames_codes_round_trip_and_orpheus_level_order():
    frames = torch.arange(2 * 3 * 7).reshape(2, 3, 7)
    codes = frames_to_codes(frames, ORPHEUS_LEVELS)
    assert [c.shape for c in codes] == [(2, 3), (2, 6), (2, 12)]
    assert codes[1][0, :4].tolist() == [1, 4, 8, 11]  # frame 0 positions 1, 4 then frame 1 positions 1, 4
    assert codes[2][0, :4].tolist() == [2, 3, 5, 6]
    assert torch.equal(codes_to_frames(codes, ORPHEUS_LEVELS), frames)


def test_bad_codes_are_rejected(small):
    dec = SnacDecoder.from_folder(small)
    codes = random_codes(1, 2)
    codes[2][0, 3] = 4096
    with pytest.raises(ValueError, match="level 2"):
        dec.decode(codes)
    with pytest.raises(ValueError, match="expected shape"):
        dec.decode([codes[0], codes[1], codes[2][:, :-1]])
    with pytest.raises(FileNotFoundError, match="config.json"):
        SnacDecoder.from_folder(small.parent)


def test_positional_noise_is_standard_normal_and_position_keyed():
    noise = PositionalNoise(seed=0)
    a = noise(0, torch.tensor([0]), 200_000, torch.float32, torch.device("cpu"))[0, 0]
    assert abs(float(a.mean())) < 0.01 and abs(float(a.std()) - 1) < 0.01
    b = noise(0, torch.tensor([1000]), 50, torch.float32, torch.device("cpu"))[0, 0]
    assert torch.equal(a[1000:1050], b)
    c = noise(1, torch.tensor([1000]), 50, torch.float32, torch.device("cpu"))[0, 0]
    assert not torch.equal(b, c)  # each layer has its own noise
