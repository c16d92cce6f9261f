"""What to serve (ModelSpec), how to run it (EngineOptions), and loading a spec into a ServedModel."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from omnivox.services.prompt import ChatPromptBuilder
from omnivox.services.registry import AUDIO, TEXT, ServedModel

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model that cannot be served, with a one-line reason for the person who asked for it."""


@dataclass(frozen=True)
class ModelSpec:
    """One `--model`: a Hugging Face checkpoint folder or a .gguf file; path None means the embedded default."""

    path: str | Path | None = None
    name: str | None = None
    speech: bool = False  # with path None: the embedded random speech model (services/speech.py) instead


@dataclass(frozen=True)
class EngineOptions:
    device: str | None = None
    dtype: str | None = None
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # per engine step; None = the engine's default for the device
    progress: bool = False  # progress bars while loading weights


# Sampling defaults a Hugging Face generation_config.json may carry, as SamplingParams fields.
_GENERATION_CONFIG_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def model_name_for(path: Path) -> str:
    """A request-friendly name: the folder's name, or the .gguf file's stem, lower-cased."""
    return (path.stem if path.suffix == ".gguf" else path.name).lower()


def check_model_path(path: str | Path) -> Path:
    """Raise ModelLoadError unless path is a checkpoint folder (config.json) or a .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such file or folder: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but not a checkpoint (it has no config.json)")
    elif path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a checkpoint folder nor a .gguf file")
    return path.resolve()


def sampling_defaults(path: Path) -> dict[str, float | int]:
    """The model's preferred sampling values from generation_config.json, when the checkpoint has one."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: config[k] for k in _GENERATION_CONFIG_KEYS if isinstance(config.get(k), int | float)}


def resolve(spec: ModelSpec, is_default: bool, max_queue: int) -> ServedModel:
    """A LOADING ServedModel for spec, after checking its path (cheap: nothing is fetched or read here)."""
    if spec.path is None and spec.speech:
        from omnivox.services.defaults import DEFAULT_SPEECH_MODEL_NAME, DEFAULT_SPEECH_UNTRAINED

        return ServedModel(
            name=spec.name or DEFAULT_SPEECH_MODEL_NAME,
            source=None,
            is_default=is_default,
            max_queue=max_queue,
            output_modalities=frozenset({AUDIO}),
            untrained_components=DEFAULT_SPEECH_UNTRAINED,
        )
    if spec.path is None:
        from omnivox.services.defaults import DEFAULT_MODEL_NAME

        return ServedModel(
            name=spec.name or DEFAULT_MODEL_NAME, source=None, is_default=is_default, max_queue=max_queue
        )
    path = check_model_path(spec.path)
    speech = path.is_dir() and (path / "speech_layout.json").is_file()  # a speech model: services/speech.py
    return ServedModel(
        name=spec.name or model_name_for(path),
        source=path,
        is_default=is_default,
        max_queue=max_queue,
        output_modalities=frozenset({AUDIO}) if speech else frozenset({TEXT}),
        untrained_components=untrained_components(path),
        sampling_defaults=sampling_defaults(path),
    )


def untrained_components(path: Path) -> tuple[str, ...]:
    """Components a checkpoint folder declares randomly initialised (`untrained_components.json`: a list of names)."""
    file = path / "untrained_components.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return ()
    try:
        names = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return ()
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


def load(model: ServedModel, options: EngineOptions) -> None:
    """Fetch (the default) and build the engine for a resolved model, then mark it ready.

    Blocking: the server runs it in a worker thread while health reports NOT_SERVING.
    """
    from omnivox.engine import Engine

    if model.source is None:  # the embedded default: fetched into the cache on first use
        from omnivox.services.defaults import ensure_default_model, ensure_default_speech_model

        try:
            model.source = ensure_default_speech_model() if AUDIO in model.output_modalities else ensure_default_model()
        except Exception as exc:
            model.set_failed(f"{type(exc).__name__}: {exc}")
            raise ModelLoadError(f"cannot fetch the default model: {exc}") from exc
    try:
        engine = Engine.from_pretrained(
            str(model.source),
            device=options.device,
            dtype=options.dtype,
            kv_cache_gib=options.kv_cache_gib,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=options.max_model_len,
            progress=options.progress,
        )
    except Exception as exc:
        model.set_failed(f"{type(exc).__name__}: {exc}")
        raise ModelLoadError(f"cannot load {model.name!r} from {model.source}: {exc}") from exc
    if engine.tokenizer is None:
        model.set_failed("the checkpoint has no tokenizer")
        engine.shutdown()
        raise ModelLoadError(f"{model.source} has no tokenizer; the text API needs one")
    if model.untrained_components:
        log.warning(
            "model %r has randomly initialised components (%s): their output is noise",
            model.name,
            ", ".join(model.untrained_components),
        )
    model.set_ready(engine, ChatPromptBuilder(engine.tokenizer))
