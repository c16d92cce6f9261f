"""Mimi encode (codecs/mimi_encode.py, CSM's voice references): codes == transformers' MimiModel.encode exactly, at
lengths that are and are not whole frames, batched, with fewer codebooks; a folder without the encoder is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.mimi_checkpoints import TINY_MIMI_CONFIGS, save_tiny_mimi
from transformers import MimiModel

from omnivox.codecs.mimi_encode import MimiEncoder


@pytest.fixture(scope="module", params=sorted(TINY_MIMI_CONFIGS))
def mimi(request, tmp_path_factory):
    path = save_tiny_mimi(tmp_path_factory.mktemp(request.param), request.param, seed=4)
    return path, MimiModel.from_pretrained(path).eval(), MimiEncoder.from_folder(path)


@pytest.mark.parametrize("samples", [1, 24 * 7, 24 * 50 + 5, 4000])
def test_encode_equals_transformers(mimi, samples):
    _, reference, encoder = mimi
    audio = torch.randn(2, samples, generator=torch.Generator().manual_seed(samples)) * 0.3  # (B x T)
    with torch.no_grad():
        expected = reference.encode(audio[:, None]).audio_codes  # (B x K x frames)
    codes = encoder.encode(audio)
    assert codes.shape == expected.shape == (2, reference.config.num_quantizers, -(-samples // encoder.frame_samples))
    assert torch.equal(codes, expected)
    assert len(codes.unique()) > 2  # not a collapsed quantizer
    fewer = reference.config.num_semantic_quantizers + 1
    with torch.no_grad():
        expected = reference.encode(audio[:, None], num_quantizers=fewer).audio_codes
    assert torch.equal(encoder.encode(audio, fewer), expected)
    assert torch.equal(encoder.encode(audio[1:]), codes[1:, :])  # a row alone == batched


def test_a_folder_without_the_encoder_is_refused(mimi, tmp_path):
    path, _, encoder = mimi
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("encoder.")}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks encoder"):
        MimiEncoder.from_folder(tmp_path)
    with pytest.raises(ValueError, match="codebooks"):
        encoder.encode(torch.zeros(1, 48), num_codebooks=encoder.config.num_quantizers + 1)
