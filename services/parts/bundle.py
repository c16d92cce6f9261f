"""What a served model is: a ModelBundle (engine, prompt builder, generation defaults, the parts it holds).

A bundle's parts are declared by its checkpoint and decide what it accepts and produces: every bundle has a text
decoder (the engine) and a prompt builder; the other parts (speech out, Whisper, audio in, image in) are the rows of
services/parts/table.py PARTS, which says how each is found, loaded, closed and what it adds.

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

from omnivox.services.parts import table as part_table
from omnivox.services.parts.defaults import UNTRAINED_FILE, EmbeddedDefault, embedded_default
from omnivox.services.parts.table import AUDIO, IMAGE, TEXT, modalities
from omnivox.services.parts.vision_defaults import IMAGE_DEFAULT, TRAINED_ON_FILE

if TYPE_CHECKING:
    from omnivox.engine import Engine
    from omnivox.services.parts.model_spec import EngineOptions, ModelSpec
    from omnivox.services.parts.speech_part import SpeechPart
    from omnivox.services.parts.voice_part import VoicePart
    from omnivox.services.parts.whisper_part import WhisperPart
    from omnivox.services.processing.audio_prompt import AudioInputPart
    from omnivox.services.processing.image_prompt import ImageInputPart
    from omnivox.services.processing.prompt import PromptBuilder
    from omnivox.services.processing.structured import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["AUDIO", "IMAGE", "TEXT", "BundleManifest", "ModelBundle", "load_bundle", "modalities", "probe"]

# Sampling defaults a Hugging Face generation_config.json may carry, as SamplingParams fields.
GENERATION_CONFIG_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


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


def _read_trained_on(folder: Path | None) -> str:
    file = folder / TRAINED_ON_FILE if folder is not None else None
    try:
        return file.read_text().strip() if file is not None else ""
    except OSError:
        return ""


@dataclass(frozen=True)
class BundleManifest:
    """What a spec declares, read without loading: its files, its parts, its sampling defaults."""

    source: Path | None  # a checkpoint folder or .gguf; None until an embedded default is fetched
    embedded: EmbeddedDefault | None = None
    parts: frozenset[str] = frozenset()  # names of services/parts/table.py PARTS rows the checkpoint declares
    untrained_components: tuple[str, ...] = ()
    trained_on: str = (
        ""  # a narrow model's domain (ListModels' trained_on): the embedded image model's, or TRAINED_ON_FILE
    )
    file_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json (or the shipped one)
    # Weights of parts no bundle builds (a tower or projector of a family without an encoder here), left unloaded.
    planned_parts: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)  # the operator's `--sampling-default`s
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # EngineOptions for this model alone
    lenient_fields: frozenset[str] = frozenset()  # of engine_overrides: dropped where they do not apply

    @property
    def input_modalities(self) -> frozenset[str]:
        return modalities(self.parts)[0]

    @property
    def output_modalities(self) -> frozenset[str]:
        return modalities(self.parts)[1]

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """Known before loading: the file's values, then the overrides (a speech layout adds its own on load)."""
        return {**self.file_defaults, **self.overrides}


