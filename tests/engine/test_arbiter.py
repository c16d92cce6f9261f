"""The step arbiter across engines (engine/arbiter.py): a stream behind its playback deadline makes the other engines
yield their steps (bounded), its own engine never waits, and the decision is in the metrics, over real gRPC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.engines import tiny_checkpoint, tiny_engine
from support.service_harness import ServerThread, user_request

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.engine.arbiter import StepArbiter
from omnivox.engine.params import SamplingParams
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2_grpc, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)  # same framing, less compute


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("arbiter"), "llama")
    return tiny_engine(ckpt), tiny_engine(ckpt)


def test_a_stream_behind_its_deadline_makes_the_other_engines_yield(engines):
    speech, text = engines
    now = [100.0]
    arbiter = StepArbiter(margin_s=1.0, clock=lambda: now[0])
    deadline = arbiter.open(speech, first_audio_s=1.5)  # first audio due at 101.5: 1.5 s away, not behind yet
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="speaking")
    assert not arbiter.must_yield(text)
    now[0] = 100.6  # 0.9 s to the first-audio target: behind
    assert arbiter.must_yield(text) and not arbiter.must_yield(speech)  # its own engine steps, the others wait
    deadline.update(104.0)  # audio sent: the listener runs dry at 104
    assert not arbiter.must_yield(text)
    now[0] = 103.2
    assert arbiter.behind() == [deadline] and arbiter.must_yield(text)
    text.add_request([8, 9], SamplingParams(max_tokens=2), request_id="own-stream")
    own = arbiter.open(text, first_audio_s=0.0)  # an engine with a stream of its own behind steps too
    assert not arbiter.must_yield(text)
    own.close()
    deadline.close()
    assert not arbiter.must_yield(text) and arbiter.deadlines == []
    while speech.has_unfinished() or text.has_unfinished():
        speech.step(), text.step()


def test_a_stream_whose_engine_has_no_work_is_not_behind(engines):
    speech, text = engines
    arbiter = StepArbiter(margin_s=1.0)
    with arbiter.open(speech, first_audio_s=0.0):  # its codec finishing the tail: nothing for the engine to do
        assert not speech.has_unfinished() and not arbiter.must_yield(text)


def test_yielding_is_bounded_and_observed(engines):
    speech, text = engines
    arbiter = StepArbiter(margin_s=1.0, max_wait_s=0.05)
    seen: list[float] = []
    arbiter.yield_observers.append(lambda engine, waited: seen.append(waited))
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="bounded")
    with arbiter.open(speech, first_audio_s=0.0):
        t0 = time.monotonic()
        waited = arbiter.wait_turn(text)
        assert 0.05 <= waited < 0.5 and time.monotonic() - t0 >= 0.05  # at most max_wait_s (plus one poll)
        assert arbiter.wait_turn(speech) == 0.0
    assert arbiter.wait_turn(text) == 0.0  # closed: nothing behind
    assert seen == [waited]
    off = StepArbiter(margin_s=0.0)  # `serve --audio-first-margin 0`: nothing is ever behind
    with off.open(speech, first_audio_s=-10.0):
        assert off.behind() == [] and off.wait_turn(text) == 0.0
    while speech.has_unfinished():
        speech.step()


def test_served_text_yields_to_speech_and_metrics_say_so(tmp_path_factory):
    """A speech synthesis and four text streams at once in one server: the text engine's steps yield while the
    speech stream is behind (omnivox_arbiter_yields_total{model="text"} > 0), the speech engine's never do, and
    when all ends no deadline is left open and no stream is behind."""
    root = tmp_path_factory.mktemp("arbiter-served")
    speech_path = save_random_speech_model(root / "orpheus-random", snac_config=SMALL_SNAC)
    specs = [ModelSpec(path=speech_path, name="speech"), ModelSpec(path=tiny_checkpoint(root, "llama"), name="text")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.5  # the random decoder speaks for its whole budget: keep it short
        servicer.limits.audio_seconds_per_char = 0.02
        text_stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        speech_stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())

        def generate(i: int) -> int:
            request = user_request(f"Story {i}", model="text", max_output_tokens=200, ignore_eos=True)
            return sum(r.WhichOneof("response") == "delta" for r in text_stub.Generate(request, timeout=120))

        def speak() -> str:
            config = speech_pb2.AudioConfig(encoding=content_pb2.AudioEncoding.AUDIO_ENCODING_LINEAR16)
            request = speech_pb2.SynthesizeSpeechRequest(model="speech", text="Hello there.", audio_config=config)
            return list(speech_stub.SynthesizeSpeech(request, timeout=120))[-1].WhichOneof("response")

        with ThreadPoolExecutor(5) as pool:
            texts = [pool.submit(generate, i) for i in range(4)]
            deadline = time.monotonic() + 30
            while srv.engine("text").num_unfinished() < 4 and time.monotonic() < deadline:
                time.sleep(0.01)  # the four text streams are running when the speech starts
            assert speak() == "summary"
            assert all(t.result() > 0 for t in texts)
        sample = srv.server.metrics.registry.get_sample_value
        assert sample("omnivox_arbiter_yields_total", {"model": "text"}) > 0
        assert sample("omnivox_arbiter_yield_seconds_total", {"model": "text"}) > 0
        assert sample("omnivox_arbiter_yields_total", {"model": "speech"}) == 0
        assert sample("omnivox_audio_streams_behind", {"model": "speech"}) == 0
        assert srv.server.registry.arbiter.deadlines == []
        assert srv.wait_kv_free("text")[0] == srv.wait_kv_free("text")[1]
