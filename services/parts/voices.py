"""Voices created from reference audio: validated, encoded with the model's codec encoder (SNAC for Orpheus, Mimi for
CSM: services/processing/csm_voice.py), stored on disk.

A created voice is its transcript and the reference's code frames (plus name, description, length), one JSON file per
voice under `<data folder>/voices/<model>/<name>.json`, written atomically (temp file + rename), so voices survive a
restart. Synthesis in a created voice uses the layout's `build_reference_prompt`: the reference turn is the prompt's
prefix, identical for every request in that voice, so the engine's prefix cache holds it after the first request.

Limits (VoiceLimits): reference 0.5-20 s (20 s = 235 frames = 1645 prompt tokens, in every segment's prompt),
transcript at most 500 characters, 100 created voices per model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.rpc import error_details_pb2

from omnivox.codecs.audio_input import AudioInputError, AudioLimits, decode_audio
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors
from omnivox.services.errors import Code, FieldViolation, ServiceError
from omnivox.services.processing.audio_prompt import encoding_name
from omnivox.services.processing.validation import Violations
from omnivox.v1 import speech_pb2

if TYPE_CHECKING:
    from omnivox.services.parts.csm_part import CsmLayout

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

log = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """$OMNIVOX_DATA_DIR, else $XDG_DATA_HOME/omnivox, else ~/.local/share/omnivox."""
    if env := os.environ.get("OMNIVOX_DATA_DIR"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "omnivox"


@dataclass(frozen=True)
class VoiceLimits:
    min_reference_seconds: float = 0.5
    max_reference_seconds: float = 20.0
    max_transcript_chars: int = 500
    max_description_chars: int = 1000
    max_voices_per_model: int = 100


@dataclass(frozen=True)
class CreatedVoice:
    name: str
    transcript: str
    description: str
    frames: tuple[tuple[int, ...], ...]  # (T x codes_per_frame) codec codes of the reference
    reference_seconds: float
    created: float

    def to_proto(self, model: str, language_code: str) -> speech_pb2.Voice:
        return speech_pb2.Voice(
            name=self.name,
            language_codes=[language_code],
            model=model,
            kind=speech_pb2.VOICE_KIND_CREATED,
            description=self.description,
            transcript=self.transcript,
            reference_seconds=self.reference_seconds,
        )


def already_exists(resource_type: str, name: str, message: str) -> ServiceError:
    info = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=name, description=message)
    return ServiceError(Code.ALREADY_EXISTS, message, [info])


class VoiceStore:
    """Created voices per model, on disk under `root/voices/`, cached in memory. Thread-safe."""

    def __init__(self, root: str | Path | None = None, limits: VoiceLimits | None = None) -> None:
        self.root = Path(root) if root is not None else default_data_dir()
        self.limits = limits or VoiceLimits()
        self._cache: dict[str, dict[str, CreatedVoice]] = {}
        self._encoders: dict[Path, object] = {}
        self._lock = threading.Lock()

    def _folder(self, model: str) -> Path:
        return self.root / "voices" / urllib.parse.quote(model, safe="")

    def _load(self, model: str) -> dict[str, CreatedVoice]:
        if model not in self._cache:
            voices: dict[str, CreatedVoice] = {}
            folder = self._folder(model)
            if folder.is_dir():
                for path in sorted(folder.glob("*.json")):
                    data = json.loads(path.read_text())
                    data["frames"] = tuple(tuple(f) for f in data["frames"])
                    voices[data["name"]] = CreatedVoice(**data)
            self._cache[model] = voices
        return self._cache[model]

    def list(self, model: str) -> list[CreatedVoice]:
        with self._lock:
            return list(self._load(model).values())

    def get(self, model: str, name: str) -> CreatedVoice | None:
        with self._lock:
            return self._load(model).get(name)

    def _save(self, model: str, voice: CreatedVoice) -> None:
        """Write the voice's file; FAILED_PRECONDITION when the data folder cannot take it (a read-only root file
        system with no --data-dir volume: it was INTERNAL with a traceback)."""
        folder = self._folder(model)
        data = {**voice.__dict__, "frames": [list(f) for f in voice.frames]}
        tmp = folder / f".{voice.name}.json.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            tmp.replace(folder / f"{voice.name}.json")
        except OSError as exc:
            log.error("cannot store created voice %r in %s: %s", voice.name, folder, exc)
            raise errors.failed_precondition(
                f"this server cannot store created voices: {folder}: {exc.strerror or exc}; serve with --data-dir "
                "(or $OMNIVOX_DATA_DIR) on a writable volume"
            ) from exc

    def delete(self, model: str, name: str) -> None:
        with self._lock:
            voices = self._load(model)
            if name not in voices:
                raise errors.not_found("voice", name, f"model {model!r} has no created voice {name!r}")
            (self._folder(model) / f"{name}.json").unlink(missing_ok=True)
            del voices[name]

    def _encoder(self, codec_folder: Path, load: Callable[[], Any] | None = None):
        """The encoder of `codec_folder`, built once: `load()` (a CSM folder's Mimi), else the SNAC folder's."""
        from omnivox.codecs.snac_encode import SnacEncoder

        with self._lock:
            if codec_folder not in self._encoders:
                self._encoders[codec_folder] = load() if load is not None else SnacEncoder.from_folder(codec_folder)
            return self._encoders[codec_folder]

    async def create(
        self,
        model: str,
        layout: SpeechLayout | CsmLayout,
        codec_folder: Path,
        request: speech_pb2.CreateVoiceRequest,
        load_encoder: Callable[[], Any] | None = None,
        max_frames: int | None = None,
    ) -> CreatedVoice:
        """Validate (INVALID_ARGUMENT listing every bad field, then ALREADY_EXISTS), encode, store. `load_encoder`:
        an encoder with `frames_for(samples)` and `encode(samples)` (services/processing/csm_voice.py); `max_frames`: the most
        reference frames the model's context takes (checked before encoding)."""
        lim = self.limits
        v = Violations()
        name = request.name
        if not NAME_PATTERN.fullmatch(name):
            v.add("name", "must be 1-64 characters: letters, digits, '-', '_', '.', starting with a letter or digit")
        transcript = request.transcript.strip()
        if not transcript:
            v.add("transcript", "must not be empty: the reference's words are part of the voice's prompt")
        elif len(transcript) > lim.max_transcript_chars:
            v.add("transcript", f"is {len(transcript)} characters; the limit is {lim.max_transcript_chars}")
        if len(request.description) > lim.max_description_chars:
            v.add("description", f"is {len(request.description)} characters; the limit is {lim.max_description_chars}")
        audio = None
        try:
            audio = decode_audio(
                request.reference_audio.data,
                encoding_name(request.reference_audio.encoding),  # the enum's name (its number was "unknown")
                request.reference_audio.sample_rate_hertz,
                target_rate=layout.sample_rate,
                limits=AudioLimits(max_seconds=lim.max_reference_seconds),
            )
            if audio.seconds < lim.min_reference_seconds:
                v.add("reference_audio", f"is {audio.seconds:.2f} s; at least {lim.min_reference_seconds} s needed")
        except AudioInputError as err:
            v.add(f"reference_audio.{err.field}", err.description)
        v.raise_if_any()
        assert audio is not None
        if name in layout.voices:
            raise already_exists("voice", name, f"{name!r} is a built-in voice of model {model!r}")
        with self._lock:
            existing = self._load(model)
            if name in existing:
                raise already_exists("voice", name, f"model {model!r} already has a voice {name!r}")
            if len(existing) >= lim.max_voices_per_model:
                raise errors.resource_exhausted(
                    f"model {model!r} has {len(existing)} created voices, the limit; delete one first", 0.0
                )
        encoder = self._encoder(codec_folder, load_encoder)
        if load_encoder is None:  # SNAC: (T x 7)
            frames = await asyncio.to_thread(encoder.encode_frames, audio.samples, layout.frame_levels)
            frames = frames.tolist()
        else:
            if max_frames is not None and (n := encoder.frames_for(len(audio.samples))) > max_frames:
                raise violation(
                    "reference_audio",
                    f"is {audio.seconds:.2f} s = {n} codec frames; this model's context takes at most {max_frames} "
                    "for a voice's reference",
                )
            frames = await asyncio.to_thread(encoder.encode, audio.samples)  # (T x N)
        voice = CreatedVoice(
            name=name,
            transcript=transcript,
            description=request.description,
            frames=tuple(tuple(int(c) for c in row) for row in frames),
            reference_seconds=round(audio.seconds, 3),
            created=time.time(),
        )
        with self._lock:
            existing = self._load(model)
            if name in existing:  # created by a concurrent call while this one encoded
                raise already_exists("voice", name, f"model {model!r} already has a voice {name!r}")
            self._save(model, voice)
            existing[name] = voice
        return voice


def violation(field: str, description: str) -> ServiceError:
    return errors.invalid_argument([FieldViolation(field, description)])
