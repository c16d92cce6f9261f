"""Our Whisper (models/audio/whisper.py) against transformers' WhisperForConditionalGeneration on a tiny random config.

The decoder runs through the paged KV cache the way the engine drives it: one request prefilled alone, a second one
prefilled in two chunks while the first decodes (so one step holds decode rows and prefill rows of requests with
different audio), then both decode. Every row's logits are compared with transformers' teacher-forced logits over the
same tokens, and each greedy token with transformers' argmax.
"""

from __future__ import annotations

import pytest
import torch
from support.whisper_checkpoints import BLOCK, _Seq, _step, save_tiny_whisper

from omnivox.models.audio.whisper import load_whisper, whisper_model_config

STEPS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    hf = save_tiny_whisper(path)
    return path, hf, load_whisper(str(path))


def test_config_view(tiny):
    _, hf, model = tiny
    cfg = model.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("whisper", 2, 4, 4, 16)
    assert (cfg.max_model_len, cfg.vocab_size, cfg.eos_token_ids, cfg.tie_word_embeddings) == (64, 300, (1,), True)
    assert whisper_model_config(hf.config, max_model_len=20).max_model_len == 20
    assert (model.num_frames, model.encoder_len, model.num_mel_bins, model.is_encoder_decoder) == (3000, 1500, 16, True)


def test_encoder_and_greedy_decode_match_transformers(tiny):
    _, hf, model = tiny
    torch.manual_seed(1)
    features = torch.randn(2, 16, 3000)
    with torch.no_grad():
        ref_states = hf.model.encoder(features).last_hidden_state
        states = model.encode(features)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=0)
    kvs = model.encode_cross(features)
    assert kvs[0].shape == (2, 2, 4, 1500, 16)
    torch.testing.assert_close(torch.stack(model.encode_cross(list(features))), torch.stack(kvs))

    caches = [(torch.zeros(7 * BLOCK, 4, 16), torch.zeros(7 * BLOCK, 4, 16)) for _ in range(2)]
    a = _Seq([2, 10, 11, 12], [0, 1, 2], kvs[0])
    b = _Seq([2, 40, 7, 99], [5, 3, 4], kvs[1])  # blocks out of order: the block table is what counts
    _step(model, caches, [], [(a, 4)])
    _step(model, caches, [a], [(b, 2)])  # one step: a decode row of `a`, a prefill chunk of `b`
    _step(model, caches, [a], [(b, 2)])
    while len(b.tokens) < 4 + STEPS:
        _step(model, caches, [s for s in (a, b) if len(s.tokens) < 4 + STEPS], [])
    assert a.tokens != b.tokens
    for i, s in enumerate((a, b)):
        with torch.no_grad():
            ref = hf(input_features=features[i : i + 1], decoder_input_ids=torch.tensor([s.tokens[:-1]])).logits[0]
        ours = torch.stack([s.logits[p] for p in range(len(s.tokens) - 1)])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        assert s.tokens[4:] == ref[3:].argmax(-1).tolist()  # greedy: every generated token is transformers' argmax


def test_load_weights_fails_on_missing_and_unknown(tiny):
    path, _, model = tiny
    from omnivox.models.audio.whisper import build_whisper
    from omnivox.models.checkpoint import iter_checkpoint_tensors

    fresh = build_whisper(model.config.hf_config, "cpu", torch.float32)
    tensors = list(iter_checkpoint_tensors(path, part=None))
    with pytest.raises(ValueError, match="lacks"):
        fresh.load_weights([t for t in tensors if "encoder_attn.v_proj.weight" not in t[0]])
    with pytest.raises(ValueError, match="no place"):
        fresh.load_weights(tensors + [("model.decoder.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="no bias"):
        fresh.load_weights(tensors + [("model.decoder.layers.0.self_attn.k_proj.bias", torch.zeros(64))])


@pytest.mark.parametrize("frames", [1000, 1500])
def test_short_window_matches_transformers_on_the_same_frames(tiny, frames):
    """A 10 s (or 15 s) window: the first `frames` mel frames, the first frames / 2 positions. transformers' encoder
    takes only 3000 frames, so the reference is its WhisperEncoder built with max_source_positions = frames / 2 and
    the checkpoint's position table cut to that; its decoder then runs over those states (encoder_outputs)."""
    from transformers.modeling_outputs import BaseModelOutput
    from transformers.models.whisper.modeling_whisper import WhisperEncoder as HFWhisperEncoder

    _, hf, model = tiny
    short_cfg = hf.config.__class__(**{**hf.config.to_dict(), "max_source_positions": frames // 2})
    ref_encoder = HFWhisperEncoder(short_cfg).eval()
    state = hf.model.encoder.state_dict()
    state["embed_positions.weight"] = state["embed_positions.weight"][: frames // 2]
    ref_encoder.load_state_dict(state)
    torch.manual_seed(2)
    features = torch.randn(1, 16, frames)
    with torch.no_grad():
        ref_states = ref_encoder(features).last_hidden_state  # [1, frames / 2, 64]
        states = model.encode(features)
    assert states.shape == (1, frames // 2, 64)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=0)

    kv = model.encode_cross(features)[0]  # [2, 2, 4, frames / 2, 16]
    caches = [(torch.zeros(4 * BLOCK, 4, 16), torch.zeros(4 * BLOCK, 4, 16)) for _ in range(2)]
    seq = _Seq([2, 10, 11, 12], [0, 1], kv)
    _step(model, caches, [], [(seq, 4)])
    while len(seq.tokens) < 4 + 8:
        _step(model, caches, [seq], [])
    with torch.no_grad():
        ref = hf(encoder_outputs=BaseModelOutput(last_hidden_state=ref_states),
                 decoder_input_ids=torch.tensor([seq.tokens[:-1]])).logits[0]  # fmt: skip
    ours = torch.stack([seq.logits[p] for p in range(len(seq.tokens) - 1)])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert seq.tokens[4:] == ref[3:].argmax(-1).tolist()


def test_window_checks_and_choice(tiny):
    from omnivox.models.audio.whisper import short_window_frames

    _, _, model = tiny
    for bad in ((1, 16, 3001), (1, 16, 999), (1, 8, 1000), (16, 1000)):
        with pytest.raises(ValueError, match="must be"):
            model.encode(torch.zeros(bad))
    assert short_window_frames(16000 * 5, 10.0, 2.0, 3000) == 1000  # 5 s ends 5 s before a 10 s window
    assert short_window_frames(16000 * 9, 10.0, 2.0, 3000) == 3000  # too close to its end: the full window
    assert short_window_frames(16000 * 9, 15.0, 2.0, 3000) == 1500
    assert short_window_frames(16000 * 5, 30.0, 2.0, 3000) == 3000
