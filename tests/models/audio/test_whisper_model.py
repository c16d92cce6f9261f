"""Our Whisper (models/audio/whisper.py) against transformers' WhisperForConditionalGeneration on a tiny random config.

The decoder runs through the paged KV cache the way the engine drives it: one request prefilled alone, a second one
prefilled in two chunks while the first decodes (so one step holds decode rows and prefill rows of requests with
different audio), then both decode. Every row's logits are compared with transformers' teacher-forced logits over the
same tokens, and each greedy token with transformers' argmax.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.audio.whisper import WhisperModel, load_whisper, whisper_model_config

BLOCK = 16
STEPS = 32


def tiny_whisper_config(**overrides) -> WhisperConfig:
    """d_model 64, 2 + 2 layers, 4 heads, vocab 300; 3000 mel frames (max_source_positions 1500) of 16 mel bins."""
    kw = dict(
        vocab_size=300,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        decoder_start_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        init_std=0.1,  # large enough that greedy choices are far from ties
    )
    kw.update(overrides)
    return WhisperConfig(**kw)


def save_tiny_whisper(path, seed: int = 0) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    hf = WhisperForConditionalGeneration(tiny_whisper_config()).eval()
    hf.save_pretrained(path)
    return hf


class _Seq:
    """One request of the hand-driven engine: its tokens, how many are in the cache, its blocks and cross kv."""

    def __init__(self, prompt: list[int], blocks: list[int], kv: torch.Tensor) -> None:
        self.tokens, self.computed, self.blocks, self.kv = list(prompt), 0, blocks, kv
        self.logits: dict[int, torch.Tensor] = {}  # position -> logits predicting the next token

    def slot(self, pos: int) -> int:
        return self.blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def _step(model: WhisperModel, caches, decodes: list[_Seq], prefills: list[tuple[_Seq, int]]) -> None:
    """One engine step: decode rows first (one per request), then the prefill chunks; greedy token appended to
    every request whose tokens are all in the cache after the step."""
    ids, pos, slots, cross, chunks = [], [], [], [], []
    for s in decodes:
        assert s.computed == len(s.tokens) - 1
        cross.append((len(ids), 1, s.kv))
        ids.append(s.tokens[s.computed]), pos.append(s.computed), slots.append(s.slot(s.computed))
    for s, n in prefills:
        ctx = s.computed + n
        chunks.append(PrefillChunk(len(ids), n, ctx, torch.tensor(s.blocks[: math.ceil(ctx / BLOCK)])))
        cross.append((len(ids), n, s.kv))
        for p in range(s.computed, ctx):
            ids.append(s.tokens[p]), pos.append(p), slots.append(s.slot(p))
    nd = len(decodes)
    width = max((len(s.blocks) for s in decodes), default=1)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in decodes] or [[0]])[:nd]
    lens = torch.tensor([s.computed + 1 for s in decodes], dtype=torch.long)
    mask = (torch.arange(width * BLOCK)[None, :] < lens[:, None]).view(nd, 1, 1, width * BLOCK)
    meta = AttentionMetadata(
        block_size=BLOCK,
        slot_mapping=torch.tensor(slots),
        num_decode=nd,
        decode_block_tables=tables if nd else None,
        decode_mask=mask if nd else None,
        decode_lens=lens if nd else None,
        prefills=chunks,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta, cross=cross)
        logits = model.compute_logits(hidden)
    row = 0
    for s, n in [(s, 1) for s in decodes] + prefills:
        for p in range(s.computed, s.computed + n):
            s.logits[p] = logits[row]
            row += 1
        s.computed += n
        if s.computed == len(s.tokens):
            s.tokens.append(int(s.logits[s.computed - 1].argmax()))


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
