"""Request validation: every rejected value becomes a FieldViolation naming its field in the request message.

Checks are collected, not stopped at the first, so that a client learns of every bad value in one round trip.
Field paths follow google.rpc.BadRequest conventions: `contents[0].parts[1].image`, `sampling.temperature`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnivox.engine.errors import InvalidRequest
from omnivox.engine.params import SamplingParams
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.registry import AUDIO, IMAGE, TEXT, ServedModel
from omnivox.v1 import generation_pb2, sampling_pb2

ROLES = ("system", "user", "assistant")
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_REQUEST_ID_CHARS = 256

# Engine field names (SamplingParams / prompt) -> the request field that carries them.
ENGINE_TO_REQUEST_FIELD = {
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "logit_bias": "sampling.logit_bias",
    "seed": "sampling.seed",
    "max_tokens": "max_output_tokens",
    "min_tokens": "min_output_tokens",
    "stop": "stop_sequences",
    "stop_token_ids": "stop_token_ids",
    "logprobs": "top_logprobs",
    "prompt": "contents",
    "segments": "contents",
}


def request_field(engine_field: str) -> str:
    return ENGINE_TO_REQUEST_FIELD.get(engine_field, engine_field)


def from_invalid_request(err: InvalidRequest) -> errors.ServiceError:
    """An engine InvalidRequest as INVALID_ARGUMENT naming the request field."""
    return errors.invalid_argument([FieldViolation(request_field(err.field), err.description)])


class Violations:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.items.append(FieldViolation(field, description))

    def raise_if_any(self) -> None:
        if self.items:
            raise errors.invalid_argument(self.items)


_PART_KIND_TO_MODALITY = {"text": TEXT, "image": IMAGE, "audio": AUDIO}


def check_contents(request: generation_pb2.GenerateRequest, model: ServedModel, v: Violations) -> None:
    if not request.contents:
        v.add("contents", "must hold at least one turn")
        return
    for i, content in enumerate(request.contents):
        if content.role and content.role not in ROLES:
            v.add(f"contents[{i}].role", f"unknown role {content.role!r}; expected one of {', '.join(ROLES)}")
        if not content.parts:
            v.add(f"contents[{i}].parts", "must hold at least one part")
        for j, part in enumerate(content.parts):
            path = f"contents[{i}].parts[{j}]"
            kind = part.WhichOneof("kind")
            if kind is None:
                v.add(path, "empty part: set one of text, image, audio")
                continue
            modality = _PART_KIND_TO_MODALITY[kind]
            if modality not in model.input_modalities:
                accepted = ", ".join(sorted(model.input_modalities))
                v.add(f"{path}.{kind}", f"model {model.name!r} does not accept {kind} input (it accepts: {accepted})")
            elif kind == "image" and not part.image.data:
                v.add(f"{path}.image.data", "must not be empty")
            elif kind == "audio" and not part.audio.data:
                v.add(f"{path}.audio.data", "must not be empty")


def _finite(v: Violations, field: str, value: float) -> bool:
    if not math.isfinite(value):
        v.add(field, f"must be a finite number, got {value}")
        return False
    return True


def sampling_params(
    sampling: sampling_pb2.SamplingConfig, model: ServedModel, v: Violations, prefix: str = "sampling"
) -> dict[str, object]:
    """Check the SamplingConfig and return the SamplingParams keyword arguments it sets (model defaults first)."""
    kwargs: dict[str, object] = dict(model.sampling_defaults)

    def has(name: str) -> bool:
        return sampling.HasField(name)

    f = f"{prefix}."
    if has("temperature") and _finite(v, f + "temperature", sampling.temperature):
        if sampling.temperature < 0:
            v.add(f + "temperature", f"must be >= 0 (0 = greedy), got {sampling.temperature}")
        kwargs["temperature"] = sampling.temperature
    if has("top_k"):
        if sampling.top_k < 0:
            v.add(f + "top_k", f"must be >= 0 (0 = off), got {sampling.top_k}")
        kwargs["top_k"] = sampling.top_k
    if has("top_p") and _finite(v, f + "top_p", sampling.top_p):
        if not 0.0 < sampling.top_p <= 1.0:
            v.add(f + "top_p", f"must be in (0, 1], got {sampling.top_p}")
        kwargs["top_p"] = sampling.top_p
    if has("min_p") and _finite(v, f + "min_p", sampling.min_p):
        if not 0.0 <= sampling.min_p <= 1.0:
            v.add(f + "min_p", f"must be in [0, 1], got {sampling.min_p}")
        kwargs["min_p"] = sampling.min_p
    if has("repetition_penalty") and _finite(v, f + "repetition_penalty", sampling.repetition_penalty):
        if sampling.repetition_penalty <= 0:
            v.add(f + "repetition_penalty", f"must be > 0 (1 = off), got {sampling.repetition_penalty}")
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    for name in ("presence_penalty", "frequency_penalty"):
        if has(name) and _finite(v, f + name, getattr(sampling, name)):
            value = getattr(sampling, name)
            if not -2.0 <= value <= 2.0:
                v.add(f + name, f"must be in [-2, 2], got {value}")
            kwargs[name] = value
    if has("seed"):
        kwargs["seed"] = sampling.seed
    if sampling.logit_bias:
        vocab = model.vocab_size
        bias: dict[int, float] = {}
        for token_id, value in sampling.logit_bias.items():
            if not 0 <= token_id < vocab:
                v.add(f + "logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab})")
            elif not math.isfinite(value) and value != -math.inf:
                v.add(f + "logit_bias", f"bias for token {token_id} must be finite or -inf, got {value}")
            else:
                bias[token_id] = value
        kwargs["logit_bias"] = bias
    return kwargs


def check_stopping(request: generation_pb2.GenerateRequest, model: ServedModel, v: Violations) -> dict[str, object]:
    kwargs: dict[str, object] = {}
    context = model.context_length
    if request.HasField("max_output_tokens"):
        if request.max_output_tokens < 1:
            v.add("max_output_tokens", f"must be >= 1, got {request.max_output_tokens}")
        elif request.max_output_tokens > context:
            v.add(
                "max_output_tokens",
                f"{request.max_output_tokens} is above the context length of {model.name!r} ({context})",
            )
        kwargs["max_tokens"] = request.max_output_tokens
    if request.HasField("min_output_tokens"):
        if request.min_output_tokens < 0:
            v.add("min_output_tokens", f"must be >= 0, got {request.min_output_tokens}")
        elif request.HasField("max_output_tokens") and request.min_output_tokens > request.max_output_tokens:
            v.add(
                "min_output_tokens",
                f"{request.min_output_tokens} is above max_output_tokens ({request.max_output_tokens})",
            )
        kwargs["min_tokens"] = request.min_output_tokens
    if request.stop_sequences:
        if len(request.stop_sequences) > MAX_STOP_SEQUENCES:
            v.add("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(request.stop_sequences)}")
        if any(s == "" for s in request.stop_sequences):
            v.add("stop_sequences", "stop sequences must not be empty")
        kwargs["stop"] = list(request.stop_sequences)
    if request.stop_token_ids:
        vocab = model.vocab_size
        bad = [t for t in request.stop_token_ids if not 0 <= t < vocab]
        if bad:
            v.add("stop_token_ids", f"ids {bad} are outside the vocabulary [0, {vocab})")
        kwargs["stop_token_ids"] = list(request.stop_token_ids)
    kwargs["ignore_eos"] = request.ignore_eos
    kwargs["include_stop_str_in_output"] = request.include_stop_sequence
    if request.HasField("top_logprobs"):
        if not request.logprobs:
            v.add("top_logprobs", "needs logprobs = true")
        elif not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            v.add("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
    if request.logprobs:
        kwargs["logprobs"] = request.top_logprobs
    return kwargs


@dataclass
class ValidatedGenerate:
    params: SamplingParams


def validate_generate(request: generation_pb2.GenerateRequest, model: ServedModel) -> ValidatedGenerate:
    """Every check that needs no tokenization; raises INVALID_ARGUMENT listing every bad field."""
    v = Violations()
    if TEXT not in model.output_modalities:
        outputs = ", ".join(sorted(model.output_modalities))
        v.add("model", f"model {model.name!r} does not generate text (it generates: {outputs})")
    check_contents(request, model, v)
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        v.add("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}")
    kwargs = sampling_params(request.sampling, model, v)
    kwargs.update(check_stopping(request, model, v))
    v.raise_if_any()
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    try:
        params.validate(model.vocab_size)
    except InvalidRequest as err:  # anything the engine checks that we did not
        raise from_invalid_request(err) from err
    return ValidatedGenerate(params=params)


def check_prompt_fits(num_prompt_tokens: int, params: SamplingParams, model: ServedModel) -> None:
    """The prompt must leave room for at least one output token, and for max_output_tokens when set."""
    context = model.context_length
    if num_prompt_tokens == 0:
        raise errors.invalid_argument([FieldViolation("contents", "the prompt is empty")])
    if num_prompt_tokens >= context:
        raise errors.invalid_argument(
            [
                FieldViolation(
                    "contents",
                    f"the prompt is {num_prompt_tokens} tokens; the context length of {model.name!r} is {context}",
                )
            ]
        )
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > context:
        raise errors.invalid_argument(
            [
                FieldViolation(
                    "max_output_tokens",
                    f"prompt ({num_prompt_tokens} tokens) + max_output_tokens ({params.max_tokens}) is above the "
                    f"context length of {model.name!r} ({context})",
                )
            ]
        )
