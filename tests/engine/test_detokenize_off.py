"""SamplingParams.detokenize=False: the same token ids, no text and no decoding; speech uses it for its audio codes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.engines import tiny_checkpoint, tiny_engine
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.codecs.streaming import StreamingOptions
from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import speech_request
from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tiny_checkpoint(tmp_path_factory.mktemp("detok"), "llama"))


def test_same_token_ids_and_no_text(engine):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=2)
    on = engine.generate(PROMPTS, params)
    off = engine.generate(PROMPTS, dataclasses.replace(params, detokenize=False))
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert all(o.text for o in on)  # the comparison means something: the tokens do decode to text
    assert all(o.text == "" and o.finish_reason == "length" for o in off)
    # Logprobs still come (the second run reads the prefix cache, so values agree to rounding, not bit for bit).
    lp_on = [lp.logprob for o in on for lp in o.logprobs]
    assert [lp.logprob for o in off for lp in o.logprobs] == pytest.approx(lp_on, abs=1e-4)
    # Streamed: every output carries its new ids and no text.
    engine.add_request(PROMPTS[1], dataclasses.replace(params, detokenize=False), request_id="s")
    seen: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.new_text == "" and out.text == ""
            seen += out.new_token_ids
    assert seen == on[1].token_ids


def test_stop_token_ids_still_stop(engine):
    free = engine.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free.token_ids[6]], detokenize=False)
    out = engine.generate([PROMPTS[2]], params)[0]
    assert (
        out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[6]) + 1]
    )


def test_stop_strings_need_the_text(engine):
    bad = SamplingParams(max_tokens=4, stop=["\n"], detokenize=False)
    assert [v.field for v in bad.violations(100)] == ["stop"]
    assert "detokenize=False" in bad.violations(100)[0].description
    with pytest.raises(InvalidRequest) as err:
        engine.generate([PROMPTS[0]], bad)
    assert err.value.field == "stop"
    assert [v.field for v in SamplingParams(detokenize=1).violations(100)] == ["detokenize"]  # type: ignore[arg-type]


def test_speech_audio_is_the_same_with_and_without_detokenizing(tmp_path, monkeypatch):
    snac = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    path = save_random_speech_model(tmp_path / "orpheus-random", snac_config=snac)
    options = EngineOptions(kv_cache_gib=0.02, speech_streaming=StreamingOptions(first_hop_frames=2))
    with ServerThread([ModelSpec(path=path, name="speech")], options) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.5
        servicer.limits.audio_seconds_per_char = 0.02
        made: list[SamplingParams] = []
        real_params = speech_request.segment_params  # SynthesizeSpeech's plan calls it per segment

        def params_seen(*args, **kwargs):
            made.append(real_params(*args, **kwargs))
            return made[-1]

        def synthesize() -> bytes:
            stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
            request = speech_pb2.SynthesizeSpeechRequest(
                text="Hello there. How are you?",
                audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16),
                sampling={"seed": 5},
            )
            responses = list(stub.SynthesizeSpeech(request, timeout=120))
            return b"".join(r.audio.data for r in responses if r.WhichOneof("response") == "audio")

        monkeypatch.setattr(speech_request, "segment_params", params_seen)
        skipped = synthesize()
        assert made and all(p.detokenize is False for p in made)  # the speech path asks for ids only
        monkeypatch.setattr(
            speech_request,
            "segment_params",
            lambda *a, **k: dataclasses.replace(real_params(*a, **k), detokenize=True),
        )
        decoded = synthesize()
    assert len(skipped) > 0 and skipped == decoded


def test_speech_step_benchmark_runs_and_compares_the_same_tokens(tmp_path):
    from omnivox.benchmarks import speech_step

    out = tmp_path / "step.json"
    speech_step.main(["--streams", "2", "--frames", "3", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["identical_token_ids"] is True and result["steps_per_run"] >= 3
    assert set(result["median_step_ms"]) == {"detokenize", "token_ids_only"}
