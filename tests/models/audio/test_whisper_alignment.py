"""Token times from the cross-attention alignment heads (models/audio/whisper_alignment.py) equal transformers'
`generate(return_token_timestamps=True)` (its `_extract_token_timestamps` over a greedy generate's cross-attentions)
on a tiny random Whisper saved with save_pretrained, whose
generation_config names alignment heads; the DTW equals transformers' `_dynamic_time_warping` path for path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.whisper_checkpoints import make_whisper
from transformers import GenerationMixin, WhisperForConditionalGeneration
from transformers.models.whisper.generation_whisper import _dynamic_time_warping

from omnivox.models.audio.whisper import load_whisper
from omnivox.models.audio.whisper_alignment import alignment_heads, cross_attention_weights, dtw, row_times

HEADS = [[0, 1], [1, 0], [1, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper") / "tiny")
    config = json.loads((path / "generation_config.json").read_text())
    config["alignment_heads"] = HEADS
    (path / "generation_config.json").write_text(json.dumps(config))
    hf = WhisperForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()  # attentions out
    return path, hf, load_whisper(str(path))


def test_dtw_is_transformers_path():
    rng = np.random.default_rng(0)
    for shape in [(1, 9), (7, 7), (12, 150), (40, 300)]:
        cost = rng.standard_normal(shape)
        ours, theirs = dtw(cost), _dynamic_time_warping(cost)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1]), shape


@pytest.mark.parametrize("frames", [3000, 1234])
def test_token_times_equal_transformers(tiny, frames: int):
    path, hf, model = tiny
    heads = alignment_heads(json.loads((path / "generation_config.json").read_text()))
    assert heads == [tuple(h) for h in HEADS]
    torch.manual_seed(frames)
    features = torch.randn(1, 16, 3000)
    mask = torch.zeros(1, 3000, dtype=torch.long)
    mask[0, :frames] = 1
    g = hf.generation_config
    prompt = [g.decoder_start_token_id, g.lang_to_id["<|en|>"], g.task_to_id["transcribe"], g.no_timestamps_token_id]
    with torch.no_grad():  # greedy, then the timestamps `generate(return_token_timestamps=True)` computes from it
        out = GenerationMixin.generate(hf, input_features=features, decoder_input_ids=torch.tensor([prompt]),
                                       max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                       output_attentions=True)  # fmt: skip
        expected = hf._extract_token_timestamps(out, g.alignment_heads, num_frames=torch.tensor([frames]),
                                                num_input_ids=len(prompt))[0].numpy()  # fmt: skip
    generated = out.sequences[0, len(prompt) :].tolist()
    cross = model.encode_cross(features)[0]  # [L, 2, H, 1500, hd]
    weights = cross_attention_weights(model, prompt + generated[:-1], cross, heads)
    assert weights.shape == (3, len(prompt) + len(generated) - 1, 1500)
    rows = row_times(weights, len(prompt), frames)
    ours = np.concatenate([np.zeros(len(prompt)), rows, rows[-1:]])
    assert len(generated) == 24 and ours.shape == expected.shape
    assert 0 < ours.max() <= frames / 100 and np.all(np.diff(ours) >= 0)  # inside the audio, in order
    # Float sums in another order may move the path by one 0.02 s frame at a near tie; most tokens agree exactly.
    np.testing.assert_allclose(ours, expected, atol=0.021)
    assert np.mean(np.isclose(ours, expected, atol=1e-6)) >= 0.9
