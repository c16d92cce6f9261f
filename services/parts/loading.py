"""Loading a spec into a ServedModel's bundle: its path checked, its manifest probed, its bundle built.

What to serve (ModelSpec) and how to run it (EngineOptions) are services/parts/model_spec.py's; ModelLoadError
(services/errors.py) is what a spec that cannot be served raises."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnivox.services.errors import ModelLoadError
from omnivox.services.parts.bundle import load_manifest, probe
from omnivox.services.parts.model_spec import EngineOptions, ModelSpec
from omnivox.services.parts.registry import ServedModel

log = logging.getLogger(__name__)


def model_name_for(path: Path) -> str:
    """A request-friendly name: the folder's name, or the .gguf / .onnx file's stem (a Piper voice folder's .onnx
    stem: its folder is often just `data`), lower-cased."""
    from omnivox.models.voice.piper_config import find_piper_voice

    if path.is_dir() and (voice := find_piper_voice(path)) is not None:
        path = voice[0]
    return (path.stem if path.suffix in (".gguf", ".onnx") else path.name).lower()


def check_model_path(path: str | Path) -> Path:
    """Raise ModelLoadError unless path is a checkpoint folder (config.json), a .gguf file or a voice (a Piper
    NAME.onnx + NAME.onnx.json, as a folder or the .onnx file)."""
    from omnivox.services.parts.voice_part import check_voice_path, is_voice_path

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such file or folder: {path}")
    if is_voice_path(path):
        check_voice_path(path)
        return path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but not a checkpoint (it has no config.json)")
    elif path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a checkpoint folder nor a .gguf file")
    return path.resolve()


def check_sampling_overrides(overrides: Mapping[str, Any]) -> None:
    """ModelLoadError unless every override is a SamplingParams field with a value the engine's table accepts."""
    from omnivox.engine import SamplingParams

    try:
        params = SamplingParams(**overrides)
    except TypeError as exc:
        raise ModelLoadError(f"unknown sampling default: {exc}") from None
    problems = [f"{p.field} {p.description}" for p in params.violations(vocab_size=1 << 31)]
    if problems:
        raise ModelLoadError(f"bad sampling default: {'; '.join(problems)}")


def resolve(spec: ModelSpec, is_default: bool, max_queue: int) -> ServedModel:
    """A LOADING ServedModel for spec, after checking its path (cheap: only small files are read here)."""
    if spec.path is not None:
        spec = dataclasses.replace(spec, path=check_model_path(spec.path))
    check_sampling_overrides(spec.sampling_overrides)
    manifest = probe(spec)
    if manifest.embedded is not None:
        name = spec.name or manifest.embedded.name
    else:
        assert manifest.source is not None
        name = spec.name or model_name_for(manifest.source)
    return ServedModel(name=name, manifest=manifest, is_default=is_default, max_queue=max_queue)


def load(model: ServedModel, options: EngineOptions) -> None:
    """Fetch (an embedded default) and build the model's bundle, then mark it ready.

    Blocking: the server runs it in a worker thread while health reports NOT_SERVING.
    """
    what = model.manifest.source or "the embedded default"
    try:
        bundle = load_manifest(model.manifest, options)
    except Exception as exc:
        model.set_failed(f"{type(exc).__name__}: {exc}")
        raise ModelLoadError(f"cannot load {model.name!r} from {what}: {exc}") from exc
    if bundle.untrained_components:
        log.warning(
            "model %r has randomly initialised components (%s): their output is noise",
            model.name,
            ", ".join(bundle.untrained_components),
        )
    model.set_ready(bundle)
