"""The benchmark workload: N requests whose prompt and output lengths come from a fixed seed.

Every system sees exactly the same requests: the same prompt token ids (or, for text-only front ends, the text those
ids were made from) and the same number of output tokens (`ignore_eos`, so a request always produces `max_tokens`).
Every prompt starts with one shared prefix (a "system prompt"), so a prefix cache has something to hit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

# Plain words to build prompts from: with a real tokenizer most are one or two tokens each.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they are this be it an which or had not one but "
    "have were their all there been can has would who will more when if no out so said what up its about into than "
    "them only other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right "
    "used take three house city river music garden window paper voice light water story table morning evening letter "
    "mountain question answer number sound picture country school family friend animal market winter summer train"
)
WORDS = tuple(_WORD_TEXT.split(" "))


class Tokenizer(Protocol):
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict], **kwargs) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    prompt_words: tuple[int, int] = (16, 96)  # inclusive range of words per prompt, after the shared prefix
    output_tokens: tuple[int, int] = (16, 64)  # inclusive range of max_tokens (= output tokens: ignore_eos)
    shared_prefix_words: int = 24  # words of the prefix every prompt starts with (0 = none)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        for name in ("prompt_words", "output_tokens"):
            lo, hi = getattr(self, name)
            if not (1 <= lo <= hi):
                raise ValueError(f"{name}: need 1 <= low <= high, got ({lo}, {hi})")
        if self.shared_prefix_words < 0:
            raise ValueError(f"shared_prefix_words: must be >= 0, got {self.shared_prefix_words}")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_text: str  # the user's message, as sent to chat front ends (omnivox's Generate)
    prompt_token_ids: list[int] = field(hash=False)  # what the model sees: the chat template applied to prompt_text
    max_tokens: int
    templated_text: str = ""  # the chat template applied, as text: for completion front ends that take only text


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_workload(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The requests of `spec`: identical for every call with the same spec and tokenizer."""
    rng = random.Random(spec.seed)
    prefix = _words(rng, spec.shared_prefix_words) + " " if spec.shared_prefix_words else ""
    requests = []
    for i in range(spec.num_requests):
        text = prefix + _words(rng, rng.randint(*spec.prompt_words))
        max_tokens = rng.randint(*spec.output_tokens)
        templated = chat_text(tokenizer, text)
        ids = [int(t) for t in tokenizer.encode(templated, add_special_tokens=False)]
        requests.append(
            BenchRequest(
                index=i, prompt_text=text, prompt_token_ids=ids, max_tokens=max_tokens, templated_text=templated
            )
        )
    return requests


def chat_text(tokenizer: Tokenizer, text: str) -> str:
    """What a chat server feeds its model for a one-turn user message (as omnivox's Generate does), as text; its
    tokens are `tokenizer.encode(chat_text, add_special_tokens=False)`, as apply_chat_template(tokenize=True) does."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return text


def describe(requests: list[BenchRequest]) -> dict:
    """Sizes of a workload, for the report."""
    p = [len(r.prompt_token_ids) for r in requests]
    o = [r.max_tokens for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": {"min": min(p), "mean": sum(p) / len(p), "max": max(p)},
        "output_tokens": {"min": min(o), "mean": sum(o) / len(o), "max": max(o), "total": sum(o)},
    }
