"""What to serve (ModelSpec: one `--model`) and how to run it (EngineOptions: the engine's configuration plus the
knobs of the model's parts). Plain values, read by services/parts/loading.py, services/parts/bundle.py and services/parts/table.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnivox.engine.engine_config import EngineConfig

if TYPE_CHECKING:
    from omnivox.codecs.streaming import StreamingOptions


@dataclass(frozen=True)
class ModelSpec:
    """One `--model`: a Hugging Face checkpoint folder or a .gguf file; path None means the embedded default."""

    path: str | Path | None = None
    name: str | None = None
    speech: bool = False  # with path None: the embedded random speech model (services/parts/defaults.py) instead
    asr: bool = False  # with path None: the embedded whisper-base (services/parts/defaults.py) instead
    voice: bool = False  # with path None: the embedded hibari voice (services/parts/defaults.py) instead
    image: bool = False  # with path None: the embedded image model (services/parts/vision_defaults.py) instead
    # SamplingParams fields that replace the model's own defaults (`serve --sampling-default`), checked by the CLI.
    sampling_overrides: Mapping[str, Any] = field(default_factory=dict)
    # EngineOptions fields for this model alone (`serve --quantization NAME=...`, `--speculative NAME=...`,
    # `--activation-bits NAME=...`).
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Those of engine_overrides an unnamed flag set (`--quantization int8`): for every model that can take them, so
    # a model that cannot (float-only Whisper) loads without them and a warning; a NAME= flag is strict.
    lenient_fields: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EngineOptions(EngineConfig):
    """How the server runs each model: the engine's configuration (engine/engine_config.py, read by
    Engine.from_pretrained as it is) plus the service's own knobs of the model's parts."""

    # A step with decodes in it carries at most this many tokens (engine/step_budget.py), or as many as cost about
    # max_step_ms by this machine's own step times measured at load; None for both = the whole max_num_batched_tokens.
    max_step_tokens: int | None = None
    max_step_ms: float | None = None
    speech_streaming: StreamingOptions | None = None  # codec windows of speech models; None = the codec's defaults
    image_cache_mib: int = 256  # encoder cache of each vision model: encoded images kept for reuse (MiB)
    # Transcribe and StreamingTranscribe (one rule, so a streamed result is Transcribe's of its span) encode a clip
    # that ends SHORT_WINDOW_MARGIN_S before this window in it (services/parts/whisper_part.py); None = the 30 s
    # window, transformers' own. Realtime turns take their 10 s window either way (`serve --whisper-short-window`).
    whisper_short_window_s: float | None = None
    # Short windows (the realtime turn's, --whisper-short-window's) through an int8 copy of the encoder (Q8_0 blocks,
    # models/audio/whisper_int8.py) where the CPU block kernels run. Off by default: on 32 clips its 10 s WER equals
    # float's (0.048) at 0.84-0.91x float's encoder time in three runs (BENCHMARKS.md "Whisper short windows"), a
    # small gain the realtime runs were not remeasured with (`serve --whisper-int8-short-window`).
    whisper_short_window_int8: bool = False
    max_request_megapixels: float = 48.0  # decoded pixels of all the images of one request (codecs/image.py)
    # Weights: "none" = float dtype (a GGUF dequantised), "auto" = what the checkpoint carries (a GGUF at its own bit
    # widths on CPU), "int8" / "int4" = linear layers quantised at load (models/loading.py). "auto" is the default:
    # with int16 activations the embedded SmolLM2 Q4_1 at its own precision computes what its dequantised float32
    # copy does (perplexity +0.0003 %, 20 of 20 greedy continuations identical, "Paris"; int8 activations had
    # answered "L'Étoile, ...") from 18 % of the weight bytes, several times faster at batch 1 (BENCHMARKS.md).
    # Off CPU "auto" is float (block layers have no fast kernel there); a safetensors checkpoint loads as it is.
    quantization: str = "auto"
    # tensor_parallel (EngineConfig): one tensor-parallel model per server process.
