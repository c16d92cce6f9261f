"""The models a server serves, by name: their engines, what they accept, and how many requests they admit."""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnivox.services import errors

if TYPE_CHECKING:
    from omnivox.engine import Engine
    from omnivox.services.prompt import PromptBuilder

TEXT, IMAGE, AUDIO = "text", "image", "audio"


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ServedModel:
    """One model behind the API. Created LOADING (no engine yet); `set_ready` attaches the engine.

    `max_queue` bounds the requests admitted at once (waiting + running in the engine); one more gets
    RESOURCE_EXHAUSTED with a RetryInfo.
    """

    name: str
    source: Path | None  # None until the embedded default is fetched
    is_default: bool = False
    max_queue: int = 256
    input_modalities: frozenset[str] = frozenset({TEXT})
    output_modalities: frozenset[str] = frozenset({TEXT})
    untrained_components: tuple[str, ...] = ()
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields the model prefers
    state: ModelState = ModelState.LOADING
    engine: Engine | None = None
    prompt_builder: PromptBuilder | None = None
    error: str | None = None  # why loading failed
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_ready(self, engine: Engine, prompt_builder: PromptBuilder) -> None:
        self.engine = engine
        self.prompt_builder = prompt_builder
        self.state = ModelState.READY

    def set_failed(self, error: str) -> None:
        self.error = error
        self.state = ModelState.FAILED

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


class ModelRegistry:
    """Served models by name; the first one added with is_default (or the first one at all) is the default."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.draining = False

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

    def shutdown(self) -> None:
        for model in self:
            if model.engine is not None:
                model.engine.shutdown()
