"""Audio into the shared engine, everything short of gRPC: bytes -> decode -> features -> encoder worker ->
embedding segments at the placeholder run -> greedy tokens, against transformers' processor + `generate`.

This is the path the service will wire (issue 10); here it is driven directly, so the parity of every piece below
the service is proven before the wiring.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from support.audio_checkpoints import chirp, encode, make_qwen2_audio, make_qwen3_asr, noise
from support.engines import tiny_engine

from omnivox.codecs.audio_format import float_to_int16
from omnivox.codecs.audio_input import content_key, decode_audio
from omnivox.engine import EmbeddingSegment, SamplingParams
from omnivox.engine.encoder_cache import EncoderCache, EncoderWorker
from omnivox.models.audio import load_audio_encoder

STEPS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
FAMILIES = {
    "qwen2_audio": (make_qwen2_audio, transformers.Qwen2AudioForConditionalGeneration),
    "qwen3_asr": (make_qwen3_asr, transformers.Qwen3ASRForConditionalGeneration),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    make, ref_cls = FAMILIES[family]
    path = make(tmp_path_factory.mktemp(family) / family, seed=1)
    encoder = load_audio_encoder(path)
    cache = EncoderCache(budget_bytes=1 << 24)
    worker = EncoderWorker(encoder.encode, cache, name=f"audio-{family}")
    yield {
        "family": family,
        "path": path,
        "engine": tiny_engine(path),
        "encoder": encoder,
        "cache": cache,
        "worker": worker,
        "processor": transformers.AutoProcessor.from_pretrained(path),
        "reference": ref_cls.from_pretrained(path).eval(),
    }
    worker.shutdown()


def _prompt(s, question: str) -> str:
    content = [{"type": "audio"}]
    if s["family"] == "qwen2_audio":
        content.append({"type": "text", "text": question})
    messages = [{"role": "user", "content": content}]
    return s["processor"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _ours(s, data: bytes, encoding: str | None, rate: int, prompt: str):
    enc = s["encoder"]
    decoded = decode_audio(data, encoding, rate, target_rate=enc.sample_rate, limits=enc.limits)
    inputs = enc.features([decoded.samples])
    key = content_key(decoded.samples, decoded.sample_rate, enc.feature_settings(), s["path"].name)
    ids = s["processor"].tokenizer(prompt, add_special_tokens=False).input_ids
    ids, starts = enc.expand_prompt(ids, inputs.num_tokens)
    segment = EmbeddingSegment(starts[0], inputs.num_tokens[0], key=key, source=s["worker"].handle(key, inputs))
    (out,) = s["engine"].generate([ids], GREEDY, segments=[[segment]])
    return decoded, key, ids, out


def _reference(s, samples: np.ndarray, prompt: str) -> tuple[list[int], list[int]]:
    inputs = s["processor"](text=[prompt], audio=[samples], sampling_rate=16000, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "num_audio_tokens"}
    with torch.no_grad():
        out = s["reference"].generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, prompt_len:].tolist()


def test_wav_flac_linear16_greedy_tokens_equal_transformers(served):
    samples = float_to_int16(chirp(2.3) + noise(2.3, amp=0.05))
    prompt = _prompt(served, "What is this sound?")
    misses = served["cache"].misses
    results = [
        _ours(served, encode(samples, 16000, "WAV"), None, 0, prompt),
        _ours(served, encode(samples, 16000, "FLAC"), "FLAC", 0, prompt),
        _ours(served, samples.tobytes(), "LINEAR16", 16000, prompt),
    ]
    decoded, key, ids, out = results[0]
    ref_ids, ref_tokens = _reference(served, decoded.samples, prompt)
    assert ids == ref_ids  # the same prompt, placeholders expanded as the processor does
    for d, k, i, o in results:
        np.testing.assert_array_equal(d.samples, decoded.samples)
        assert (k, i) == (key, ids)
        assert o.token_ids == ref_tokens, f"{served['family']}: {o.token_ids} != {ref_tokens}"
    assert served["cache"].misses == misses + 1  # one cache entry for the three encodings
    assert served["cache"].total_refs() == 0  # every request released its reference


def test_44k_stereo_greedy_tokens_equal_transformers_on_the_resampled_audio(served):
    rate = 44100
    stereo = np.stack([chirp(1.7, rate=rate), noise(1.7, rate=rate, amp=0.1, seed=9)], axis=1)
    prompt = _prompt(served, "Describe it.")
    decoded, _, ids, out = _ours(served, encode(stereo, rate, "WAV", "FLOAT"), None, 0, prompt)
    assert (decoded.source_rate, decoded.source_channels) == (rate, 2)
    ref_ids, ref_tokens = _reference(served, decoded.samples, prompt)
    assert ids == ref_ids and out.token_ids == ref_tokens


def test_clips_of_concurrent_requests_in_one_batch(served):
    """Three requests admitted together: their clips go through the encoder in one batch; tokens as if alone."""
    prompt = _prompt(served, "And this one?")
    clips = [float_to_int16(chirp(0.8 + 0.6 * i, f0=200.0 * (i + 1))) for i in range(3)]
    enc, worker, engine = served["encoder"], served["worker"], served["engine"]
    prompts, segments, refs = [], [], []
    for pcm in clips:
        decoded = decode_audio(pcm.tobytes(), "LINEAR16", 16000, limits=enc.limits)
        inputs = enc.features([decoded.samples])
        key = content_key(decoded.samples, 16000, enc.feature_settings(), Path(served["path"]).name)
        ids, starts = enc.expand_prompt(served["processor"].tokenizer(prompt).input_ids, inputs.num_tokens)
        prompts.append(ids)
        segments.append([EmbeddingSegment(starts[0], inputs.num_tokens[0], key=key, source=worker.handle(key, inputs))])
        refs.append(_reference(served, decoded.samples, prompt)[1])
    assert len({tuple(r) for r in refs}) == 3  # the audio decides the tokens (a degenerate model would hide errors)
    # Hold the worker on a first clip until the three requests' clips are queued behind it: they then go as one batch.
    gate, entered, sizes, encode_batch = threading.Event(), threading.Event(), [], worker.encode_batch

    def gated(payloads):
        entered.set()
        gate.wait(30)
        sizes.append(len(payloads))
        return encode_batch(payloads)

    worker.encode_batch = gated
    try:
        blocker = worker.handle("blocker", enc.features([noise(0.5, seed=11)]))
        blocker.start()
        assert entered.wait(30)  # the worker holds the blocker: what comes next queues

        def release() -> None:
            deadline = time.monotonic() + 30
            while len(worker._queue) < 3 and time.monotonic() < deadline:  # the three clips queued
                time.sleep(0.01)
            gate.set()

        releaser = threading.Thread(target=release)
        releaser.start()
        outs = engine.generate(prompts, GREEDY, segments=segments)
        releaser.join()
        blocker.release()
    finally:
        worker.encode_batch = encode_batch
        gate.set()
    assert sizes == [1, 3]
    assert [o.token_ids for o in outs] == refs
