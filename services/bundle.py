"""What a served model is: a ModelBundle (engine, prompt builder, generation defaults, optional parts).

A bundle's parts are declared by its checkpoint and decide what it accepts and produces:
- every bundle: a text decoder (the engine) and a prompt builder (its chat template);
- speech out: `speech_layout.json` + a SNAC codec folder (models/orpheus.py) -> a SpeechPart (services/speech_part.py:
  layout, codec, decode worker, token constraint), output modality audio instead of text;
- audio in: an audio-LLM checkpoint (Qwen2-Audio, Qwen3-ASR, Voxtral: `models.audio.audio_family`) -> an
  AudioInputPart (services/audio_prompt.py: encoder, encoder worker + cache, the processor's chat template or, for
  Voxtral, mistral_common's prompts), input modality audio;
- speech recognition: a Whisper checkpoint (config model_type "whisper"; a CTranslate2 folder is converted into the
  cache first) -> a WhisperPart (services/whisper.py: special tokens, mel extractor, encoder worker + cache), input
  modality audio only (TranscriptionService, and Generate's cascade), output text;
- image in: a vision-language checkpoint (LLaVA 1.5/NeXT, SmolVLM/Idefics3, Qwen2-VL, Qwen2.5-VL:
  `models.vision.FAMILIES`) -> an ImageInputPart (services/image_prompt.py: vision encoder + the checkpoint's
  processor, encoder worker + cache), input modality image.

`probe(spec)` reads what a spec declares without loading anything (the server lists models while they load);
`load_bundle(spec, options)` builds the whole bundle (blocking: run it in a worker thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnivox.services.defaults import UNTRAINED_FILE, EmbeddedDefault, embedded_default
from omnivox.services.speech_part import SpeechPart, is_speech_checkpoint, load_speech_part
from omnivox.services.voice_part import is_voice_path

if TYPE_CHECKING:
    from omnivox.engine import Engine
    from omnivox.services.audio_prompt import AudioInputPart
    from omnivox.services.image_prompt import ImageInputPart
    from omnivox.services.loading import EngineOptions, ModelSpec
    from omnivox.services.prompt import PromptBuilder
    from omnivox.services.structured import GrammarCompiler
    from omnivox.services.voice_part import VoicePart
    from omnivox.services.whisper_part import WhisperPart

log = logging.getLogger(__name__)

TEXT, IMAGE, AUDIO = "text", "image", "audio"

# Sampling defaults a Hugging Face generation_config.json may carry, as SamplingParams fields.
GENERATION_CONFIG_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def modalities(
    speech: bool, vision: bool = False, audio: bool = False, whisper: bool = False
) -> tuple[frozenset[str], frozenset[str]]:
    """(input, output) modalities of a bundle holding these parts: the one rule, for probes and loaded bundles."""
    if whisper:  # speech recognition: audio in, text out
        return frozenset({AUDIO}), frozenset({TEXT})
    inputs = {TEXT} | ({IMAGE} if vision else set()) | ({AUDIO} if audio else set())
    return frozenset(inputs), frozenset({AUDIO} if speech else {TEXT})


def read_generation_config(file: Path | None) -> dict[str, float | int]:
    """The sampling values of a generation_config.json (SamplingParams names); {} when there is none."""
    if file is None or not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        log.warning("ignoring %s: not valid JSON", file)
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: config[k] for k in GENERATION_CONFIG_KEYS if isinstance(config.get(k), int | float)}


def _read_untrained(folder: Path | None) -> tuple[str, ...]:
    """Components a checkpoint folder declares randomly initialised (`untrained_components.json`: a list of names)."""
    file = folder / UNTRAINED_FILE if folder is not None and folder.is_dir() else None
    if file is None or not file.is_file():
        return ()
    try:
        names = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return ()
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


@dataclass(frozen=True)
class BundleManifest:
    """What a spec declares, read without loading: its files, its parts, its sampling defaults."""

    source: Path | None  # a checkpoint folder or .gguf; None until an embedded default is fetched
    embedded: EmbeddedDefault | None = None
    speech: bool = False
    untrained_components: tuple[str, ...] = ()
    file_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json (or the shipped one)
    # Weights of parts no bundle builds (a tower or projector of a family without an encoder here), left unloaded.
    planned_parts: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)  # the operator's `--sampling-default`s
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # EngineOptions for this model alone
    lenient_fields: frozenset[str] = frozenset()  # of engine_overrides: dropped where they do not apply
    audio: bool = False  # an audio-LLM checkpoint (models.audio.audio_family): audio input
    vision: bool = False  # a vision-language checkpoint (services.image_prompt.vision_family): image input
    whisper: bool = False  # a Whisper checkpoint (services/whisper.py): audio in, text out
    voice: bool = False  # a non-autoregressive voice (services/voice_part.py): text in, speech out, no engine

    @property
    def input_modalities(self) -> frozenset[str]:
        return modalities(self.speech, vision=self.vision, audio=self.audio, whisper=self.whisper)[0]

    @property
    def output_modalities(self) -> frozenset[str]:
        return modalities(self.speech or self.voice)[1]

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """Known before loading: the file's values, then the overrides (a speech layout adds its own on load)."""
        return {**self.file_defaults, **self.overrides}


