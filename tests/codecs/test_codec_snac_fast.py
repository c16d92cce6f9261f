"""The faster convolution forms (codecs/snac_fast.py) against torch's own, and the streamed decode with them against
the float32 one-shot decode of the unmodified decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from omnivox.codecs.codec_kernels import FusedSnake, codec_kernels
from omnivox.codecs.snac import SNAC_24KHZ_CONFIG, SnacDecoder, save_random_snac
from omnivox.codecs.snac_fast import MatmulConvTranspose, ShiftedDepthwise, speed_up_convs
from omnivox.codecs.streaming import BatchedStreamDecoder

ORPHEUS_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))
SMALL_CONFIG = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
# The streamed fast decode vs the float32 one-shot reference decode: the convolutions differ at rounding level
# (~1e-7 on audio peaking near 0.03 with random weights), the C Snake by ~1e-6 per activation, the windows with one
# frame of context at ~4e-6 (3.5e-6 on the full-size random decoder).
STREAM_TOLERANCE = 1e-5


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_shifted_depthwise_matches_conv1d(dilation):
    torch.manual_seed(0)
    conv = nn.Conv1d(16, 16, 7, dilation=dilation, padding=3 * dilation, groups=16)
    x = torch.randn(2, 16, 50)
    with torch.inference_mode():
        torch.testing.assert_close(ShiftedDepthwise(conv)(x), conv(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kernel", "stride", "padding"), [(16, 8, 4), (8, 4, 2), (4, 2, 1)])
def test_matmul_conv_transpose_matches_conv_transpose1d(kernel, stride, padding):
    torch.manual_seed(0)
    conv = nn.ConvTranspose1d(1024, 8, kernel, stride=stride, padding=padding)
    assert MatmulConvTranspose.applies(conv)
    x = torch.randn(2, 1024, 6)
    with torch.inference_mode():
        torch.testing.assert_close(MatmulConvTranspose(conv)(x), conv(x), atol=1e-5, rtol=1e-4)


def test_speed_up_convs_replaces_only_what_applies():
    model = nn.Sequential(
        nn.Conv1d(8, 8, 7, padding=3, groups=8),  # depthwise: replaced
        nn.Conv1d(8, 8, 1),  # pointwise: left to oneDNN (no faster as a matmul, measured)
        nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1),  # < 1024 input channels: left alone
        nn.Conv1d(8, 8, 3, stride=2),  # strided: left alone
    )
    assert speed_up_convs(model) == 1
    assert isinstance(model[0], ShiftedDepthwise)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return save_random_snac(tmp_path_factory.mktemp("snac_small_fast"), SMALL_CONFIG, seed=3)


def test_streamed_fast_decode_within_tolerance_of_float32_one_shot(small):
    reference = SnacDecoder.from_folder(small, fast_convs=False)
    fast = SnacDecoder.from_folder(small)
    assert any(isinstance(m, ShiftedDepthwise) for m in fast.model.modules())
    assert any(isinstance(m, FusedSnake) for m in fast.model.modules())
    frames = torch.randint(0, 4096, (1, 23, 7), generator=torch.Generator().manual_seed(5))
    whole = reference.decode_frames(frames, ORPHEUS_LEVELS)[0].numpy()  # (23 * 2048,)
    streamed = BatchedStreamDecoder(fast, ORPHEUS_LEVELS).decode_all(frames[0])
    assert streamed.shape == whole.shape
    assert np.abs(whole).max() > 1e-3  # not silence
    assert np.abs(streamed - whole).max() < STREAM_TOLERANCE


def test_fused_snake_matches_snacs_snake():
    """The C kernel (where a compiler exists) and its eager fallback against snac's Snake1d, on values large enough
    for sin to wrap several times; the kernel is built wherever the tests run with a compiler."""
    from snac.layers import Snake1d

    ref = Snake1d(48)
    with torch.no_grad():
        ref.alpha.copy_(torch.rand(1, 48, 1, generator=torch.Generator().manual_seed(1)) * 2 + 0.1)
    x = torch.randn(2, 48, 1000, generator=torch.Generator().manual_seed(2)) * 4
    fused = FusedSnake(ref.alpha)
    with torch.no_grad():
        want = ref(x)
        torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused(x.double()), want.double(), atol=1e-5, rtol=1e-5)  # eager fallback
        torch.testing.assert_close(fused(x[:, :, ::2]), want[:, :, ::2], atol=1e-5, rtol=1e-5)  # a strided input
    from omnivox.models.cpu_kernels import compiler

    assert codec_kernels() is not None or compiler() is None
