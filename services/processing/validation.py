"""Request validation: every rejected value becomes a FieldViolation naming its field in the request message.

Checks are collected, not stopped at the first, so that a client learns of every bad value in one round trip.
Value ranges are not written here: they are the engine's one table (`SamplingParams.violations()`, engine/params.py),
whose field names `request_field` maps onto request paths; this module adds only what belongs to the wire format or
to the model (roles, parts, counts, sizes, the context length).
Field paths follow google.rpc.BadRequest conventions: `contents[0].parts[1].image`, `sampling.temperature`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnivox.engine.errors import InvalidRequest
from omnivox.engine.params import SamplingParams
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import AUDIO, IMAGE, TEXT, ServedModel
from omnivox.services.processing.wire_checks import request_id_violation
from omnivox.v1 import generation_pb2, sampling_pb2

ROLES = ("system", "user", "assistant", "tool")  # tool: a tool call's result (services/processing/tools.py)
MAX_STOP_SEQUENCES = 16

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
        if not content.parts and not content.tool_calls:  # an assistant turn may be tool calls alone
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


def sampling_kwargs(sampling: sampling_pb2.SamplingConfig, model: ServedModel) -> dict[str, object]:
    """The SamplingParams keyword arguments a SamplingConfig asks for: the model's defaults, then every field the
    request set. Values are not checked here: `sampling_violations` runs the engine's one table over them."""
    kwargs: dict[str, object] = dict(model.sampling_defaults)
    for name in SAMPLING_FIELDS:
        if sampling.HasField(name):
            kwargs[name] = getattr(sampling, name)
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    return kwargs


# SamplingConfig fields that map one to one onto SamplingParams fields of the same name (logit_bias is a map).
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def add_engine_violations(params: SamplingParams, model: ServedModel, v: Violations, field_of=None) -> None:
    """Every range problem of `params` (engine/params.py's table) as a FieldViolation on the request's path.

    `field_of` maps an engine field name to the request path (default: the GenerateRequest's, `request_field`).
    """
    for err in params.violations(model.vocab_size):
        v.add((field_of or request_field)(err.field), err.description)


def check_stopping(request: generation_pb2.GenerateRequest, model: ServedModel, v: Violations) -> dict[str, object]:
    """The stopping and output fields as SamplingParams keyword arguments, with the checks that are the wire
    format's or the model's own (counts, the context length, top_logprobs without logprobs); ranges are the engine's."""
    kwargs: dict[str, object] = {}
    context = model.context_length
    if request.HasField("max_output_tokens"):
        if request.max_output_tokens > context:
            v.add(
                "max_output_tokens",
                f"{request.max_output_tokens} is above the context length of {model.name!r} ({context})",
            )
        kwargs["max_tokens"] = request.max_output_tokens
    if request.HasField("min_output_tokens"):
        kwargs["min_tokens"] = request.min_output_tokens
    if request.stop_sequences:
        if len(request.stop_sequences) > MAX_STOP_SEQUENCES:
            v.add("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(request.stop_sequences)}")
        kwargs["stop"] = list(request.stop_sequences)
    if request.stop_token_ids:
        kwargs["stop_token_ids"] = list(request.stop_token_ids)
    kwargs["ignore_eos"] = request.ignore_eos
    kwargs["include_stop_str_in_output"] = request.include_stop_sequence
    if request.HasField("top_logprobs") and not request.logprobs:
        v.add("top_logprobs", "needs logprobs = true")
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
        if model.engine is None:  # a voice (services/parts/voice_part.py): no engine to check sampling against
            v.raise_if_any()
    check_contents(request, model, v)
    if (too_long := request_id_violation(request.request_id)) is not None:
        v.add(too_long.field, too_long.description)
    kwargs = sampling_kwargs(request.sampling, model)
    kwargs.update(check_stopping(request, model, v))
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    add_engine_violations(params, model, v)
    v.raise_if_any()
    params.validate(model.vocab_size)  # passes (no violations); normalises `stop`
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