def probe(spec: ModelSpec) -> BundleManifest:
    """The manifest of a spec whose path was checked (services/loading.check_model_path); reads small files only."""
    overrides = dict(spec.sampling_overrides)
    if spec.path is None:
        default = embedded_default(spec.speech, spec.asr, spec.voice)
        return BundleManifest(
            source=None,
            embedded=default,
            speech=default.speech,
            voice=default.voice,
            whisper=default.asr,
            untrained_components=default.untrained_components,
            file_defaults=read_generation_config(default.generation_config()),
            overrides=overrides,
            engine_overrides=dict(spec.engine_overrides),
            lenient_fields=frozenset(spec.lenient_fields),
        )
    path = Path(spec.path)
    if is_voice_path(path):
        return BundleManifest(source=path, voice=True, untrained_components=_read_untrained(path if path.is_dir()
                              else None), overrides=overrides)  # fmt: skip
    folder = path if path.is_dir() else None
    audio = folder is not None and _audio_family(folder) is not None
    planned = _planned_parts(path) if folder else ()
    if audio:  # the audio tower and projector are built (services/audio_prompt.py)
        planned = tuple(p for p in planned if p not in ("audio", "projector"))
    vision = folder is not None and _vision_family(folder) is not None
    if vision:  # the vision tower and projector are built (services/image_prompt.py)
        planned = tuple(p for p in planned if p not in ("vision", "projector"))
    from omnivox.services.whisper_part import is_whisper_folder

    return BundleManifest(
        source=path,
        speech=is_speech_checkpoint(path),
        whisper=folder is not None and is_whisper_folder(folder),
        audio=audio,
        vision=vision,
        planned_parts=planned,
        untrained_components=_read_untrained(folder),
        file_defaults=read_generation_config(folder / "generation_config.json" if folder else None),
        overrides=overrides,
        engine_overrides=dict(spec.engine_overrides),
        lenient_fields=frozenset(spec.lenient_fields),
    )


def _audio_family(folder: Path) -> str | None:
    from omnivox.models.audio import audio_family

    try:
        return audio_family(folder)
    except (OSError, ValueError):  # an unreadable config.json: loading says why
        return None


def _vision_family(folder: Path) -> str | None:
    from omnivox.services.image_prompt import vision_family

    return vision_family(folder)


def _planned_parts(folder: Path) -> tuple[str, ...]:
    """Parts other than the decoder whose weights the folder holds; () when its weights cannot be listed (loading
    the bundle then says why, as a load error)."""
    from omnivox.models.checkpoint import DECODER, checkpoint_parts

    try:
        return tuple(sorted(p for p in checkpoint_parts(folder) if p != DECODER))
    except (OSError, ValueError):
        return ()


