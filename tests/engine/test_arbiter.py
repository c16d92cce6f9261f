"""The step arbiter across engines (engine/arbiter.py): a stream behind its deadline makes the other engines yield
their steps (bounded) and cut their prompt chunks, an engine with a stream of its own behind (speech or a
transcription) never waits, one whose streams are all ahead yields to another's behind, a stream with no work in its engine (a streamed-text synthesis waiting for its next clause) is not
behind, and the decisions are in the metrics, over real gRPC."""

from __future__ import annotations

import threading
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
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("arbiter"), "llama")


@pytest.fixture(scope="module")
def engines(ckpt):
    return tiny_engine(ckpt), tiny_engine(ckpt)


def drain(*engines) -> None:
    while any(e.has_unfinished() for e in engines):
        for e in engines:
            e.step()


def test_a_stream_behind_its_deadline_makes_the_other_engines_yield(engines):
    speech, text = engines
    now = [100.0]
    arbiter = StepArbiter(margin_s=1.0, clock=lambda: now[0])
    deadline = arbiter.open(speech, due_in_s=1.5)  # first audio due at 101.5: 1.5 s away, not behind yet
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="speaking")
    assert not arbiter.must_yield(text)
    now[0] = 100.6  # 0.9 s to the first-audio target: behind
    assert arbiter.must_yield(text) and not arbiter.must_yield(speech)  # its own engine steps, the others wait
    deadline.update(104.0)  # audio sent: the listener runs dry at 104
    assert not arbiter.must_yield(text)
    now[0] = 103.2
    assert arbiter.behind() == [deadline] and arbiter.must_yield(text)
    text.add_request([8, 9], SamplingParams(max_tokens=2), request_id="own-stream")
    own = arbiter.open(text, due_in_s=0.0)  # an engine with a stream of its own behind steps too
    assert not arbiter.must_yield(text)
    own.close()
    deadline.close()
    assert not arbiter.must_yield(text) and arbiter.deadlines == []
    drain(speech, text)


def test_the_nearest_deadline_steps_first_between_audio_engines(engines, ckpt):
    """Speech behind, a transcription on time on a second engine: the transcription's engine yields to the speech
    too, until its own pass is within the margin of its due time (RTF 1 of its clip); then it steps, as does the
    speech engine, its stream behind too (an engine with a stream of its own behind never yields), and the text
    engine yields to both. Before, an engine serving any audio never yielded: mixed_load measured whisper-base, at RTF
    0.12 on 6 s clips, taking 25 % of the server's CPU while both speech streams ran at RTF 2.1."""
    speech, whisper = engines
    text = tiny_engine(ckpt)
    now = [50.0]
    arbiter = StepArbiter(margin_s=1.0, clock=lambda: now[0])
    speaking = arbiter.open(speech, due_in_s=0.5)  # behind from the start
    transcribing = arbiter.open(whisper, due_in_s=6.0)  # a 6 s clip, due at RTF 1: 56.0
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="speech")
    whisper.add_request([5, 6], SamplingParams(max_tokens=2), request_id="transcription")
    text.add_request([8, 9], SamplingParams(max_tokens=2), request_id="text")
    assert arbiter.behind() == [speaking]
    assert arbiter.serves_audio(whisper) and not arbiter.serves_audio(text)
    assert (arbiter.must_yield(speech), arbiter.must_yield(whisper), arbiter.must_yield(text)) == (False, True, True)
    assert arbiter.behind_for(text) == [speaking] and arbiter.behind_for(whisper) == [speaking]
    now[0] = 55.5  # the transcription is due within the margin: behind too, and its engine steps
    assert arbiter.behind() == [speaking, transcribing] and arbiter.behind_for(text) == [speaking, transcribing]
    assert (arbiter.must_yield(speech), arbiter.must_yield(whisper), arbiter.must_yield(text)) == (False, False, True)
    speaking.update(60.0)  # speech audio sent: its listener runs dry 4.5 s from now, the transcription goes first
    assert arbiter.behind() == [transcribing]
    assert (arbiter.must_yield(speech), arbiter.must_yield(whisper), arbiter.must_yield(text)) == (True, False, True)
    speaking.close()
    assert arbiter.behind_for(text) == [transcribing] and arbiter.must_yield(speech)
    transcribing.close()
    drain(speech, whisper, text)
    assert not arbiter.must_yield(text) and not arbiter.must_yield(whisper)


