"""Structured output for Generate: a request's response_format (or tool grammar) compiled off the event loop.

Grammar compilation (llguidance) runs in a small worker pool, never on the event loop or the engine loop: a request
awaits its own grammar while every other stream keeps going. Each model bundle owns one GrammarCompiler (one
llguidance tokenizer per model). Results are cached by the request's cache salt (services/processing/cache_salt.py: its caller
and `cache_salt`) and the grammar text, failures included, so that a client retrying a bad schema costs nothing while
another tenant cannot learn from a fast answer that a schema was used before. A compile that runs longer than
`COMPILE_TIMEOUT_S` is INVALID_ARGUMENT (its thread finishes in the background and fills the cache); time spent
queued behind other compiles does not count (a burst of distinct schemas is not the schema's fault), so the queue is
bounded only by the model's admission bound (one grammar per admitted request) and each request's own deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance

from omnivox.engine.structured import GrammarConstraintFactory, GrammarError, compile_grammar, grammar_tokenizer
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.v1 import generation_pb2

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 128
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024

# Compact JSON: no whitespace between tokens, so a model cannot loop on spaces or newlines inside a structure (a
# +100 bias on the space token still ends; spaces only fit inside strings).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


# The keys of OpenAI's response_format.json_schema object, which wraps the schema itself in "schema".
_OPENAI_WRAPPER = frozenset({"name", "description", "schema", "strict"})


@dataclass(frozen=True)
class GrammarSpec:
    field: str  # the request path a compile error names, e.g. "response_format.json_schema"
    grammar: str  # llguidance grammar text (LLMatcher.grammar_from_*)


def _bad(field: str, message: str) -> errors.ServiceError:
    return errors.invalid_argument([FieldViolation(field, message)])


def load_json(text: str) -> Any:
    """`json.loads`, failing only with ValueError (its message says why) for text a client sent: json.loads raises
    RecursionError past ~1,000 nested levels, and "[" * 100000 as a schema or tool arguments was an INTERNAL error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValueError("nested too deeply to parse as JSON") from exc