@dataclass
class ModelBundle:
    """A loaded model: everything a servicer needs to answer requests for it."""

    manifest: BundleManifest
    source: Path  # where it was loaded from (an embedded default's cache path once fetched)
    engine: Engine | None  # None for a voice (no decode steps: `voice` speaks)
    prompt_builder: PromptBuilder | None
    speech: SpeechPart | None = None
    vision: ImageInputPart | None = None  # image input: encoder + worker + cache (services/image_prompt.py)
    audio: AudioInputPart | None = None  # audio input: encoder + worker + chat template (services/audio_prompt.py)
    whisper: WhisperPart | None = None  # speech recognition (services/whisper.py)
    voice: VoicePart | None = None  # a non-autoregressive voice (services/voice_part.py)
    # response_format and tool grammars, compiled off the loop and cached per cache salt (services/structured.py)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        from omnivox.services.structured import GrammarCompiler

        self.grammars = GrammarCompiler.for_engine(self.engine) if self.engine is not None else None  # type: ignore

    @property
    def input_modalities(self) -> frozenset[str]:
        return modalities(self.speech is not None, self.vision is not None, self.audio is not None,
                          self.whisper is not None)[0]  # fmt: skip

    @property
    def output_modalities(self) -> frozenset[str]:
        return modalities(self.speech is not None or self.voice is not None)[1]

    @property
    def untrained_components(self) -> tuple[str, ...]:
        return self.manifest.untrained_components

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Effective sampling defaults: generation_config.json, then a speech layout's, then the operator's."""
        layout = self.speech.sampling_defaults() if self.speech is not None else {}
        return {**self.manifest.file_defaults, **layout, **self.manifest.overrides}

    async def aclose(self) -> None:
        """Stop the parts with background work (the codec worker), then the engine."""
        if self.voice is not None:
            await asyncio.to_thread(self.voice.close)  # joins the voice's worker threads
            return
        self.grammars.close()
        if self.speech is not None:
            await self.speech.worker.shutdown()
        for part in (self.audio, self.whisper):
            if part is not None:
                await asyncio.to_thread(part.close)  # joins the encoder thread
        if self.vision is not None:
            await asyncio.to_thread(self.vision.close)  # joins the encoder thread
        await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread: off the event loop


def load_bundle(spec: ModelSpec, options: EngineOptions) -> ModelBundle:
    """Load a checkpoint folder, a .gguf file or an embedded default (spec.path None) into a bundle (blocking)."""
    return load_manifest(probe(spec), options)


def load_manifest(manifest: BundleManifest, options: EngineOptions) -> ModelBundle:
    """Fetch (an embedded default), build the engine and every part the manifest declares (blocking).

    Raises ValueError with a one-line reason when the checkpoint cannot be served; the engine is shut down again if
    a later part fails.
    """
    import dataclasses

    from omnivox.services.prompt import ChatPromptBuilder

    source = manifest.source or manifest.embedded.ensure()  # type: ignore[union-attr]
    if manifest.voice:  # no engine: the voice's phonemizer and ONNX model are the whole bundle
        from omnivox.services.voice_part import load_voice_part

        return ModelBundle(manifest=manifest, source=source, engine=None, prompt_builder=None,
                           voice=load_voice_part(source))  # fmt: skip
    if manifest.whisper:
        from omnivox.services.whisper_part import whisper_checkpoint, whisper_kv_gib

        source = whisper_checkpoint(source)  # a CTranslate2 folder: its converted copy in the cache
        if options.kv_cache_gib is None:  # a 448-token context: a KV cache sized for it, not the engine's default
            options = dataclasses.replace(options, kv_cache_gib=whisper_kv_gib(source, options.max_num_seqs))
    engine = _build_engine(source, options, manifest)
    audio: AudioInputPart | None = None
    vision: ImageInputPart | None = None
    whisper: WhisperPart | None = None
    try:
        if engine.tokenizer is None:
            raise ValueError(f"{source} has no tokenizer; the text API needs one")
        speech = None
        if manifest.speech or is_speech_checkpoint(source):
            speech = load_speech_part(
                source,
                engine.model_config.vocab_size,
                device=str(engine.device),
                options=options.speech_streaming,
                tokenizer=engine.tokenizer,
            )
        if manifest.whisper:
            from omnivox.services.whisper_part import load_whisper_part

            whisper = load_whisper_part(source, engine, model_key=str(source))
        if manifest.audio:
            from omnivox.services.audio_prompt import load_audio_part

            audio = load_audio_part(source, engine.device, engine.dtype, model_key=str(source))
        if manifest.vision:
            from omnivox.codecs.image import ImageLimits
            from omnivox.services.image_prompt import load_image_part

            vision = load_image_part(
                source,
                engine.device,
                engine.dtype,
                model_key=str(source),
                cache_bytes=options.image_cache_mib << 20,
                limits=ImageLimits(max_request_pixels=max(1, round(options.max_request_megapixels * 1e6))),
            )
    except BaseException:
        for part in (audio, whisper):
            if part is not None:
                part.close()
        engine.shutdown()
        raise
    if manifest.planned_parts:
        log.warning(
            "%s also holds %s weights of a family omnivox does not build; serving its text decoder only",
            source,
            " and ".join(manifest.planned_parts),
        )
    prompt_builder: PromptBuilder = ChatPromptBuilder(engine.tokenizer)
    if whisper is not None:
        from omnivox.services.whisper_part import WhisperPromptBuilder

        prompt_builder = WhisperPromptBuilder()
    if audio is not None:
        from omnivox.services.audio_prompt import AudioPromptBuilder

        prompt_builder = AudioPromptBuilder(audio)
    if vision is not None:
        from omnivox.services.image_prompt import ImagePromptBuilder

        prompt_builder = ImagePromptBuilder(vision, engine.model_config.max_model_len)
    return ModelBundle(
        manifest=manifest,
        source=source,
        engine=engine,
        prompt_builder=prompt_builder,
        speech=speech,
        audio=audio,
        vision=vision,
        whisper=whisper,
    )


def _build_engine(source: Path, base: EngineOptions, manifest: BundleManifest):
    """The manifest's engine under `base` with its engine_overrides. An override that an unnamed flag set for every
    model (manifest.lenient_fields) and that this model cannot take (NotApplicable: int8 weights for float-only
    Whisper) is dropped with a warning and the load retried; one named for this model is raised."""
    import dataclasses

    from omnivox.engine import Engine
    from omnivox.models.config import NotApplicable

    options = dataclasses.replace(base, **manifest.engine_overrides)
    while True:
        try:
            return Engine.from_pretrained(
                str(source),
                device=options.device,
                dtype=options.dtype,
                kv_cache_gib=options.kv_cache_gib,
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                max_model_len=options.max_model_len,
                progress=options.progress,
                quantization=options.quantization,
                quantize_lm_head=options.quantize_lm_head,
                activation_bits=options.activation_bits,
                speculative=options.speculative,
                num_speculative_tokens=options.num_speculative_tokens,
                tensor_parallel=options.tensor_parallel,
            )
        except NotApplicable as e:
            if e.field not in manifest.lenient_fields or getattr(options, e.field) == getattr(base, e.field):
                raise
            log.warning("%s: %s; it loads without that flag (given for every served model)", Path(source).name, e)
            options = dataclasses.replace(options, **{e.field: getattr(base, e.field)})