def test_a_streamed_text_synthesis_waiting_for_its_next_clause_is_not_behind(engines):
    """Two streams on one speech engine: one speaking, one whose client has not sent its next text (its deadline long
    past). Only the speaking one is behind; before, the waiting one counted as behind (its engine had work, the other
    stream's) and held every text step back for as long as its client paused."""
    speech, text = engines
    now = [10.0]
    arbiter = StepArbiter(margin_s=1.0, clock=lambda: now[0])
    generating = {"waiting": False, "speaking": True}
    waiting = arbiter.open(speech, due_in_s=-5.0, working=lambda: generating["waiting"])
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="speaking")
    text.add_request([8, 9], SamplingParams(max_tokens=2), request_id="text")
    assert arbiter.behind() == [] and not arbiter.must_yield(text)  # the engine has work, the stream has none
    assert not arbiter.serves_audio(speech)  # a stream without work: its engine serves no audio now
    speaking = arbiter.open(speech, due_in_s=0.5, working=lambda: generating["speaking"])
    assert arbiter.behind() == [speaking] and arbiter.must_yield(text)
    generating["speaking"] = False  # both wait for their clients: nothing is behind
    assert arbiter.behind() == [] and not arbiter.must_yield(text) and not arbiter.serves_audio(speech)
    generating["waiting"] = True  # its next clause came: now it is behind
    assert arbiter.behind() == [waiting] and arbiter.must_yield(text)
    waiting.close(), speaking.close()
    drain(speech, text)


def test_a_text_step_while_audio_is_behind_carries_a_cut_prompt(ckpt, engines):
    """The engine's own loop: another engine's stream behind for the whole run (a bounded wait each step), a 40-token
    prompt on a text engine whose steps take 32 tokens: every prompt chunk is the budget's behind_prefill_tokens (16),
    then the same prompt alone takes 32-token chunks."""
    speech, _ = engines
    text = tiny_engine(ckpt, max_num_batched_tokens=32)
    arbiter = StepArbiter(margin_s=1.0, max_wait_s=0.001)
    text.arbiter = arbiter
    chunks: list[int] = []
    text.step_observers.append(lambda result: chunks.extend(c.num_tokens for c in result.plan.prefills))
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="speech-behind")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    try:
        text.start()
        with arbiter.open(speech, due_in_s=-1.0):
            text.generate([list(range(3, 43))], params)
        behind, chunks[:] = list(chunks), []
        text.generate([list(range(43, 83))], params)  # nothing behind: the whole step's budget
    finally:
        text.shutdown()
    assert behind == [16, 16, 8] and chunks == [32, 8]
    text.check_integrity()
    drain(speech)


def test_a_stream_whose_engine_has_no_work_is_not_behind(engines):
    speech, text = engines
    arbiter = StepArbiter(margin_s=1.0)
    with arbiter.open(speech, due_in_s=0.0):  # its codec finishing the tail: nothing for the engine to do
        assert not speech.has_unfinished() and not arbiter.must_yield(text)


def test_yielding_is_bounded_and_observed(engines):
    speech, text = engines
    arbiter = StepArbiter(margin_s=1.0, max_wait_s=0.05)
    seen: list[float] = []
    arbiter.yield_observers.append(lambda engine, waited: seen.append(waited))
    speech.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="bounded")
    with arbiter.open(speech, due_in_s=0.0):
        t0 = time.monotonic()
        waited = arbiter.wait_turn(text)
        assert 0.05 <= waited < 0.5 and time.monotonic() - t0 >= 0.05  # at most max_wait_s (plus one poll)
        assert arbiter.wait_turn(speech) == 0.0
    assert arbiter.wait_turn(text) == 0.0  # closed: nothing behind
    assert seen == [waited]
    off = StepArbiter(margin_s=0.0)  # `serve --audio-first-margin 0`: nothing is ever behind
    with off.open(speech, due_in_s=-10.0):
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


