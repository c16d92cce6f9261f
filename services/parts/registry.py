"""The models a server serves, by name: their bundles, their state, and how many requests they admit."""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnivox.engine.arbiter import StepArbiter
from omnivox.services import errors
from omnivox.services.parts.bundle import AUDIO, IMAGE, TEXT, BundleManifest, ModelBundle
from omnivox.services.processing.stream_idle import DEFAULT_STREAM_IDLE_S

if TYPE_CHECKING:
    from omnivox.engine import Engine
    from omnivox.services.processing.prompt import PromptBuilder

__all__ = ["AUDIO", "IMAGE", "TEXT", "ModelRegistry", "ModelState", "ServedModel"]


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ServedModel:
    """One model behind the API: a name, a state, a queue bound, and (once loaded) its ModelBundle.

    Created LOADING with the manifest of what its spec declares (so ListModels can describe it while it loads);
    `set_ready` attaches the bundle, whose parts then decide what the model accepts and produces.
    `max_queue` bounds the requests admitted at once (waiting + running in the engine); one more gets
    RESOURCE_EXHAUSTED with a RetryInfo.
    """

    name: str
    manifest: BundleManifest
    is_default: bool = False
    max_queue: int = 256
    state: ModelState = ModelState.LOADING
    bundle: ModelBundle | None = None
    error: str | None = None  # why loading failed
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_ready(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.state = ModelState.READY

    def set_failed(self, error: str) -> None:
        self.error = error
        self.state = ModelState.FAILED

    # What the bundle holds once loaded; what the manifest declares before.
    @property
    def source(self) -> Path | None:
        return self.bundle.source if self.bundle is not None else self.manifest.source

    @property
    def engine(self) -> Engine | None:
        return self.bundle.engine if self.bundle is not None else None

    @property
    def prompt_builder(self) -> PromptBuilder | None:
        return self.bundle.prompt_builder if self.bundle is not None else None

    @property
    def input_modalities(self) -> frozenset[str]:
        return (self.bundle or self.manifest).input_modalities

    @property
    def output_modalities(self) -> frozenset[str]:
        return (self.bundle or self.manifest).output_modalities

    @property
    def untrained_components(self) -> tuple[str, ...]:
        return self.manifest.untrained_components

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """SamplingParams fields a request leaves unset take these values (the model's, then the operator's)."""
        return self.bundle.generation_defaults if self.bundle is not None else self.manifest.sampling_defaults

    @property
    def context_length(self) -> int:
        return self.engine.model_config.max_model_len if self.engine is not None else 0

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.model_config.vocab_size

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one of `max_queue` slots for the duration of a request, or raise RESOURCE_EXHAUSTED."""
        with self._lock:
            if self._in_flight >= self.max_queue:
                raise errors.resource_exhausted(
                    f"model {self.name!r} has {self._in_flight} requests in flight (the limit is {self.max_queue}); "
                    "retry later",
                    retry_after_s=1.0,
                )
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1


AUTO_ASR = "auto"  # `serve --asr-model auto` (the default): the cascade on when a Whisper model is served with others


class ModelRegistry:
    """Served models by name; the first one added with is_default (or the first one at all) is the default."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.draining = False
        self.asr_model: str | None = None  # `serve --asr-model`: transcribes Generate's audio for text models
        # `serve --stream-idle-timeout`: a bidirectional stream receiving nothing this long (with nothing of its
        # client's in hand) ends OUT_OF_RANGE, freeing its slot (services/processing/stream_idle.py); None = no bound.
        self.stream_idle_s: float | None = DEFAULT_STREAM_IDLE_S
        self.arbiter = StepArbiter()  # one across the process's engines: audio behind its deadline steps first

    def add(self, model: ServedModel) -> None:
        if model.name in self._models:
            raise ValueError(f"two models are named {model.name!r}; give one another name with --name")
        if model.is_default and self.default is not None:
            raise ValueError(f"both {self.default.name!r} and {model.name!r} are marked default")
        self._models[model.name] = model

    @property
    def default(self) -> ServedModel | None:
        for model in self._models.values():
            if model.is_default:
                return model
        return next(iter(self._models.values()), None)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def set_asr_model(self, name: str | None) -> None:
        """`serve --asr-model`: ModelLoadError unless `name` is None (off), AUTO_ASR or a served Whisper model (known
        before loading). AUTO_ASR (the default): the first served Whisper model when anything else is served beside
        it, so the embedded bundle answers spoken questions (`omnivox ask --audio` on a fresh `omnivox serve`)."""
        if name == AUTO_ASR:
            whisper = [n for n, m in self._models.items() if "whisper" in m.manifest.parts]
            self.asr_model = whisper[0] if whisper and len(whisper) < len(self._models) else None
            return
        model = self._models.get(name) if name is not None else None
        if name is not None and (model is None or "whisper" not in model.manifest.parts):
            raise errors.ModelLoadError(
                f"--asr-model {name!r} is not a served Whisper model (served: {', '.join(self._models)})"
            )
        self.asr_model = name

    def lookup(self, name: str) -> ServedModel:
        """The model called `name` (empty: the default), in any state; NOT_FOUND when there is none."""
        model = self._models.get(name) if name else self.default
        if model is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise errors.not_found("model", name, f"no model named {name!r} is served (served: {known})")
        return model

    def get_ready(self, name: str) -> ServedModel:
        """The model called `name`, ready to take requests; UNAVAILABLE while loading or draining."""
        model = self.lookup(name)
        if self.draining:
            raise errors.unavailable("the server is shutting down", retry_after_s=1.0)
        if model.state is ModelState.LOADING:
            raise errors.unavailable(f"model {model.name!r} is still loading", retry_after_s=2.0)
        if model.state is ModelState.FAILED:
            raise errors.failed_precondition(f"model {model.name!r} failed to load: {model.error}")
        return model

    def in_flight(self) -> int:
        """Requests admitted across all models (what a drain waits for)."""
        return sum(m.in_flight for m in self._models.values())

    async def aclose(self) -> None:
        """Stop every loaded bundle (codec workers, engines)."""
        for model in self:
            if model.bundle is not None:
                await model.bundle.aclose()
