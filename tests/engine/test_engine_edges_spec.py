"""Speculative decoding together with the other features: greedy output (tokens and logprobs) with drafts equals the
output without, for penalties, logit bias, min_tokens, stop strings and max_tokens met inside a draft run, a
grammar behind a reasoning gate, a constraint's adjust_logits hook, logprobs of accepted drafts, preemption, a
sliding-window model whose blocks are released behind the window while drafts are rolled back, and over gRPC; and
sampled output keeps its distribution with penalties, bias and top-k; Whisper's transcripts are unchanged."""

from __future__ import annotations

import itertools

import llguidance
import numpy as np
import pytest
import torch
from support.audio_checkpoints import chirp, noise, tone
from support.checkpoints import load_reference
from support.drafts import GeneralDraft
from support.engines import tiny_checkpoint, tiny_engine
from support.sampling_checks import PROMPT, chi_square_ok, expected_probs
from support.sampling_checks import spread as spread  # noqa: F401  (fixture)
from support.service_harness import ServerThread, user_request
from support.tiny_chat_server import run as generate
from support.whisper_checkpoints import make_whisper

from omnivox.engine import SamplingParams
from omnivox.engine.draft import DraftModelProposer
from omnivox.engine.speculative import NgramProposer
from omnivox.engine.structured import compile_grammar, grammar_tokenizer
from omnivox.services.calls.whisper import transcribe
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing.reasoning import Start, ThinkTags, gate
from omnivox.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], list(range(30, 50)) * 2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("spec-edges"), "llama")


@pytest.fixture(scope="module")
def engines(ckpt):
    return {
        "plain": tiny_engine(ckpt),
        "ngram": tiny_engine(ckpt, proposer=NgramProposer(k=3, min_n=1, max_n=3)),
        "draft": tiny_engine(
            ckpt, proposer=DraftModelProposer.from_pretrained(ckpt, device="cpu", k=3, kv_cache_gib=0.01)
        ),
    }


def run(engine, params: list[SamplingParams], prompts=PROMPTS) -> tuple[list, int]:
    """(final outputs in order, draft tokens verified); checks the pool after every step. `engine.most_skipped`:
    the most blocks a request had released behind a sliding window."""
    ids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts)]
    out, drafted = {}, 0
    engine.most_skipped = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
        drafted += engine.last_step.stats.num_drafted
        for req in engine.scheduler.running:  # blocks held = what committed tokens plus drafts need
            engine.most_skipped = max(engine.most_skipped, req.num_skipped_blocks)
            assert len(req.block_table) <= -(-(req.num_tokens + len(req.draft_token_ids)) // engine.block_size)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.usage().total_blocks
    return [out[i] for i in ids], drafted


def same_with_speculation(engines, params: list[SamplingParams], prompts=PROMPTS) -> list:
    expected, _ = run(engines["plain"], params, prompts)
    for name in ("ngram", "draft"):
        got, drafted = run(engines[name], params, prompts)
        assert drafted > 0 or name == "ngram", name  # the draft model always proposes; n-grams need a match
        for g, e in zip(got, expected, strict=True):
            assert (g.token_ids, g.finish_reason, g.text) == (e.token_ids, e.finish_reason, e.text), name
            if e.logprobs is not None:
                for a, b in zip(g.logprobs, e.logprobs, strict=True):  # values: float32 sums in other batches
                    assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top]), name
                    assert [a.logprob, *(v for _, v in a.top)] == pytest.approx(
                        [b.logprob, *(v for _, v in b.top)], abs=1e-4
                    )
    return expected


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"repetition_penalty": 1.3, "ignore_eos": True},
        {"presence_penalty": 0.8, "frequency_penalty": 0.6, "ignore_eos": True},
        {"logit_bias": {7: 4.0, 8: float("-inf"), 40: 3.0}, "ignore_eos": True},
        {"min_tokens": 12, "logit_bias": {2: 6.0}},  # EOS made likely, banned until 12 tokens
        {"max_tokens": 5, "ignore_eos": True},  # ends inside a draft run
    ],
    ids=["repetition", "presence-frequency", "bias", "min-tokens", "max-tokens"],
)
def test_greedy_output_equals_plain_decoding(engines, kw):
    same_with_speculation(engines, [greedy(**kw), greedy(**kw)])


