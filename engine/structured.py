"""Grammar-constrained decoding (JSON schema, regex, Lark, choices) on llguidance, as per-request token constraints.

`GrammarConstraintFactory` holds what is shared by every request of one grammar: the compiled matcher (a prototype
that each request deep-copies, microseconds instead of a recompile) and the model's eos ids. Each request gets its own
`GrammarConstraint` (matcher state: `advance` consumes tokens, `rollback` takes them back).

Masks for the whole batch are filled in one `fill_next_token_bitmask_par` call per step by `GrammarMasks.overlap`,
which runs it on a worker thread while the model's forward pass runs (llguidance and torch both release the GIL), and
joins it before sampling. The sampler then reads each row's mask through the ordinary `allowed()` hook, so grammar
rows go through the one mask path with TTS rows and logit bias. A constraint asked for a mask that the batch did not
fill (a state the batch never saw: speculative rows, a request that joined mid-step) computes its own, one row.

A finished grammar admits only the end-of-sequence tokens (`must_end`), which the sampler lets win over
min_tokens: the grammar is the stronger promise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy as llg_np  # not .torch: its import torch.compiles a kernel we never use (+1.5-4.5 s)
import numpy as np
import torch

log = logging.getLogger(__name__)

assert sys.byteorder == "little"  # byte k of an int32 word holds its bits 8k..8k+7


def unpack_bitmask(bitmask: np.ndarray | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [B, ceil(V/32)] on the CPU (bit j of word w = token 32w+j) -> bool [B, V].

    numpy's unpackbits: 0.2 ms for 64 rows of SmolLM2's 49 152 tokens, against 3-6 ms for torch uint8 and-masks over
    [B, 4W, 8] and 8-13 ms for int32 shifts over [B, W, 32] (one busy core)."""
    octets = np.ascontiguousarray(bitmask).view(np.uint8)  # [B, 4W]
    bits = np.unpackbits(octets, axis=1, bitorder="little")  # [B, 32W] uint8 0/1
    return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]


class GrammarConstraint:
    """One request's grammar state. Not thread-safe: the engine thread and the step's mask worker take turns."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = np.array(sorted(set(eos_ids)), dtype=np.int64)
        self.num_consumed = 0  # tokens consumed by the matcher (advance - rollback)
        self._mask: torch.Tensor | None = None  # bool [V] for the matcher state numbered _mask_at
        self._mask_at = -1
        # Numbers every matcher state: advance and rollback each make a new one. Not num_consumed, which comes back
        # to the same value along another path (drafts advanced, rolled back, then a different token advanced).
        self._state = 0
        self._skipped = 0  # tokens advanced past a stopped matcher (it never saw them)
        self._only_eos = False

    @property
    def needs_mask(self) -> bool:
        return self._mask_at != self._state

    def set_mask(self, mask: torch.Tensor) -> None:  # bool [V], filled by the batch
        if len(self.eos_ids):
            # llguidance admits its own eos when the grammar may end; every eos id of the model ends the request.
            m = mask.numpy()  # a view: numpy's per-row calls cost microseconds where torch's cost tens of them
            if m[self.eos_ids].any():
                m[self.eos_ids] = True
            self._only_eos = np.count_nonzero(m) == np.count_nonzero(m[self.eos_ids])
        self._mask, self._mask_at = mask, self._state

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar matcher failed: {self.matcher.get_error()}")

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor:
        if self.needs_mask:
            self._check()
            bitmask = llg_np.allocate_token_bitmask(1, self.vocab_size)
            llg_np.fill_next_token_bitmask(self.matcher, bitmask, 0)
            self._check()
            self.set_mask(unpack_bitmask(bitmask, self.vocab_size)[0])
        assert self._mask is not None
        return self._mask

    @property
    def must_end(self) -> bool:
        """True when the grammar is complete and admits nothing but end-of-sequence."""
        self.allowed([])
        return self._only_eos

    def advance(self, token_ids: list[int]) -> None:
        self._state += 1
        for t in token_ids:
            if self.matcher.is_stopped():  # the eos that ended the grammar, or tokens after it: nothing to match
                self.num_consumed += 1
                self._skipped += 1
                continue
            if not self.matcher.consume_token(t):
                raise ValueError(f"token {t} rejected by the grammar: {self.matcher.get_error()}")
            self.num_consumed += 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            skipped = min(num_tokens, self._skipped)  # the skipped tokens are the last ones
            self._skipped -= skipped
            if num_tokens > skipped:
                self.matcher.rollback(num_tokens - skipped)
            self.num_consumed -= num_tokens
            self._state += 1


def grammar_row(constraint: Any) -> GrammarConstraint | None:
    """The grammar whose mask a row needs this step: the constraint itself, or the one a wrapper names as its
    `active_grammar` (services/processing/reasoning.py's gate, once the model's thinking is over), so that it is filled with
    the batch too."""
    if isinstance(constraint, GrammarConstraint):
        return constraint
    inner = getattr(constraint, "active_grammar", None)
    return inner if isinstance(inner, GrammarConstraint) else None


class GrammarConstraintFactory:
    """A compiled grammar shared by its requests; calling it makes one request's constraint."""

    def __init__(self, prototype: llguidance.LLMatcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.prototype = prototype
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self.prototype.deep_copy(), self.vocab_size, self.eos_ids)


