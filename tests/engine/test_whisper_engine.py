"""Encoder-decoder requests in the engine: a tiny random Whisper served by our engine equals transformers' `generate`
(greedy, 32 steps) batched with other requests; prefix caching keyed by the audio; cross-attention state released."""

from __future__ import annotations

import time

import pytest
import torch
from support.engines import tiny_engine
from transformers import GenerationMixin, WhisperConfig, WhisperForConditionalGeneration

from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.engine.encoder_cache import EncoderCache, EncoderWorker
from omnivox.engine.request import EncoderInput

N_MELS, VOCAB, STEPS = 16, 96, 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=N_MELS,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=64,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger random weights: distinct greedy tokens instead of one repeated id
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("whisper")
    model.save_pretrained(path)
    return path, model


def features(seed: int) -> torch.Tensor:  # [n_mels, 3000] log-mel-like input
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N_MELS, 3000, generator=g)


def hf_greedy(model, feats: torch.Tensor, prompt: list[int], n: int = STEPS) -> list[int]:
    """transformers' own generate (GenerationMixin's: no Whisper prompt logic, no suppression) from `prompt`."""
    with torch.no_grad():
        out = GenerationMixin.generate(
            model,
            input_features=feats[None],
            decoder_input_ids=torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def test_greedy_equals_transformers_generate_batched_with_other_requests(ckpt):
    path, hf = ckpt
    engine = tiny_engine(path, max_num_batched_tokens=7)  # prompts split over chunks, decodes batched with prefills
    model = engine.model
    assert model.is_encoder_decoder
    prompts = [[1, 5, 9, 3], [1, 7], [1, 5, 9, 3, 11, 12, 40, 41, 42, 43]]
    feats = [features(0), features(1), features(0)]
    cross = [model.encode_cross(f[None].to(engine.device))[0] for f in feats]
    outs = engine.generate(prompts, GREEDY, encoder_inputs=[EncoderInput.from_tensor(c) for c in cross])
    for out, f, p in zip(outs, feats, prompts, strict=True):
        assert out.token_ids == hf_greedy(hf, f, p)
    engine.check_integrity()


def test_prefix_cache_is_keyed_by_the_audio_and_state_is_released(ckpt):
    path, hf = ckpt
    engine = tiny_engine(path)
    model = engine.model
    worker = EncoderWorker(model.encode_cross, EncoderCache(64 * 2**20), name="test-whisper")
    try:
        prompt = [1] + list(range(10, 50))  # more than two full blocks of 16
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = []
        for seed in (0, 1, 0):
            key = f"audio-{seed}"
            handle = worker.handle(key, features(seed).to(engine.device))
            outs.append(engine.generate([prompt], params, encoder_inputs=[EncoderInput(key, handle)])[0])
        assert outs[0].num_cached_tokens == 0
        assert outs[1].num_cached_tokens == 0  # same prompt, other audio: its decoder states differ, no hit
        assert outs[2].num_cached_tokens == 32 and outs[2].token_ids == outs[0].token_ids
        assert outs[0].token_ids == hf_greedy(hf, features(0), prompt, 8)
        assert outs[1].token_ids == hf_greedy(hf, features(1), prompt, 8)
        assert worker.num_encoded == 2  # the first audio's cross K/V came from the encoder cache the second time
        assert worker.cache.total_refs() == 0  # every request released its reference
        engine.check_integrity()
    finally:
        worker.shutdown()


def test_abort_and_a_failed_encoder_release_everything_and_the_engine_keeps_serving(ckpt):
    path, _ = ckpt
    engine = tiny_engine(path)
    model = engine.model

    def encode(batch):
        if any(f.shape[-1] != 3000 for f in batch):
            raise ValueError("bad features")
        return model.encode_cross(torch.stack(list(batch)))

    worker = EncoderWorker(encode, EncoderCache(64 * 2**20), name="test-whisper-fail")
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        good = engine.add_request([1, 5], params, encoder_input=EncoderInput("a", worker.handle("a", features(0))))
        bad = engine.add_request(
            [1, 5], params, encoder_input=EncoderInput("b", worker.handle("b", torch.zeros(16, 9)))
        )
        finals = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the encoder worker runs on its own thread: step until both end
            time.sleep(0.005)
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            if len(engine.scheduler.running) and good not in finals and engine.num_steps > 3:
                engine.abort(good)
            if not engine.has_unfinished():
                break
        assert finals[bad].finish_reason == "error"
        assert finals[good].finish_reason == "abort"
        assert worker.cache.total_refs() == 0
        engine.check_integrity()
        usage = engine.pool.usage()
        assert usage.free_blocks == usage.total_blocks
        # The engine still serves after both.
        ok = engine.generate(
            [[1, 5]], params, encoder_inputs=[EncoderInput.from_tensor(model.encode_cross(features(2)[None])[0])]
        )
        assert len(ok[0].token_ids) == 20
    finally:
        worker.shutdown()


def test_requests_without_audio_are_refused_naming_the_field(ckpt):
    path, _ = ckpt
    engine = tiny_engine(path)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([1, 5], GREEDY)
    assert e.value.field == "encoder_input"
    assert engine.num_unfinished() == 0
