"""A Piper voice (VITS, `NAME.onnx` + `NAME.onnx.json`; piper_config.py reads the format): text -> espeak-ng IPA ->
phoneme ids -> one ONNX run -> PCM at the voice's rate.

The model's inputs: `input` (1 x L) int64 ids, `input_lengths` (1,) int64, `scales` (3,) float32 = (noise_scale,
length_scale, noise_w), and `sid` (1,) int64 for a multi-speaker voice; output (1 x 1 x T) or (1 x 1 x 1 x T) float.
Speed is length_scale / speed (the duration predictor's scale); the noise scales are the config's.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import numpy as np

from omnivox.models.voice.espeak import EspeakPhonemizer
from omnivox.models.voice.onnx_session import cpu_session
from omnivox.models.voice.piper_config import PiperConfig, find_piper_voice
from omnivox.models.voice.voice_model import UnknownVoice, Utterance, VoiceSettings, clip_pcm, speakable

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")  # in the phoneme string: one model run per sentence


class PiperVoice:
    family = "piper"

    def __init__(self, path: Path, threads: int = 1) -> None:
        found = find_piper_voice(path)
        if found is None:
            raise ValueError(f"{path} is not a Piper voice (NAME.onnx next to NAME.onnx.json)")
        self.model_path, self.config_path = found
        self.config = PiperConfig.load(self.config_path)
        self.sample_rate = self.config.sample_rate
        self.language_code = self.config.language_code
        self.speaker_ids = self.config.speakers()
        self.voices = tuple(self.speaker_ids)
        self.default_voice = self.voices[0]
        self._phonemizer = EspeakPhonemizer(self.config.espeak_voice) if self.config.phoneme_type == "espeak" else None
        self.session = cpu_session(self.model_path, threads)
        names = {i.name for i in self.session.get_inputs()}
        missing = {"input", "input_lengths", "scales"} - names
        if missing:
            raise ValueError(f"{self.model_path} is not a Piper VITS model: it has no input {sorted(missing)[0]!r}")
        self._takes_sid = "sid" in names

    def check_voice(self, voice: str) -> None:
        if voice not in self.speaker_ids:
            raise UnknownVoice(voice, self.voices)

    def phonemes(self, text: str) -> str:
        if self._phonemizer is None:  # phoneme_type "text": the characters are the phonemes
            return unicodedata.normalize("NFD", speakable(text).strip())
        return self._phonemizer.phonemize(text)

    def utterances(self, text: str) -> list[Utterance]:
        out = []
        for sentence in _SENTENCE_END.split(self.phonemes(text)):
            ids = self.config.ids(sentence)
            if len(ids) > 4:  # more than start, pad ... end
                out.append(Utterance(ids, sentence))
        return out

    def render(self, utterance: Utterance, settings: VoiceSettings, rng: np.random.Generator) -> np.ndarray:
        cfg = self.config
        feed = {
            "input": np.asarray([utterance.ids], np.int64),  # (1 x L)
            "input_lengths": np.asarray([len(utterance.ids)], np.int64),
            "scales": np.asarray([cfg.noise_scale, cfg.length_scale / settings.speed, cfg.noise_w], np.float32),
        }
        if self._takes_sid:
            feed["sid"] = np.asarray([self.speaker_ids[settings.voice]], np.int64)
        (audio,) = self.session.run(None, feed)  # (1 x 1 x [1 x] T)
        return clip_pcm(audio)
