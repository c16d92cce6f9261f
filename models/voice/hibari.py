"""hibari-tts (Apache-2.0): an English voice distilled from Kokoro-82M's "heart", 6.2 M parameters, int8 ONNX, 24 kHz.

The package is unpacked from its sha256-pinned wheel into the model cache (services/parts/defaults.py) and imported from
there under a private name (`_omnivox_hibari`, so an installed `hibari` is never shadowed nor used). We use three of
its pieces: the grapheme-to-phoneme step (misaki lexicons + small OOV networks, no espeak), the ONNX session and the
host-side signal processing (dsp.synth: the network predicts spectra, numpy turns them into a waveform).

Only "heart" ships in the wheel. hibari fetches its other voices from a model hub on first use
(`hibari.voices.voice_path`); we never call that: the session is opened on the bundled file by path, and asking
for another voice raises VoiceNeedsDownload naming it.

Measured here (2 shared cores, AVX-512 host): 7.1 s of speech from two sentences in 0.09-0.15 s (RTF 0.012-0.022),
G2P ~1 ms a sentence after a one-off 1.0 s load of its lexicons (done at load, not on the first request).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

from omnivox.models.voice.voice_model import (
    UnknownVoice,
    Utterance,
    VoiceNeedsDownload,
    VoiceSettings,
    clip_pcm,
    speakable,
)

PACKAGE = "hibari"  # the folder the wheel's code lives in
MODEL_FILE = "hibari/assets/hibari.onnx"
BUNDLED_VOICE = "heart"
_MODULE = "_omnivox_hibari"
_IMPORT_LOCK = threading.Lock()
HUB = "maureesewilliams/hibari on Hugging Face"


def is_hibari_folder(folder: Path) -> bool:
    return (folder / MODEL_FILE).is_file() and (folder / PACKAGE / "tts.py").is_file()


def import_hibari(folder: Path) -> ModuleType:
    """The hibari package under `folder` (an unpacked wheel), imported once per process under a private name."""
    with _IMPORT_LOCK:
        if (module := sys.modules.get(_MODULE)) is not None:
            return module  # the same pinned code whichever cache it came from
        init = folder / PACKAGE / "__init__.py"
        spec = importlib.util.spec_from_file_location(_MODULE, init, submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            raise ValueError(f"{init} is not an importable package")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_MODULE]
            raise
        return module


class HibariVoice:
    """hibari's "heart" voice: text -> misaki phonemes (its G2P) -> ids -> ONNX spectra -> dsp.synth -> 24 kHz PCM."""

    family = "hibari"
    language_code = "en-US"
    voices = (BUNDLED_VOICE,)
    default_voice = BUNDLED_VOICE

    def __init__(self, folder: Path, threads: int = 1) -> None:
        package = import_hibari(folder)
        self._tts = package.Hibari(voice=BUNDLED_VOICE, model=str(folder / MODEL_FILE), threads=threads)
        self._all_voices = dict(sys.modules[f"{_MODULE}.voices"].VOICES)  # name -> registry entry (file, bundled)
        self._dsp = sys.modules[f"{_MODULE}.dsp"]
        self.sample_rate = int(package.SAMPLE_RATE)
        self._g2p_lock = threading.Lock()  # the G2P keeps Python state (tagger, caches): one caller at a time
        self.utterances("Warm up.")  # loads the lexicons and OOV networks now (1.0 s), not on the first request

    def check_voice(self, voice: str) -> None:
        if voice == BUNDLED_VOICE:
            return
        if voice in self._all_voices:
            raise VoiceNeedsDownload(voice, HUB)
        raise UnknownVoice(voice, self.voices)

    def utterances(self, text: str) -> list[Utterance]:
        with self._g2p_lock:
            phonemes = self._tts.phonemize(
                speakable(text)
            )  # one string per sentence, long ones cut at clauses (400 max)
        out = []
        for ps in phonemes:
            ids = self._tts.ids(ps)  # [0, ..., 0]: the pads around what the vocabulary knows
            if len(ids) > 2:
                out.append(Utterance(tuple(ids), ps))
        return out

    def render(self, utterance: Utterance, settings: VoiceSettings, rng: np.random.Generator) -> np.ndarray:
        feed = {
            "ids": np.asarray([utterance.ids], np.int64),  # (1 x L)
            "speed": np.asarray([settings.speed], np.float32),
        }
        outputs = self._tts.sess.run(None, feed)  # lh, theta, ln, lr, phi: (1 x 601 x F); f0: (1 x F)
        lh, th, ln, lr, phi, f0 = (o[0] for o in outputs)
        return clip_pcm(self._dsp.synth(lh, th, ln, lr, phi, f0, rng))