def probe(spec: ModelSpec) -> BundleManifest:
    """The manifest of a spec whose path was checked (services/parts/loading.check_model_path); reads small files only."""
    common = dict(
        overrides=dict(spec.sampling_overrides),
        engine_overrides=dict(spec.engine_overrides),
        lenient_fields=frozenset(spec.lenient_fields),
    )
    if spec.path is None:
        default = IMAGE_DEFAULT if spec.image else embedded_default(spec.speech, spec.asr, spec.voice)
        return BundleManifest(
            source=None,
            embedded=default,
            parts=frozenset({part_table.SPEECH} if default.speech else ())
            | ({part_table.WHISPER} if default.asr else set())
            | ({part_table.VOICE} if default.voice else set())
            | ({part_table.VISION} if default.image else set()),
            untrained_components=default.untrained_components,
            trained_on=default.trained_on,
            file_defaults=read_generation_config(default.generation_config()),
            **common,
        )
    path = Path(spec.path)
    folder = path if path.is_dir() else None
    parts = part_table.detect(path)
    built = {group for kind in part_table.rows(parts) for group in kind.builds}  # weights the parts' loaders build
    planned = tuple(p for p in _planned_parts(path) if p not in built) if folder else ()
    return BundleManifest(
        source=path,
        parts=parts,
        planned_parts=planned,
        untrained_components=_read_untrained(folder),
        trained_on=_read_trained_on(folder),
        file_defaults=read_generation_config(folder / "generation_config.json" if folder else None),
        **common,
    )


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
    engine: Engine | None  # None when a part is the whole model (a voice: services/parts/voice_part.py)
    prompt_builder: PromptBuilder | None
    parts: dict[str, Any] = field(default_factory=dict)  # by services/parts/table.py row name
    # response_format and tool grammars, compiled off the loop and cached per cache salt (services/processing/structured.py)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        from omnivox.services.processing.structured import GrammarCompiler

        self.grammars = GrammarCompiler.for_engine(self.engine) if self.engine is not None else None  # type: ignore

    # The parts each servicer reads, typed.
    @property
    def speech(self) -> SpeechPart | None:
        return self.parts.get(
            part_table.SPEECH
        )  # speech out: layout, codec, decode worker (services/parts/speech_part.py)

    @property
    def whisper(self) -> WhisperPart | None:
        return self.parts.get(part_table.WHISPER)  # speech recognition (services/parts/whisper_part.py)

    @property
    def audio(self) -> AudioInputPart | None:
        return self.parts.get(
            part_table.AUDIO_IN
        )  # audio input: encoder + worker + template (services/processing/audio_prompt.py)

    @property
    def voice(self) -> VoicePart | None:
        return self.parts.get(part_table.VOICE)  # a non-autoregressive voice, no engine (services/parts/voice_part.py)

    @property
    def vision(self) -> ImageInputPart | None:
        return self.parts.get(
            part_table.VISION
        )  # image input: encoder + worker + cache (services/processing/image_prompt.py)

    # It holds every part its manifest declares (load_manifest loads them all), so it accepts and produces what the
    # manifest says.
    @property
    def input_modalities(self) -> frozenset[str]:
        return self.manifest.input_modalities

    @property
    def output_modalities(self) -> frozenset[str]:
        return self.manifest.output_modalities

    @property
    def untrained_components(self) -> tuple[str, ...]:
        return self.manifest.untrained_components

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Effective sampling defaults: generation_config.json, then a speech layout's, then the operator's."""
        layout = self.speech.sampling_defaults() if self.speech is not None else {}
        return {**self.manifest.file_defaults, **layout, **self.manifest.overrides}

    async def aclose(self) -> None:
        """Stop the parts with background work (the codec worker, encoder threads), then the engine."""
        if self.grammars is not None:
            self.grammars.close()
        await part_table.close(self.parts)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread: off the event loop


def load_bundle(spec: ModelSpec, options: EngineOptions) -> ModelBundle:
    """Load a checkpoint folder, a .gguf file or an embedded default (spec.path None) into a bundle (blocking)."""
    return load_manifest(probe(spec), options)


def load_manifest(manifest: BundleManifest, options: EngineOptions) -> ModelBundle:
    """Fetch (an embedded default), build the engine and every part the manifest declares (blocking).

    Raises ValueError with a one-line reason when the checkpoint cannot be served; the engine is shut down again if
    a later part fails.
    """
    source = manifest.source or manifest.embedded.ensure()  # type: ignore[union-attr]
    source, options = part_table.prepare(manifest.parts, source, options)
    if not part_table.needs_engine(manifest.parts):  # a voice: its part is the whole model
        parts = part_table.load(manifest.parts, source, None, options)  # type: ignore[arg-type]
        return ModelBundle(manifest=manifest, source=source, engine=None, prompt_builder=None, parts=parts)
    engine = _build_engine(source, options, manifest)
    try:
        if engine.tokenizer is None:
            raise ValueError(f"{source} has no tokenizer; the text API needs one")
        parts = part_table.load(manifest.parts, source, engine, options)
    except BaseException:
        engine.shutdown()
        raise
    if manifest.planned_parts:
        log.warning(
            "%s also holds %s weights of a family omnivox does not build; serving its text decoder only",
            source,
            " and ".join(manifest.planned_parts),
        )
    builder = part_table.prompt_builder(parts, engine)
    return ModelBundle(manifest=manifest, source=source, engine=engine, prompt_builder=builder, parts=parts)


def _hold_step_budget(engine, options: EngineOptions):
    """`serve --max-step-tokens` / `--max-step-ms`: the mixed-step budget (engine/step_budget.py), measured here."""
    from omnivox.engine.step_budget import hold_step_ms, hold_step_tokens

    if getattr(engine.model, "is_encoder_decoder", False):  # Whisper: 448-token decodes, no prompt to bound, and
        return engine  # its requests need audio, which the step-time calibration has none of
    if options.max_step_tokens is not None:
        hold_step_tokens(engine, options.max_step_tokens)
    elif options.max_step_ms is not None:
        hold_step_ms(engine, options.max_step_ms)
    return engine


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
            engine = Engine.from_pretrained(str(source), options)  # an EngineOptions is an EngineConfig
            return _hold_step_budget(engine, options)
        except NotApplicable as e:
            if e.field not in manifest.lenient_fields or getattr(options, e.field) == getattr(base, e.field):
                raise
            log.warning("%s: %s; it loads without that flag (given for every served model)", Path(source).name, e)
            options = dataclasses.replace(options, **{e.field: getattr(base, e.field)})