def json_schema_grammar(schema_text: str, field: str) -> str:
    """The grammar of one JSON value valid under the schema (JSON text); INVALID_ARGUMENT if it is not JSON."""
    try:
        schema = load_json(schema_text)
    except ValueError as exc:
        raise _bad(field, str(exc)) from exc
    if not isinstance(schema, dict | bool):
        raise _bad(field, f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    if schema is False:
        raise _bad(field, "the schema false admits no value")
    if schema is True:  # any JSON value (llguidance takes only an object: "Expecting object schema to apply options")
        schema = {}
    if isinstance(schema.get("schema"), dict) and schema.keys() <= _OPENAI_WRAPPER:
        # A valid schema (unknown keywords are ignored) that admits any JSON value: the caller's schema went unused.
        raise _bad(field, 'is OpenAI\'s json_schema wrapper ({"name", "schema", "strict"}): send its "schema" member')
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise _bad(field, str(exc)) from exc


def choices_grammar(values: list[str], field: str) -> str:
    if not values:
        raise _bad(field, "must hold at least one choice")
    if len(values) > MAX_CHOICES:
        raise _bad(field, f"at most {MAX_CHOICES} choices, got {len(values)}")
    for i, v in enumerate(values):
        if not v:
            raise _bad(f"{field}[{i}]", "must not be empty")
    # Lark string literals take JSON escapes: any text becomes a literal as json.dumps writes it.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in values))


def response_format_spec(request: generation_pb2.GenerateRequest) -> GrammarSpec | None:
    """The grammar a request's response_format asks for (None: unconstrained). Raises INVALID_ARGUMENT for what can
    be seen without compiling (not JSON, no choices, too long)."""
    if not request.HasField("response_format"):
        return None
    rf = request.response_format
    kind = rf.WhichOneof("format")
    if kind is None:
        return None
    field = f"response_format.{kind}"
    if request.ignore_eos:  # a finished grammar admits only end-of-sequence: there is nothing to generate past it
        raise _bad("ignore_eos", "cannot be combined with response_format")
    text = rf.json_schema if kind == "json_schema" else rf.regex if kind == "regex" else rf.lark_grammar
    if kind == "choices":
        values = list(rf.choices.values)
        if sum(len(v) for v in values) > MAX_GRAMMAR_CHARS:
            raise _bad(field, f"the choices are longer than {MAX_GRAMMAR_CHARS} characters in all")
        return GrammarSpec(f"{field}.values", choices_grammar(values, f"{field}.values"))
    if not text:
        raise _bad(field, "must not be empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _bad(field, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
    if kind == "json_schema":
        return GrammarSpec(field, json_schema_grammar(text, field))
    if kind == "regex":
        return GrammarSpec(field, llguidance.LLMatcher.grammar_from_regex(text))
    return GrammarSpec(field, llguidance.LLMatcher.grammar_from_lark(text))


@dataclass(frozen=True)
class _Compile:
    """One grammar's compile in the pool: `started` holds the monotonic time a worker took it up, `done` the result."""

    started: Future  # float: time.monotonic() when the compile began (never set if the pool shut down first)
    done: Future  # GrammarConstraintFactory, or GrammarError


class GrammarCompiler:
    """One model's grammar compiler: llguidance tokenizer (built once, in the worker), pool, salted cache, timeout."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: list[int], workers: int = 2) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.timeout_s = COMPILE_TIMEOUT_S
        self.compiles = 0  # compiles started (cache misses), read by tests and operators
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()  # (salt, grammar), most recent last

    @classmethod
    def for_engine(cls, engine: Any) -> GrammarCompiler:
        """The compiler of a loaded engine's tokenizer and vocabulary (its threads start on the first compile)."""
        return cls(engine.tokenizer, engine.model_config.vocab_size, list(engine.model_config.eos_token_ids))

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_ids)
            return self._tokenizer

    def _compile(self, grammar: str) -> GrammarConstraintFactory:
        return compile_grammar(self._llg_tokenizer(), grammar, self.vocab_size, self.eos_ids)

    def _run(self, grammar: str, started: Future) -> GrammarConstraintFactory:
        started.set_result(time.monotonic())  # the timeout counts from here, not from the submit
        return self._compile(grammar)

    def submit(self, grammar: str, salt: str = "") -> _Compile:
        """The (cached) compile of `grammar` for requests of this cache salt; failures stay cached like successes."""
        key = (salt, grammar)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                started: Future = Future()
                entry = _Compile(started, self._pool.submit(self._run, grammar, started))
                self.compiles += 1
                self._cache[key] = entry
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return entry

    async def factory(self, spec: GrammarSpec, salt: str = "") -> GrammarConstraintFactory:
        """Wait (without blocking the event loop) for the compiled grammar; INVALID_ARGUMENT naming spec.field when
        it does not compile or its compile runs longer than the timeout (time queued behind others not counted)."""
        if not self.eos_ids:  # llguidance's "eos_token list must not be empty", an INTERNAL at every compile
            why = "this model names no end-of-sequence token (eos_token_id in config.json or generation_config.json)"
            raise _bad(spec.field, f"{why}, so constrained output could never end")
        entry = self.submit(spec.grammar, salt)
        done = asyncio.wrap_future(entry.done)
        try:
            if not done.done():
                # Queued: wait for a worker to take it up (or for the result), uncounted. asyncio.wait cancels
                # neither future when this request is cancelled: the compile goes on and fills the cache.
                await asyncio.wait({asyncio.wrap_future(entry.started), done}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                left = entry.started.result() + self.timeout_s - time.monotonic()
                await asyncio.wait_for(asyncio.shield(done), max(left, 0.0))
            return done.result()
        except TimeoutError as exc:
            raise _bad(spec.field, f"the grammar did not compile within {self.timeout_s:g} s") from exc
        except GrammarError as exc:
            raise _bad(spec.field, f"does not compile: {exc}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def constrain(request: generation_pb2.GenerateRequest, params: Any, compiler: GrammarCompiler, salt: str) -> None:
    """Set `params.constraint_factory` from the request's response_format (compiled off the loop; cached per salt)."""
    spec = response_format_spec(request)
    if spec is not None:
        params.constraint_factory = await compiler.factory(spec, salt)
