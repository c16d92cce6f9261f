"""Engine edges: a request whose own -inf biases leave nothing to sample (INVALID_ARGUMENT naming
`sampling.logit_bias`, not INTERNAL), speculative decoding combined with the other sampling features (output equal
to plain decoding), seeds (distinct seeds, distinct streams), what min_tokens bans (EOS only where it would stop), and a
preempted request's cache-hit count (its first admission's)."""

from __future__ import annotations

import math

import llguidance
import pytest
from support.engines import tiny_checkpoint, tiny_engine
from support.service_harness import ServerThread, user_request
from support.tiny_chat_server import invalid_argument, run

from omnivox.engine import InvalidRequest, SamplingParams, shared
from omnivox.engine.speculative import NgramProposer
from omnivox.engine.structured import compile_grammar, grammar_tokenizer
from omnivox.models.orpheus import SpeechLayout, SpeechTokenConstraint
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # repeats: the n-gram proposer drafts from it


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("edges"), "llama")


@pytest.fixture(scope="module")
def engines(ckpt):
    return {"plain": tiny_engine(ckpt), "ngram": tiny_engine(ckpt, proposer=NgramProposer(k=3, min_n=1, max_n=3))}


def regex_factory(engine, regex: str):
    cfg = engine.model_config
    tok = grammar_tokenizer(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    return compile_grammar(tok, llguidance.LLMatcher.grammar_from_regex(regex), cfg.vocab_size, cfg.eos_token_ids)


def allowed_after(factory, tokens: list[int]) -> list[int]:
    c = factory()
    c.advance(tokens)
    return c.allowed([]).nonzero().flatten().tolist()


def finals(engine, prompts, params, drafted: list[int] | None = None) -> list:
    """Final outputs in order; `drafted` gets the number of draft tokens verified."""
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
        if drafted is not None:
            drafted.append(engine.last_step.stats.num_drafted)
    return [out[i] for i in ids]


@pytest.mark.parametrize("kind", ["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bans_on_every_allowed_token_fail_the_request_naming_logit_bias(engines, kind, temperature):
    engine = engines[kind]
    factory = regex_factory(engine, "xy|xz")
    first = allowed_after(factory, [])
    x = engine.tokenizer("x", add_special_tokens=False).input_ids
    assert len(x) == 1 and x[0] in first
    second = allowed_after(factory, x)
    # Position 0: everything but "x" banned, so "x" is taken; position 1: all that may follow "x" banned.
    bias = {t: float("-inf") for t in first + second if t != x[0]}
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, constraint_factory=factory, logit_bias=bias)
    ok = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    drafted: list[int] = []
    prompt = [5, 6, *x, 7, 8, 9]  # after "x" the n-gram proposer drafts 7 8 9: verified at the dead row
    bad, good = finals(engine, [prompt, PROMPT], [params, ok], drafted)
    assert (sum(drafted) > 0) == (kind == "ngram")
    assert bad.finish_reason == "error"
    assert bad.error is not None and bad.error.field == "logit_bias", bad.error
    assert "output position 1" in bad.error.description, bad.error.description
    assert bad.token_ids == [] or bad.token_ids == x
    assert good.finish_reason == "length" and len(good.token_ids) == 6
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.usage().total_blocks


@pytest.fixture(scope="module")
def server(ckpt):
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.01)) as srv:
        yield srv


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_over_grpc_it_is_invalid_argument_and_the_server_keeps_serving(server, temperature):
    """It was INTERNAL "the engine failed": argmax over a row of -inf took token 0, which the grammar rejected."""
    engine = server.engine("tiny")
    factory = regex_factory(engine, "xy|xz")
    x = engine.tokenizer("x", add_special_tokens=False).input_ids
    banned = [t for t in allowed_after(factory, []) + allowed_after(factory, x) if t != x[0]]
    sampling = sampling_pb2.SamplingConfig(temperature=temperature, seed=1, logit_bias=dict.fromkeys(banned, -math.inf))
    request = user_request(
        "x", response_format=generation_pb2.ResponseFormat(regex="xy|xz"), sampling=sampling, max_output_tokens=8
    )
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    found = invalid_argument(stub, request)
    assert "output position 1" in found["sampling.logit_bias"], found
    assert server.wait_kv_free()[0] == server.wait_kv_free()[1]
    _, _, summary = run(stub, user_request("x", max_output_tokens=3))
    assert summary.usage.output_tokens >= 1


@pytest.mark.parametrize("seed", [-1, 2**32, 2**63 - 1])
def test_a_seed_past_32_bits_is_refused_naming_it(server, engines, seed):
    """-1, 2**32 - 1 and 2**63 - 1 drew the same stream (the CPU generator keeps a seed's low 32 bits)."""
    with pytest.raises(InvalidRequest) as info:
        engines["plain"].add_request(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=2))
    assert info.value.field == "seed"
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    sampling = sampling_pb2.SamplingConfig(temperature=1.0, seed=seed)
    found = invalid_argument(stub, user_request("x", sampling=sampling, max_output_tokens=2))
    assert "[0, 4294967295]" in found["sampling.seed"], found


