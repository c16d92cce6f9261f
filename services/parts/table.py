"""The parts a served model may hold besides its decoder, as one table: PARTS.

Each row says how to find the part in a checkpoint without loading it (`detect`), what it adds to what the model
accepts and produces (`inputs`, `output`, `text_in`), how to load it over the built engine (`load`), the prompt builder
it brings (`prompt_builder`), and how to stop it (`close`). services/parts/bundle.py reads only this table: probing a spec,
loading a bundle, its modalities, its prompt builder and its shutdown are loops over the rows a model has.

| part    | found by                                 | accepts / produces          | module                       |
|---------|------------------------------------------|-----------------------------|------------------------------|
| speech  | `speech_layout.json` + a SNAC folder     | produces audio              | services/parts/speech_part.py      |
| whisper | config model_type "whisper" (or CT2)     | audio in only, text out     | services/parts/whisper_part.py     |
| audio   | an audio-LLM config (models.audio)       | accepts audio               | services/processing/audio_prompt.py     |
| vision  | a vision-language config (models.vision) | accepts images              | services/processing/image_prompt.py     |
| voice   | a Piper voice, an unpacked hibari-tts    | produces audio, no engine   | services/parts/voice_part.py       |

To add a part (a new speech model kind, an encoder): write its module (a loader returning the part, and a close),
then add one `PartKind` row below. Rows load in table order; the prompt builder of the LAST row that has one wins
(vision over audio over whisper; a model with none uses the chat template's ChatPromptBuilder). The loaders import
their modules inside the function, so a text-only server never imports what an encoder family brings
(tests/services/test_import_boundary.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnivox.engine import Engine
    from omnivox.services.parts.model_spec import EngineOptions
    from omnivox.services.processing.prompt import PromptBuilder

log = logging.getLogger(__name__)

TEXT, IMAGE, AUDIO = "text", "image", "audio"


@dataclass(frozen=True)
class PartKind:
    """One row of PARTS: a kind of part a bundle may hold."""

    name: str  # the bundle's key for it (bundle.parts[name]) and its ListModels component name
    detect: Callable[[Path], bool]  # a checkpoint folder or .gguf declares it; reads small files only
    load: Callable[[Path, Engine, EngineOptions], Any]  # the part, over the built engine (blocking)
    inputs: frozenset[str] = frozenset()  # modalities it adds to what the model accepts
    output: str | None = None  # the modality the model produces instead of text
    text_in: bool = True  # False: the model accepts no text (speech recognition)
    # Checkpoint weight groups (models/checkpoint.py checkpoint_parts) this part's loader builds.
    builds: tuple[str, ...] = ()
    prompt_builder: Callable[[Any, Engine], PromptBuilder] | None = None
    close: Callable[[Any], Awaitable[None]] | None = None  # stop its background work (the loop's, or a thread's)
    # Before the engine is built: the folder to load from and the engine options it needs (Whisper's converted copy
    # and its small KV cache).
    prepare: Callable[[Path, EngineOptions], tuple[Path, EngineOptions]] | None = None
    # False: the part is the whole model (a non-autoregressive voice): no engine is built, `load` gets None for it.
    needs_engine: bool = True


def _in_thread(part: Any) -> Awaitable[None]:
    return asyncio.to_thread(part.close)  # joins the part's encoder thread, off the event loop


# --- speech out ---------------------------------------------------------------------------------------------------------
def _is_speech(path: Path) -> bool:
    """An Orpheus-layout folder (speech_layout.json + SNAC) or a CSM folder (services/parts/csm_part.py)."""
    from omnivox.services.parts.csm_part import is_csm_folder
    from omnivox.services.parts.speech_part import is_speech_checkpoint

    return is_speech_checkpoint(path) or (path.is_dir() and is_csm_folder(path))


def _load_speech(source: Path, engine: Engine, options: EngineOptions) -> Any:
    from omnivox.services.parts.csm_part import is_csm_folder, load_csm_speech_part
    from omnivox.services.parts.speech_part import load_speech_part
    from omnivox.services.processing.csm_voice import frame_embedder

    if is_csm_folder(source):  # frames come whole from the engine: no token layout, no constraint
        embed = frame_embedder(engine.model, engine.device)
        return load_csm_speech_part(source, str(engine.device), options.speech_streaming, engine.tokenizer, embed)
    vocab, device = engine.model_config.vocab_size, str(engine.device)
    return load_speech_part(source, vocab, device=device, options=options.speech_streaming, tokenizer=engine.tokenizer)


async def _close_speech(part: Any) -> None:
    await part.worker.shutdown()


# --- speech recognition -------------------------------------------------------------------------------------------------
def _is_whisper(path: Path) -> bool:
    from omnivox.services.parts.whisper_part import is_whisper_folder

    return path.is_dir() and is_whisper_folder(path)


def _prepare_whisper(source: Path, options: EngineOptions) -> tuple[Path, EngineOptions]:
    from omnivox.services.parts.whisper_part import whisper_checkpoint, whisper_kv_gib

    source = whisper_checkpoint(source)  # a CTranslate2 folder: its converted copy in the cache
    if options.kv_cache_gib is None:  # a 448-token context: a KV cache sized for it, not the engine's default
        options = dataclasses.replace(options, kv_cache_gib=whisper_kv_gib(source, options.max_num_seqs))
    return source, options


def _load_whisper(source: Path, engine: Engine, options: EngineOptions) -> Any:
    from omnivox.services.parts.whisper_part import load_whisper_part

    return load_whisper_part(source, engine, model_key=str(source), short_window_int8=options.whisper_short_window_int8,
                             short_window_s=options.whisper_short_window_s)  # fmt: skip


def _whisper_builder(part: Any, engine: Engine) -> PromptBuilder:
    from omnivox.services.parts.whisper_part import WhisperPromptBuilder

    return WhisperPromptBuilder()


# --- audio in -----------------------------------------------------------------------------------------------------------
def _is_audio_llm(path: Path) -> bool:
    from omnivox.models.audio import audio_family

    try:
        return path.is_dir() and audio_family(path) is not None
    except (OSError, ValueError):  # an unreadable config.json: loading says why
        return False


def _load_audio(source: Path, engine: Engine, options: EngineOptions) -> Any:
    from omnivox.services.processing.audio_prompt import load_audio_part

    return load_audio_part(source, engine.device, engine.dtype, model_key=str(source))


def _audio_builder(part: Any, engine: Engine) -> PromptBuilder:
    from omnivox.services.processing.audio_prompt import AudioPromptBuilder

    return AudioPromptBuilder(part)


# --- image in -----------------------------------------------------------------------------------------------------------
def _is_vision(path: Path) -> bool:
    from omnivox.services.processing.image_prompt import vision_family

    return path.is_dir() and vision_family(path) is not None


def _load_vision(source: Path, engine: Engine, options: EngineOptions) -> Any:
    from omnivox.codecs.image import ImageLimits
    from omnivox.services.processing.image_prompt import load_image_part

    limits = ImageLimits(max_request_pixels=max(1, round(options.max_request_megapixels * 1e6)))
    cache_bytes = options.image_cache_mib << 20
    return load_image_part(source, engine.device, engine.dtype, str(source), cache_bytes=cache_bytes, limits=limits)


def _vision_builder(part: Any, engine: Engine) -> PromptBuilder:
    from omnivox.services.processing.image_prompt import ImagePromptBuilder

    return ImagePromptBuilder(part, engine.model_config.max_model_len)


# --- speech out, no engine: a non-autoregressive voice ------------------------------------------------------------------
def _is_voice(path: Path) -> bool:
    from omnivox.services.parts.voice_part import is_voice_path

    return is_voice_path(path)


def _load_voice(source: Path, engine: None, options: EngineOptions) -> Any:
    from omnivox.services.parts.voice_part import load_voice_part

    return load_voice_part(source)


SPEECH, WHISPER, AUDIO_IN, VISION, VOICE = "speech", "whisper", "audio", "vision", "voice"

PARTS: tuple[PartKind, ...] = (
    PartKind(SPEECH, _is_speech, _load_speech, output=AUDIO, close=_close_speech),
    PartKind(
        WHISPER,
        _is_whisper,
        _load_whisper,
        frozenset({AUDIO}),
        text_in=False,
        prompt_builder=_whisper_builder,
        close=_in_thread,
        prepare=_prepare_whisper,
    ),  # fmt: skip
    PartKind(
        AUDIO_IN,
        _is_audio_llm,
        _load_audio,
        frozenset({AUDIO}),
        builds=("audio", "projector"),
        prompt_builder=_audio_builder,
        close=_in_thread,
    ),  # fmt: skip
    PartKind(
        VISION,
        _is_vision,
        _load_vision,
        frozenset({IMAGE}),
        builds=("vision", "projector"),
        prompt_builder=_vision_builder,
        close=_in_thread,
    ),  # fmt: skip
    PartKind(VOICE, _is_voice, _load_voice, output=AUDIO, close=_in_thread, needs_engine=False),
)


def needs_engine(names: Iterable[str]) -> bool:
    """False when one of the parts is the whole model (a voice): the bundle then has no engine."""
    return all(kind.needs_engine for kind in rows(names))


def rows(names: Iterable[str]) -> list[PartKind]:
    """The table's rows of these part names, in table order."""
    wanted = set(names)
    return [kind for kind in PARTS if kind.name in wanted]