def test_stop_string_inside_accepted_drafts(engines):
    free, _ = run(engines["plain"], [greedy(ignore_eos=True)] * 2)
    stop = free[1].text[len(free[1].text) // 2 :][:3]  # a string the output reaches mid-way
    assert stop.strip()
    out = same_with_speculation(engines, [greedy(ignore_eos=True, stop=[stop])] * 2)
    assert out[1].finish_reason == "stop"


def test_logprobs_of_accepted_drafts_equal_plain_decodings(engines):
    """Requests asking for logprobs were never drafted; now each accepted draft carries its logprobs."""
    params = [greedy(ignore_eos=True, logprobs=0), greedy(ignore_eos=True, logprobs=3, repetition_penalty=1.2)]
    same_with_speculation(engines, params)  # drafted > 0: both rows ask for logprobs


def test_sampled_logprobs_of_accepted_drafts_are_the_models(ckpt, engines):
    """Sampled output differs from plain decoding's draw by draw; each token's logprobs (and top 3) are still
    log-softmax of the target's logits at its position, as transformers computes them."""
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True, logprobs=3)
    outs, drafted = run(engines["draft"], [params, params])
    assert drafted > 0
    reference = load_reference(ckpt)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            lps = reference(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        for row, tok, lp in zip(lps, out.token_ids, out.logprobs, strict=True):
            assert lp.token_id == tok and lp.logprob == pytest.approx(float(row[tok]), abs=1e-4)
            top = row.topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_grammar_behind_a_reasoning_gate(engines):
    """Thinking is free until the end tag (a token the model emits), then a regex holds; bias inside both."""
    engine = engines["plain"]
    cfg = engine.model_config
    extra = {"logit_bias": {9: 0.2}, "repetition_penalty": 1.5}  # varied thinking: the end tag comes once
    free, _ = run(engine, [greedy(max_tokens=30, **extra)] * 2)
    seen = free[0].token_ids
    at = next(i for i in range(4, len(seen)) if seen[i] not in seen[:i])  # thinking runs a few tokens first
    end_id = seen[at]
    think_id = next(t for t in range(3, 50) if t not in seen[: at + 1])
    tok = grammar_tokenizer(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    factory = compile_grammar(
        tok, llguidance.LLMatcher.grammar_from_regex("(ab|cd)+[0-9]"), cfg.vocab_size, cfg.eos_token_ids
    )
    gated = gate(factory, ThinkTags(think_id, end_id), Start.THINKING)
    params = [greedy(max_tokens=30, constraint_factory=gated, **extra)] * 2
    out = same_with_speculation(engines, params)
    answer = out[0].token_ids[out[0].token_ids.index(end_id) + 1 :]
    assert answer, out[0].token_ids


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("spec-swa"), "mistral", sliding_window=32)
    return {
        "plain": tiny_engine(path),
        "ngram": tiny_engine(path, proposer=NgramProposer(k=4, min_n=1, max_n=3)),
        "draft": tiny_engine(
            path, proposer=DraftModelProposer.from_pretrained(path, device="cpu", k=4, kv_cache_gib=0.01)
        ),
    }


def test_sliding_window_releases_blocks_and_rolls_drafts_back(windowed):
    assert windowed["ngram"].core.kv.sliding_window == 32
    same_with_speculation(windowed, [greedy(max_tokens=120, ignore_eos=True)] * 2)
    assert windowed["ngram"].most_skipped > 0 and windowed["draft"].most_skipped > 0


class NoRepeat:
    """A stateless constraint with an `adjust_logits` hook (the shape of Whisper's timestamp rules): the last output
    token may not come again. No mask; the hook reads the output so far."""

    def allowed(self, output_token_ids):
        return None

    def adjust_logits(self, logits, output_token_ids):
        if output_token_ids:
            logits[output_token_ids[-1]] = float("-inf")


def test_a_constraints_adjust_logits_hook_holds_on_verification_rows(engines):
    """Verification rows dropped the hook (only the mask was carried): speculation then repeated what plain
    decoding never does."""
    params = greedy(ignore_eos=True, constraint_factory=NoRepeat, logit_bias={9: 2.0})  # 9 9 9 ... without it
    out = same_with_speculation(engines, [params] * 2)
    assert out[0].token_ids.count(9) > 5
    assert all(a != b for o in out for a, b in itertools.pairwise(o.token_ids))


def test_over_grpc_speculation_keeps_tokens_logprobs_and_stop(ckpt):
    """A server with --speculative ngram answers a greedy request with logprobs, penalties, a -inf bias, a regex and
    a stop string as one without it does."""
    sampling = sampling_pb2.SamplingConfig(temperature=0, repetition_penalty=1.1, logit_bias={3: float("-inf")})
    request = user_request(
        "abab abab abab", sampling=sampling, max_output_tokens=40, logprobs=True, top_logprobs=2,
        response_format=generation_pb2.ResponseFormat(regex="(ab|ba| )+!"), stop_sequences=["babab"],
    )  # fmt: skip
    answers, drafted = [], []
    for speculative in (None, "ngram"):
        options = EngineOptions(kv_cache_gib=0.01, speculative=speculative, num_speculative_tokens=3)
        with ServerThread([ModelSpec(path=ckpt, name="tiny")], options) as server:
            server.engine("tiny").step_observers.append(lambda step: drafted.append(step.stats.num_drafted))
            text, deltas, summary = generate(generation_pb2_grpc.GenerationServiceStub(server.channel()), request)
            answers.append(
                (
                    text,
                    [(lp.token_id, round(lp.logprob, 4)) for d in deltas for lp in d.logprobs],
                    summary.finish_reason,
                )
            )
            assert server.wait_kv_free()[0] == server.wait_kv_free()[1]
    assert sum(drafted) > 0
    assert answers[0] == answers[1]
    text, logprobs, finish = answers[0]
    assert finish == generation_pb2.FINISH_REASON_STOP and len(logprobs) > 5, answers


def test_preemption_under_speculation(ckpt):
    """A 7-block pool: requests are preempted (drafts dropped, recomputed later) and the output is plain decoding's."""
    small = {"kv_cache_gib": 0.00006}
    tight = {
        "plain": tiny_engine(ckpt, **small),
        "ngram": tiny_engine(ckpt, proposer=NgramProposer(k=3, min_n=1, max_n=3), **small),
        "draft": tiny_engine(
            ckpt, proposer=DraftModelProposer.from_pretrained(ckpt, device="cpu", k=3, kv_cache_gib=0.01), **small
        ),
    }
    prompts = [*PROMPTS, [9, 10, 11] * 5, [40, 41] * 9]
    params = [greedy(max_tokens=70, ignore_eos=True, logprobs=1, repetition_penalty=1.05)] * 4
    preempted = []
    tight["draft"].step_observers.append(lambda step: preempted.append(step.stats.num_preempted))
    same_with_speculation(tight, params, prompts)
    assert sum(preempted) > 0


def test_sampled_first_two_tokens_keep_their_distribution_with_penalties_and_bias(spread):  # noqa: F811
    """The drafted (second) token is verified against p processed as plain sampling processes it: bias, a -inf
    ban, repetition / presence / frequency penalties counting the first token, temperature and top-k."""
    path, first_logits = spread
    bias = {3: 1.5, 17: 2.0, 40: float("-inf")}
    kw = {"repetition_penalty": 1.3, "presence_penalty": 1.0, "frequency_penalty": 0.5}
    temperature, top_k = 0.9, 40

    def processed(logits: np.ndarray, output: list[int]) -> np.ndarray:  # the sampler's order, in numpy
        z = logits.copy()
        for t, b in bias.items():
            z[t] += b
        for t in set(PROMPT) | set(output):
            z[t] = z[t] / kw["repetition_penalty"] if z[t] > 0 else z[t] * kw["repetition_penalty"]
        for t in set(output):
            z[t] -= kw["presence_penalty"] + kw["frequency_penalty"] * output.count(t)
        return z

    model = load_reference(path)
    with torch.no_grad():  # logits after PROMPT + t1 for every t1
        second = model(torch.tensor([PROMPT + [t] for t in range(384)])).logits[:, -1].double().numpy()
    p1 = expected_probs(processed(np.asarray(first_logits), []), temperature, top_k)
    joint = np.zeros((384, 384))
    for t1 in np.flatnonzero(p1):
        joint[t1] = p1[t1] * expected_probs(processed(second[t1], [int(t1)]), temperature, top_k)
    draft = GeneralDraft(384)
    engine = tiny_engine(path, proposer=draft, max_num_batched_tokens=512)
    engine.core.gate.max_batch = 10**6  # verify in every step, however large the batch
    engine.core.gate.min_acceptance = 0.0
    n = 3000
    params = [
        SamplingParams(
            max_tokens=3, ignore_eos=True, seed=i, temperature=temperature, top_k=top_k, logit_bias=bias, **kw
        )
        for i in range(n)
    ]
    outs = engine.generate([PROMPT] * n, params)
    assert draft.proposed >= n
    counts = np.zeros(384 * 384)
    for o in outs:
        counts[o.token_ids[0] * 384 + o.token_ids[1]] += 1
    ok, stat, limit = chi_square_ok(counts, joint.ravel())
    assert ok, (stat, limit)
    engine.check_integrity()


def test_whisper_transcripts_equal_with_speculation(tmp_path_factory):
    """A Whisper model served with --speculative ngram (its rules: suppression bias, first-step ban, timestamp
    masks and hook) transcribes token for token as without it."""
    path = make_whisper(tmp_path_factory.mktemp("spec-whisper") / "tiny-whisper")
    clip = np.concatenate([tone(1.5), noise(1.0, amp=0.05), chirp(1.5)])
    tokens, drafted = [], []
    for speculative in (None, "ngram"):
        options = EngineOptions(kv_cache_gib=0.02, speculative=speculative, num_speculative_tokens=3)
        with ServerThread([ModelSpec(path=path, name="w")], options) as server:
            part = server.registry.lookup("w").bundle.whisper
            part.engine.step_observers.append(lambda step: drafted.append(step.stats.num_drafted))
            tokens.append([
                server.run(transcribe(part, clip, language="en", timestamps=ts, max_tokens=60)).token_ids
                for ts in (True, False)
            ])  # fmt: skip
    assert sum(drafted) > 0
    assert tokens[0] == tokens[1]
