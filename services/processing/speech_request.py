"""Speech request processing (both speech RPCs): which model speaks, the synthesis plan, each segment's prompt and
sampling parameters. Refusals are ServiceErrors carrying FieldViolations (services/errors.py).

SynthesizeSpeech: `speech_model` -> `plan_synthesis` (validate, split the text into segments, one prompt and one
SamplingParams per segment). StreamingSynthesizeSpeech: `speech_model` -> `check_stream_config` (the same checks, its
fields named `config.<field>`) -> `segment_params` per clause as its text completes.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnivox.engine import InvalidRequest, SamplingParams, shared
from omnivox.engine.params import MAX_SEED
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.services.parts.speech_part import SpeechPart
from omnivox.services.processing.speech_text import MAX_SEGMENT_CHARS, split_text
from omnivox.services.processing.speech_validation import SpeechPlan, invalid, validate_speech
from omnivox.v1 import speech_pb2


@dataclass
class SpeechLimits:
    max_text_chars: int = 5000
    max_segment_chars: int = MAX_SEGMENT_CHARS  # sentences are grouped into segments of at most this many characters
    max_parallel_segments: int = 8  # engine requests in flight per synthesis request
    # Audio budget per segment (a trained model ends with end-of-speech well before): base + per character.
    audio_seconds_base: float = 2.0
    audio_seconds_per_char: float = 0.12


@dataclass
class SynthesisJob:
    """One SynthesizeSpeech as the engine takes it: a prompt and its parameters per segment."""

    model: ServedModel
    part: SpeechPart
    plan: SpeechPlan
    prompts: list[list[int]]
    params: list[SamplingParams]
    request_id: str  # the client's, or ours
    salt: str  # this caller's (and cache_salt's) share of the prefix cache


def produces_speech(model: ServedModel) -> bool:
    return AUDIO in model.output_modalities


def speech_model(registry: ModelRegistry, name: str) -> ServedModel:
    """The ready speech model called `name`, or (no name) the default model if it speaks, else the first that does."""
    if name:
        model = registry.lookup(name)
        if not produces_speech(model):
            raise errors.invalid_argument([FieldViolation("model", f"model {model.name!r} does not produce speech")])
    else:
        default = registry.default
        candidates = [default] if default is not None and produces_speech(default) else []
        candidates += [m for m in registry if produces_speech(m)]
        if not candidates:
            raise errors.not_found("model", "", "this server serves no speech model")
        model = candidates[0]
    return registry.get_ready(model.name)


def layout_of(model: ServedModel) -> SpeechLayout | None:
    """The model's speech layout: its bundle's once loaded, read from its folder while it loads."""
    if model.bundle is not None:
        return model.bundle.speech.layout if model.bundle.speech is not None else None
    if "speech" in model.manifest.parts and model.source is not None:
        return SpeechLayout.load(model.source)
    return None


def plan_synthesis(
    request: speech_pb2.SynthesizeSpeechRequest, model: ServedModel, limits: SpeechLimits, created: Mapping[str, Any],
    salt: str,
) -> SynthesisJob:  # fmt: skip
    """Validate, split the text into segments, and build each segment's prompt and parameters. `created`: the
    model's created voices by name (services/parts/voices.py)."""
    assert model.bundle is not None and model.bundle.speech is not None  # a ready speech model
    part = model.bundle.speech
    layout = part.layout
    plan = validate_speech(request, model, layout, limits.max_text_chars, created)
    plan.segments = split_text(plan.text, limits.max_segment_chars)
    if (ref := created.get(plan.voice)) is not None and plan.voice not in layout.voices:
        prompts = [layout.build_reference_prompt(part.text_tokenizer, ref.transcript, ref.frames, s)
                   for s in plan.segments]  # fmt: skip
    else:
        prompts = [layout.build_prompt(part.text_tokenizer, s, plan.voice) for s in plan.segments]
    params = [segment_params(plan, model, part, limits, text, prompt, i)
              for i, (text, prompt) in enumerate(zip(plan.segments, prompts, strict=True))]  # fmt: skip
    return SynthesisJob(model, part, plan, prompts, params, request.request_id or uuid.uuid4().hex, salt)


@contextlib.contextmanager
def config_fields() -> Iterator[None]:
    """Field checks of SynthesizeSpeech applied to a streaming config: their fields renamed `config.<field>`."""
    try:
        yield
    except errors.ServiceError as err:
        if not err.field_violations:  # not INVALID_ARGUMENT (NOT_FOUND, UNAVAILABLE): as it is
            raise
        raise errors.invalid_argument(
            [FieldViolation(f"config.{v.field}", v.description) for v in err.field_violations]
        ) from None


def check_stream_config(
    cfg: speech_pb2.StreamingSpeechConfig, model: ServedModel, limits: SpeechLimits, created: Mapping[str, Any]
) -> SpeechPlan:
    """The checks of SynthesizeSpeech on a streaming config (call it inside `config_fields()`)."""
    assert model.bundle is not None and model.bundle.speech is not None and model.engine is not None
    probe = speech_pb2.SynthesizeSpeechRequest(
        model=cfg.model, text=".", voice=cfg.voice, audio_config=cfg.audio_config, sampling=cfg.sampling
    )
    return validate_speech(probe, model, model.bundle.speech.layout, limits.max_text_chars, created)


def segment_params(
    plan: SpeechPlan,
    model: ServedModel,
    part: SpeechPart,
    limits: SpeechLimits,
    text: str,
    prompt: Sequence[int],
    index: int,
) -> SamplingParams:
    """One segment's (or clause's) parameters: an audio budget for its text, whole frames, the audio constraint."""
    layout = part.layout
    context = model.context_length
    room = (context - len(prompt)) // layout.frame_size
    if room < 1:
        raise errors.invalid_argument(
            [FieldViolation("text", f"a segment's prompt is {len(prompt)} tokens; the context is {context}")]
        )
    seconds = limits.audio_seconds_base + limits.audio_seconds_per_char * len(text)
    frames = min(room, math.ceil(seconds * layout.sample_rate / part.codec.frame_samples))
    kwargs = dict(plan.sampling)
    if "seed" in kwargs:
        # segments differ, the request stays reproducible (wrapped: the seed range ends at MAX_SEED)
        kwargs["seed"] = (int(kwargs["seed"]) + index) % (MAX_SEED + 1)
    if part.constraint is not None:  # audio tokens in the vocabulary: the layout's, ended by end-of-speech
        kwargs.update(stop_token_ids=[layout.end_of_speech], constraint_factory=shared(part.constraint))
    params = SamplingParams(
        **kwargs,  # type: ignore[arg-type]
        max_tokens=frames * layout.frame_size,
        detokenize=False,  # the audio codes are read as token ids; their text is never used
    )
    try:
        params.validate(model.vocab_size)
    except InvalidRequest as err:
        raise invalid(err) from err
    return params