class GrammarMasks:
    """Fills every grammar row's next-token mask for one step in one parallel llguidance call, off the engine thread."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._executor: Any = None
        self._num_threads = num_threads
        self._worker: ThreadPoolExecutor | None = None

    def _fill(self, constraints: list[GrammarConstraint]) -> None:
        if self._executor is None:  # made on first use: engines that never see a grammar start no threads
            self._executor = llguidance.LLExecutor(self._num_threads)
        bitmask = llg_np.allocate_token_bitmask(len(constraints), self.vocab_size)  # int32 [B, ceil(V/32)]
        llg_np.fill_next_token_bitmask_par(self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)
        masks = unpack_bitmask(bitmask, self.vocab_size)  # bool [B, V], a fresh tensor every step
        for c, mask in zip(constraints, masks, strict=True):
            if not c.matcher.is_error():  # an errored row computes again in allowed() and raises there
                c.set_mask(mask)

    def start(self, requests: Iterable[Any]) -> Future | None:
        """Begin filling the masks of these requests' grammar constraints that are not up to date."""
        rows = [g for r in requests if (g := grammar_row(r.constraint)) is not None and g.needs_mask]
        if not rows:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._worker.submit(self._fill, rows)

    @contextlib.contextmanager
    def overlap(self, requests: Iterable[Any]) -> Iterator[None]:
        """`with masks.overlap(reqs): forward pass` — the masks are filled while the body runs, ready after it."""
        pending = self.start(requests)
        try:
            yield
        finally:
            if pending is not None:
                try:
                    pending.result()
                except Exception:  # each row then computes its own mask and fails alone if it must
                    log.exception("batch grammar mask fill failed")


class GrammarError(ValueError):
    """The grammar does not compile; the message is the compiler's."""


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast HF tokenizer, or of a Tekken one (Voxtral's, read through mistral_common), over
    the model's vocabulary (~1 s for 50k tokens: build it once)."""
    import llguidance.hf

    tekken = tekkenizer(hf_tokenizer)
    if tekken is not None:
        wrapper = llguidance.TokenizerWrapper(_TekkenTokens(tekken))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_ids))
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


def tekkenizer(hf_tokenizer: Any) -> Any:
    """The mistral_common Tekkenizer inside transformers' MistralCommonBackend, else None (not a fast tokenizer:
    llguidance.hf refuses it)."""
    inner = getattr(getattr(getattr(hf_tokenizer, "tokenizer", None), "instruct_tokenizer", None), "tokenizer", None)
    return inner if type(inner).__name__ == "Tekkenizer" else None


class _TekkenTokens:
    """What llguidance's TokenizerWrapper reads: every id's bytes (special tokens as their text, marked special),
    and the tokenizer itself for the text a grammar forces."""

    def __init__(self, tekken: Any) -> None:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        self._tekken = tekken
        self.eos_token_id = tekken.eos_id
        self.bos_token_id = tekken.bos_id
        self.tokens = [tekken.id_to_byte_piece(i, SpecialTokenPolicy.KEEP) for i in range(tekken.n_words)]
        self.special_token_ids = sorted(tekken.special_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tekken.encode(text, bos=False, eos=False)


def compile_grammar(
    tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int, eos_ids: Sequence[int]
) -> GrammarConstraintFactory:
    """Compile an llguidance grammar (from `LLMatcher.grammar_from_*`) into a factory; GrammarError when it is bad."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    # A grammar whose language is empty (a regex like [^\s\S]) compiles, and failed only at its first mask, in the
    # engine: INTERNAL. Its first mask, on a copy (a few ms, once per compile, in the compile worker), tells.
    first = matcher.deep_copy()
    bitmask = llg_np.allocate_token_bitmask(1, vocab_size)
    llg_np.fill_next_token_bitmask(first, bitmask, 0)
    if first.is_error() or not bitmask.any():
        raise GrammarError("the grammar admits no output at all")
    return GrammarConstraintFactory(matcher, vocab_size, eos_ids)