def test_served_transcription_is_audio_text_yields_to_it_and_it_never_yields(tmp_path_factory):
    """Text, speech and Whisper in one server, the arbiter's margin wide (every audio stream with work is behind).
    A Transcribe beside text streams makes the text engine yield (its pass is an audio stream due in its clip's
    seconds: services/calls/whisper.py; before, it held no deadline); beside a speech synthesis too, the whisper
    engine never yields (before, it yielded every step to the speech: mixed_load's transcription RTF 1.83 -> 4.35)."""
    from support.audio_checkpoints import chirp, encode
    from support.whisper_checkpoints import make_whisper

    from omnivox.v1 import transcription_pb2, transcription_pb2_grpc

    root = tmp_path_factory.mktemp("arbiter-asr")
    specs = [
        ModelSpec(path=save_random_speech_model(root / "orpheus-random", snac_config=SMALL_SNAC), name="speech"),
        ModelSpec(path=tiny_checkpoint(root, "llama"), name="text"),
        ModelSpec(path=make_whisper(root / "whisper"), name="whisper"),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as srv:
        srv.server.registry.arbiter.margin_s = 1e6
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.5
        servicer.limits.audio_seconds_per_char = 0.02
        text_stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        speech_stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        asr_stub = transcription_pb2_grpc.TranscriptionServiceStub(srv.channel())
        sample = srv.server.metrics.registry.get_sample_value
        audio = content_pb2.AudioPart(data=encode(chirp(1.0), 16000, "WAV", "FLOAT"))

        def generate(i: int) -> int:
            request = user_request(f"Story {i}", model="text", max_output_tokens=200, ignore_eos=True)
            return sum(r.WhichOneof("response") == "delta" for r in text_stub.Generate(request, timeout=120))

        def transcribe() -> str:
            request = transcription_pb2.TranscribeRequest(model="whisper", audio=audio, language="en", temperature=0.0)
            return list(asr_stub.Transcribe(request, timeout=120))[-1].WhichOneof("response")

        def speak() -> str:
            config = speech_pb2.AudioConfig(encoding=content_pb2.AudioEncoding.AUDIO_ENCODING_LINEAR16)
            request = speech_pb2.SynthesizeSpeechRequest(model="speech", text="Hello there.", audio_config=config)
            return list(speech_stub.SynthesizeSpeech(request, timeout=120))[-1].WhichOneof("response")

        def running(model: str, n: int) -> None:
            deadline = time.monotonic() + 30
            while srv.engine(model).num_unfinished() < n and time.monotonic() < deadline:
                time.sleep(0.005)

        with ThreadPoolExecutor(6) as pool:
            texts = [pool.submit(generate, i) for i in range(3)]
            running("text", 3)
            assert transcribe() == "summary"
            yielded_to_asr = sample("omnivox_arbiter_yields_total", {"model": "text"})
            spoken = pool.submit(speak)
            running("speech", 1)
            while not spoken.done():
                assert transcribe() == "summary"
            assert spoken.result() == "summary" and all(t.result() > 0 for t in texts)
        assert yielded_to_asr > 0
        assert sample("omnivox_arbiter_yields_total", {"model": "whisper"}) == 0
        assert sample("omnivox_arbiter_yields_total", {"model": "speech"}) == 0
        assert srv.server.registry.arbiter.deadlines == []
        for model in ("text", "whisper", "speech"):
            free, total = srv.wait_kv_free(model)
            assert free == total, model


def test_served_streamed_text_waiting_for_its_client_is_not_behind(tmp_path_factory):
    """A StreamingSynthesizeSpeech speaks its first clause, then its client pauses; a SynthesizeSpeech runs on the
    same engine meanwhile, the margin wide. The paused stream's deadline stays open and passes, yet it is never
    behind (its clause is spoken: no engine work of its own); the synthesis is. Before, any request on the engine
    made every open stream of it count, so the pause held text back."""
    root = tmp_path_factory.mktemp("arbiter-stream")
    spec = ModelSpec(path=save_random_speech_model(root / "orpheus-random", snac_config=SMALL_SNAC), name="speech")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.02)) as srv:
        arbiter = srv.server.registry.arbiter
        arbiter.margin_s = 1e6
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.5
        servicer.limits.audio_seconds_per_char = 0.02
        stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        first_audio, resume = threading.Event(), threading.Event()
        linear16 = speech_pb2.AudioConfig(encoding=content_pb2.AudioEncoding.AUDIO_ENCODING_LINEAR16)

        def requests():
            yield speech_pb2.StreamingSynthesizeSpeechRequest(config=speech_pb2.StreamingSpeechConfig(
                model="speech", audio_config=linear16))  # fmt: skip
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text="Hello there.")
            resume.wait(60)
            yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

        def stream() -> str:
            last = None
            for response in stub.StreamingSynthesizeSpeech(requests(), timeout=120):
                last = response.WhichOneof("response")
                if last == "audio":
                    first_audio.set()
            return last

        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream)
            assert first_audio.wait(60)
            while srv.engine("speech").has_unfinished():  # the first clause's tail
                time.sleep(0.005)
            (paused,) = arbiter.deadlines
            until = time.monotonic() + 30
            while paused in arbiter.behind() and time.monotonic() < until:  # its codec's tail (AudioStream.decoding)
                time.sleep(0.005)
            request = speech_pb2.SynthesizeSpeechRequest(model="speech", text="Hello there.", audio_config=linear16)
            spoken = pool.submit(lambda: list(stub.SynthesizeSpeech(request, timeout=120))[-1].WhichOneof("response"))
            seen_behind: list[list] = []
            while not spoken.done():
                seen_behind.append(arbiter.behind())
                time.sleep(0.002)
            assert spoken.result() == "summary"
            resume.set()
            assert streamed.result() == "summary"
        assert any(behind for behind in seen_behind)  # the synthesis was behind while it generated
        assert all(paused not in behind for behind in seen_behind)
        assert arbiter.deadlines == []
