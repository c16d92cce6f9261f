"""codecs/vad.py: speech-start / speech-end offsets on generated audio (tones and noise bursts between quiet
stretches), the same events whatever the chunking, clicks and steady noise ignored, long utterances cut; and two
espeak-ng sentences with a pause between them found as two utterances where espeak-ng is installed."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from support.audio_checkpoints import espeak_wav, noise, tone

from omnivox.codecs.audio_input import resample
from omnivox.codecs.vad import START_MARGIN_DB, SpeechEventKind, VadConfig, VoiceActivityDetector, frame_energies_dbfs

RATE = 16000
FRAME = 480  # 30 ms
START, END = SpeechEventKind.START, SpeechEventKind.END


def quiet(seconds: float, seed: int = 1) -> np.ndarray:
    """Room noise at about -60 dBFS."""
    return noise(seconds, amp=10 ** (-60 / 20), seed=seed)


def concat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32)


def run(samples: np.ndarray, chunks: list[int] | None = None, config: VadConfig | None = None):
    vad = VoiceActivityDetector(config)
    events, at = [], 0
    for size in chunks or [len(samples)]:
        events += vad.feed(samples[at : at + size])
        at += size
    events += vad.feed(samples[at:])
    return events + vad.flush()


def spans(events) -> list[tuple[int, int]]:
    """(start, end) offsets of each utterance, checking START/END alternate."""
    kinds = [e.kind for e in events]
    assert kinds == [START, END] * (len(kinds) // 2), kinds
    return [(a.offset, b.offset) for a, b in zip(events[::2], events[1::2], strict=True)]


def test_energy_in_dbfs():
    e = frame_energies_dbfs(tone(0.3, amp=1.0, freq=500.0), FRAME)
    assert len(e) == 10 and np.allclose(e, -3.01, atol=0.05)  # a full-scale sine is -3 dBFS
    assert frame_energies_dbfs(np.zeros(FRAME * 2, np.float32), FRAME).tolist() == [-np.inf, -np.inf]


def test_tone_and_noise_bursts_offsets_within_a_frame():
    # 1 s quiet, 1 s tone (-13 dBFS), 1.5 s quiet, 0.7 s noise burst (-26 dBFS), 1 s quiet.
    audio = concat(quiet(1.0), tone(1.0, amp=0.3), quiet(1.5, 2), noise(0.7, amp=0.05, seed=3), quiet(1.0, 4))
    events = run(audio)
    truth = [(16000, 32000), (56000, 67200)]
    got = spans(events)
    assert len(got) == 2
    for (a, b), (ta, tb) in zip(got, truth, strict=True):
        assert ta - FRAME <= a <= ta and tb <= b <= tb + FRAME, (got, truth)
    # START is decided 90 ms (3 frames) into the speech, END after 600 ms of silence.
    start, end = events[0], events[1]
    assert start.decided_at - start.offset == 3 * FRAME
    assert end.decided_at - end.offset == 20 * FRAME
    assert all(e.decided_at <= len(audio) for e in events)


def test_chunking_does_not_change_events():
    audio = concat(quiet(0.8), tone(0.6, freq=300.0, amp=0.2), quiet(0.9, 2), tone(0.4, amp=0.1), quiet(0.3, 3))
    one_shot = run(audio)
    rng = np.random.default_rng(0)
    for _ in range(3):
        chunks = rng.integers(1, 3000, size=200).tolist()
        assert run(audio, chunks) == one_shot
    assert run(audio, [1] * 5000) == one_shot
    assert len(spans(one_shot)) == 2


def test_click_and_steady_noise_are_not_speech():
    click = tone(0.05, amp=0.5)  # 50 ms < the 90 ms a start needs
    hum = noise(3.0, amp=0.003, seed=5)  # -50 dBFS steady noise: the floor follows it
    assert run(concat(quiet(1.0), click, quiet(1.0, 2), hum, quiet(0.5, 3))) == []
    # Digital silence (a muted microphone) does not drag the floor down: the room noise after it is still not speech.
    assert run(concat(quiet(1.0), np.zeros(RATE, np.float32), quiet(1.0, 2), noise(1.0, amp=0.002, seed=6))) == []


def test_one_frame_between_digital_silence_and_room_noise_does_not_drag_the_floor():
    # Speech, digital silence, then room noise starting 51 samples before a frame boundary: that frame is at about
    # -70 dBFS. Falling to it at once, the floor would put the room noise 10 dB above it: "speech" for the whole pause.
    head = concat(quiet(1.0), tone(1.0, amp=0.2))
    noise_at = (len(head) + 4800) // FRAME * FRAME + FRAME - 51
    audio = concat(head, np.zeros(noise_at - len(head), np.float32), quiet(1.5, 2), tone(1.0, amp=0.2), quiet(1.0, 3))
    assert len(spans(run(audio))) == 2


def test_short_pause_stays_inside_the_utterance():
    # A 300 ms gap (between words) does not end the utterance; 800 ms (between sentences) does.
    word = tone(0.4, amp=0.2)
    one = spans(run(concat(quiet(0.5), word, quiet(0.3, 2), word, quiet(1.0, 3))))
    two = spans(run(concat(quiet(0.5), word, quiet(0.8, 2), word, quiet(1.0, 3))))
    assert len(one) == 1 and len(two) == 2


def test_hysteresis_keeps_a_soft_tail():
    # A 300 ms tail 9 dB above the -60 dBFS floor: too soft to start an utterance (12 dB), kept inside one (6 dB).
    soft = tone(0.3, amp=10 ** (-51 / 20) * np.sqrt(2))
    [(_, end)] = spans(run(concat(quiet(1.0), tone(0.5, amp=0.2), soft, quiet(1.0, 2))))
    assert 16000 + 8000 + 4800 <= end <= 16000 + 8000 + 4800 + FRAME
    assert run(concat(quiet(1.0), soft, quiet(1.0, 2))) == []
    no_hysteresis = VadConfig(continue_margin_db=START_MARGIN_DB)
    [(_, end)] = spans(run(concat(quiet(1.0), tone(0.5, amp=0.2), soft, quiet(1.0, 2)), config=no_hysteresis))
    assert end <= 16000 + 8000 + FRAME


def test_long_utterance_is_cut_and_speech_at_sample_zero_is_heard():
    config = VadConfig(max_speech_ms=3000)
    audio = concat(tone(7.0, amp=0.2, freq=200.0), quiet(1.0))
    got = spans(run(audio, config=config))
    assert got[0][0] == 0  # the initial floor cap (-45 dBFS) lets a stream that opens with speech start at once
    assert [b - a for a, b in got[:2]] == [3000 * 16, 3000 * 16]
    assert got[1][0] == got[0][1]  # cut: the next utterance starts where the last one ended
    assert 7 * RATE - FRAME <= got[-1][1] <= 7 * RATE


def test_end_now_closes_the_utterance_and_speech_reopens():
    vad = VoiceActivityDetector()
    audio = concat(quiet(1.0), tone(2.0, amp=0.2))
    events = vad.feed(audio[:24000]) + vad.end_now() + vad.feed(audio[24000:])
    assert [e.kind for e in events] == [START, END, START]
    assert events[1].offset == events[1].decided_at == 24000 and events[2].offset == 24000
    assert vad.end_now()[0].offset == 48000 and vad.end_now() == []


def test_config_checks():
    with pytest.raises(ValueError):
        VadConfig(continue_margin_db=20.0)
    with pytest.raises(ValueError):
        VadConfig(end_silence_ms=0)


def test_espeak_sentence_pair():
    first, second = espeak_wav("The weather is nice today."), espeak_wav("Please close the window.")
    if first is None or second is None:
        pytest.skip("espeak-ng is not installed")
    clips = []
    for wav in (first, second):
        samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        clips.append(resample(samples, rate, RATE))
    gap = round(1.5 * RATE)
    audio = concat(quiet(0.5), clips[0], quiet(1.5, 2), clips[1], quiet(1.0, 3))
    starts = [round(0.5 * RATE), round(0.5 * RATE) + len(clips[0]) + gap]
    ends = [starts[0] + len(clips[0]), starts[1] + len(clips[1])]
    got = spans(run(audio, [1600] * (len(audio) // 1600)))
    assert len(got) == 2, got
    for (a, b), s, e in zip(got, starts, ends, strict=True):
        # espeak-ng's clips begin and end with a little silence of their own: offsets fall inside them, near the edges.
        assert s - FRAME <= a <= s + 0.25 * RATE and e - 0.4 * RATE <= b <= e + FRAME, (got, starts, ends)
