"""What to serve (ModelSpec), how to run it (EngineOptions), and loading a spec into a ServedModel's bundle."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnivox.services.registry import ServedModel

if TYPE_CHECKING:
    from omnivox.codecs.streaming import StreamingOptions

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model that cannot be served, with a one-line reason for the person who asked for it."""


@dataclass(frozen=True)
class ModelSpec:
    """One `--model`: a Hugging Face checkpoint folder or a .gguf file; path None means the embedded default."""

    path: str | Path | None = None
    name: str | None = None
    speech: bool = False  # with path None: the embedded random speech model (services/defaults.py) instead
    asr: bool = False  # with path None: the embedded whisper-base (services/defaults.py) instead
    voice: bool = False  # with path None: the embedded hibari voice (services/defaults.py) instead
    # SamplingParams fields that replace the model's own defaults (`serve --sampling-default`), checked by the CLI.
    sampling_overrides: Mapping[str, Any] = field(default_factory=dict)
    # EngineOptions fields for this model alone (`serve --quantization NAME=...`, `--speculative NAME=...`,
    # `--activation-bits NAME=...`).
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Those of engine_overrides an unnamed flag set (`--quantization int8`): for every model that can take them, so
    # a model that cannot (float-only Whisper) loads without them and a warning; a NAME= flag is strict.
    lenient_fields: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EngineOptions:
    device: str | None = None
    dtype: str | None = None
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # per engine step; None = the engine's default for the device
    progress: bool = False  # progress bars while loading weights
    speech_streaming: StreamingOptions | None = None  # codec windows of speech models; None = the codec's defaults
    image_cache_mib: int = 256  # encoder cache of each vision model: encoded images kept for reuse (MiB)
    max_request_megapixels: float = 48.0  # decoded pixels of all the images of one request (codecs/image.py)
    # Weights: "none" = float dtype (a GGUF dequantised), "auto" = what the checkpoint carries (a GGUF at its own bit
    # widths on CPU), "int8" / "int4" = linear layers quantised at load (models/loading.py). "auto" is the default:
    # with int16 activations the embedded SmolLM2 Q4_1 at its own precision computes what its dequantised float32
    # copy does (perplexity +0.0003 %, 20 of 20 greedy continuations identical, "Paris"; int8 activations had
    # answered "L'Étoile, ...") from 18 % of the weight bytes, several times faster at batch 1 (BENCHMARKS.md).
    # Off CPU "auto" is float (block layers have no fast kernel there); a safetensors checkpoint loads as it is.
    quantization: str = "auto"
    quantize_lm_head: bool | None = None  # None: as the checkpoint carries it
    # Activations of quantised weights' kernels: 16, or 8 (llama.cpp's Q8_1; models/quant.py apply_activation_bits).
    activation_bits: int = 16
    speculative: str | None = None  # "ngram" or "draft:PATH" (engine/speculative.py, engine/draft.py); None = off
    num_speculative_tokens: int = 4
    # Processes the decoder is split over (engine/tensor_parallel.py): heads and MLP per rank, one all-reduce per
    # attention and per MLP block. 1 = one process. One tensor-parallel model per server process.
    tensor_parallel: int = 1


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
    from omnivox.services.voice_part import check_voice_path, is_voice_path

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
    from omnivox.services.bundle import probe

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
    from omnivox.services.bundle import load_manifest

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
