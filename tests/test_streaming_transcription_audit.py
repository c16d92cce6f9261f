"""StreamingTranscribe as other clients use it (Google STT / Riva style): chunk sizes, encodings and rates, the
detector's edges, result semantics, and what a call leaves behind. Real server, tiny random Whisper."""

from __future__ import annotations

import numpy as np
import pytest
from audio_checkpoints import noise, tone
from service_harness import ServerThread
from whisper_checkpoints import make_whisper

from omnivox.codecs.audio_format import float_to_int16
from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.v1 import transcription_pb2, transcription_pb2_grpc

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


def baseline(s) -> None:
    """No engine request, KV block or encoder-cache reference left behind."""
    free, total = s["server"].wait_kv_free("whisper", timeout=5.0)
    assert free == total
    assert s["part"].cache.total_refs() == 0
    s["server"].engine("whisper").check_integrity()


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
        "20 ms": [640],
        "1-byte, then odd splits": [1] * 999 + [333],  # every sample split across messages
        "100 ms": [3200],
        "1 s": [32000],
        "the whole file in one message": [len(data)],
    }
    # Events and results each in their order; how the two interleave depends on when a final pass ends.
    got = {
        name: sorted(outline(stream(served, [config(), *chunks(data, sizes)])), key=lambda x: x[0])
        for name, sizes in chunkings.items()
    }
    reference = got.pop("20 ms")
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
    baseline(served)