def test_distinct_seeds_at_the_ends_of_the_range_are_distinct_streams(engines):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (0, 2**32 - 1, 0)]
    a, b, again = (o.token_ids for o in finals(engines["plain"], [PROMPT] * 3, params))
    assert a == again and a != b


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_bans_on_every_code_of_a_speech_frame_position(engines, kind):
    """Speech rows sample among their frame position's codes only (allowed_ids): with all of them banned the row
    took the first code anyway, a banned token, and went on."""
    layout = SpeechLayout(
        name="tiny", prompt_prefix=(7,), prompt_suffix=(8, 9), start_of_speech=9, end_of_speech=10,
        audio_token_base=100, codebook_size=30, voices=("ann",), default_voice="ann",
    )  # fmt: skip
    engine = engines[kind]
    constraint = SpeechTokenConstraint(layout, engine.model_config.vocab_size)
    third = range(100 + 2 * 30, 100 + 3 * 30)  # frame position 2's codes
    params = SamplingParams(
        temperature=1.0, seed=2, max_tokens=14, constraint_factory=shared(constraint),
        logit_bias=dict.fromkeys(third, float("-inf")),
    )  # fmt: skip
    (out,) = finals(engine, [PROMPT + [9]], [params])
    assert out.finish_reason == "error" and out.error.field == "logit_bias", out
    assert "output position 2" in out.error.description
    assert not set(out.token_ids) & set(third)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.usage().total_blocks


def test_a_bias_near_float32s_max_at_a_low_temperature_is_followed(engines, server):
    """logits / 0.5 overflowed to inf, the softmax was NaN and every draw took id 0: a token nobody favoured, and
    under a response format INTERNAL (the grammar rejected it)."""
    engine = engines["plain"]
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=4, ignore_eos=True, logit_bias={50: 3e38})
    (out,) = finals(engine, [PROMPT], [params])
    assert out.token_ids == [50] * 4
    x = engine.tokenizer("x", add_special_tokens=False).input_ids[0]
    sampling = sampling_pb2.SamplingConfig(temperature=0.5, seed=1, logit_bias={x: 3e38})
    request = user_request(
        "x", response_format=generation_pb2.ResponseFormat(regex="xy|xz"), sampling=sampling, max_output_tokens=8
    )
    text, _, _ = run(generation_pb2_grpc.GenerationServiceStub(server.channel()), request)
    assert text in ("xy", "xz")


def test_min_tokens_bans_eos_only_when_eos_would_stop(engines):
    """Under min_tokens the sampler bans what would end the request: EOS (unless ignore_eos, where EOS ends nothing
    and stays a token like any other) and the stop ids (always)."""
    engine = engines["plain"]
    [eos] = engine.model_config.eos_token_ids[:1]
    likely = {eos: 100.0}  # EOS the greedy choice wherever it is allowed
    kept = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True,
                                                    logit_bias=likely))[0]  # fmt: skip
    assert kept.token_ids == [eos] * 6
    stopped = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                                                       logit_bias=likely))[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 5 and eos not in stopped.token_ids[:4]
    stop_id = 200
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=3, ignore_eos=True, stop_token_ids=[stop_id],
                            logit_bias={stop_id: 100.0})  # fmt: skip
    by_id = engine.generate([PROMPT], params)[0]
    assert by_id.finish_reason == "stop" and len(by_id.token_ids) == 4 and stop_id not in by_id.token_ids[:3]


def test_preempted_request_reports_the_cache_hits_of_its_first_admission(ckpt):
    """A preempted request is readmitted over its own prompt blocks, still in the prefix cache: that is recompute,
    not a cache hit the caller earned, so its num_cached_tokens stays what its first admission found (0 here: every
    prompt starts with its own token)."""
    probe = tiny_engine(ckpt)
    block_bytes = probe.model_config.kv_bytes_per_token(4) * 16
    # 8 blocks of 16 tokens for two requests of 32 + 40 tokens (5 blocks each): the newer one is preempted once the
    # older grows, and its two prompt blocks are still cached when it comes back.
    small = tiny_engine(ckpt, kv_cache_gib=8 * block_bytes / 2**30)
    prompts = [list(range(10, 42)), list(range(100, 132))]
    kv, readmitted_hits = small.scheduler.kv, []
    match_prefix = kv.match_prefix

    def watched(req):  # what the cache offers a request coming back after a preemption
        cached = match_prefix(req)
        if req.num_preemptions:
            readmitted_hits.append(cached)
        return cached

    kv.match_prefix = watched
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert small.scheduler.num_preemptions > 0 and max(readmitted_hits, default=0) > 0, readmitted_hits
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    small.check_integrity()