def detect(path: Path) -> frozenset[str]:
    """The parts a checkpoint folder or .gguf file declares (reads small files only)."""
    return frozenset(kind.name for kind in PARTS if kind.detect(path))


def modalities(parts: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(input, output) modalities of a model holding these parts: the one rule, for probes and loaded bundles."""
    kinds = rows(parts)
    inputs = {TEXT} if all(k.text_in for k in kinds) else set()
    for kind in kinds:
        inputs |= kind.inputs
    outputs = {k.output for k in kinds if k.output is not None} or {TEXT}
    return frozenset(inputs), frozenset(outputs)


def prepare(names: Iterable[str], source: Path, options: EngineOptions) -> tuple[Path, EngineOptions]:
    """The folder to build the engine from and its options, as the parts need them."""
    for kind in rows(names):
        if kind.prepare is not None:
            source, options = kind.prepare(source, options)
    return source, options


def load(names: Iterable[str], source: Path, engine: Engine, options: EngineOptions) -> dict[str, Any]:
    """Every named part over the built engine, in table order (blocking). On a failure the parts loaded before it
    are closed again (their encoder threads joined) and the error raised."""
    loaded: dict[str, Any] = {}
    try:
        for kind in rows(names):
            loaded[kind.name] = kind.load(source, engine, options)
    except BaseException:
        for part in loaded.values():
            if callable(getattr(part, "close", None)):
                part.close()
        raise
    return loaded


def prompt_builder(parts: Mapping[str, Any], engine: Engine) -> PromptBuilder:
    """The builder of the last row with one among the parts held; the chat template's without any."""
    from omnivox.services.processing.prompt import ChatPromptBuilder

    builder: PromptBuilder = ChatPromptBuilder(engine.tokenizer)
    for kind in rows(parts):
        if kind.prompt_builder is not None:
            builder = kind.prompt_builder(parts[kind.name], engine)
    return builder


async def close(parts: Mapping[str, Any]) -> None:
    """Stop every part's background work (codec worker, encoder threads), in table order."""
    for kind in rows(parts):
        if kind.close is not None:
            await kind.close(parts[kind.name])
