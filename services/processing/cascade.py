"""A spoken question to a text model: Generate's audio parts transcribed first (`serve --asr-model NAME`).

A cascade, unlike an audio-LLM (Qwen2-Audio, Qwen3-ASR), which reads the audio itself: when a Generate request to a
model that does not take audio holds audio parts and the server names a Whisper model with `--asr-model`, each audio
part is transcribed by that model (language detected, greedy, services/calls/whisper.py) and replaced by a text part
holding its transcript; the text model then answers the text. Each transcription is admitted on the Whisper model
(its queue bound applies) and its errors name the audio part (`contents[i].parts[j].audio.<field>`). Without
`--asr-model` such a request keeps its INVALID_ARGUMENT (the model does not accept audio).

A voice agent sends its whole conversation with each turn, every earlier spoken question included (and with tools,
the call and its result after it): the transcripts of recent clips are kept by the ASR model's Whisper part
(`WhisperPart.transcripts`, keyed by a hash of the part's bytes, encoding and rate, and the request's cache salt;
greedy decoding makes the transcript a function of the first three), so each clip is transcribed once, not once per
later turn, and a caller never finds another caller's clip there (services/processing/cache_salt.py).
"""

from __future__ import annotations

import asyncio
import hashlib

from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.calls.whisper import transcribe
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.v1 import content_pb2, generation_pb2


def applies(request: generation_pb2.GenerateRequest, model: ServedModel, registry: ModelRegistry) -> bool:
    """The server has an ASR model, the target model does not take audio, and the request holds audio."""
    if not registry.asr_model or AUDIO in model.input_modalities:
        return False
    return any(p.WhichOneof("kind") == "audio" for c in request.contents for p in c.parts)


async def transcribe_audio_parts(
    request: generation_pb2.GenerateRequest, registry: ModelRegistry, salt: str = ""
) -> generation_pb2.GenerateRequest:
    """A copy of `request` whose audio parts are text parts holding their transcripts (in order, one at a time).
    `salt`: the request's cache salt; transcripts (and the ASR model's caches) are shared only under the same one."""
    asr = registry.get_ready(registry.asr_model or "")
    part = asr.bundle.whisper if asr.bundle is not None else None
    if part is None:
        raise errors.internal(f"--asr-model {asr.name!r} is not a Whisper model")
    out = generation_pb2.GenerateRequest()
    out.CopyFrom(request)
    for i, content in enumerate(out.contents):
        for j, p in enumerate(content.parts):
            if p.WhichOneof("kind") != "audio":
                continue
            key = await asyncio.to_thread(_clip_key, p.audio, salt)  # sha256 of a 20 MB WAV: ~40 ms
            if (text := part.transcripts.get(key)) is not None:
                p.text = text
                continue
            path = f"contents[{i}].parts[{j}].audio"
            with asr.admit():
                decoded = await asyncio.to_thread(part.decode, p.audio, path)
                try:
                    result = await transcribe(part, decoded.samples, language=None, cache_salt=salt)
                except TranscriptionRequestError as err:
                    raise errors.invalid_argument([FieldViolation(f"{path}", err.description)]) from err
                except RuntimeError as err:
                    raise errors.internal(str(err)) from err
            part.transcripts.put(key, result.text)
            p.text = result.text  # setting the oneof's text clears its audio
    return out


def _clip_key(audio: content_pb2.AudioPart, salt: str) -> bytes:
    """What decides a clip's transcript besides the model (its bytes, encoding and stated rate), and who may share
    it (the salt)."""
    h = hashlib.sha256(audio.data)
    h.update(f"{audio.encoding}:{audio.sample_rate_hertz}:{salt}".encode())
    return h.digest()
