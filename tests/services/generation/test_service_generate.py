"""GenerationService over a real gRPC channel on localhost, served by the real engine on tiny random checkpoints."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.grpc_errors import field_violations
from support.service_harness import ServerThread, user_request

from omnivox.engine import SamplingParams
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

KV_GIB = 0.01  # 1310 blocks of 16 tokens for the tiny llama: plenty, and small
CONTEXT = 4096  # room for streams long enough to interrupt on any machine
GREEDY = sampling_pb2.SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-llama", family="llama", max_position_embeddings=CONTEXT
    )


@pytest.fixture(scope="module")
def server(checkpoint: Path):
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], EngineOptions(kv_cache_gib=KV_GIB)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def collect(responses) -> tuple[list[generation_pb2.GenerateDelta], generation_pb2.GenerateSummary]:
    """Deltas and the summary, asserting the stream's shape: deltas first, then exactly one summary, last."""
    deltas, summaries, kinds = [], [], []
    for response in responses:
        kind = response.WhichOneof("response")
        kinds.append(kind)
        (deltas if kind == "delta" else summaries).append(getattr(response, kind))
    assert summaries and kinds[-1] == "summary" and kinds.count("summary") == 1, kinds
    return deltas, summaries[0]


def prompt_ids(server: ServerThread, text: str) -> list[int]:
    """The prompt the service must build for one user turn, written out by hand from the tiny checkpoint's ChatML
    template (tests/support/checkpoints.py), not rendered by the same apply_chat_template call the service makes."""
    tok = server.engine().tokenizer
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(rendered, add_special_tokens=False)


def test_stream_matches_engine(server: ServerThread, stub) -> None:
    """Deltas stream before the summary; they add up to the engine's own output; usage counts are right."""
    request = user_request("Hello there! How are you today?", max_output_tokens=24, sampling=GREEDY, request_id="r-1")
    deltas, summary = collect(stub.Generate(request))
    assert len(deltas) >= 2
    text = "".join(d.text for d in deltas)
    tokens = [t for d in deltas for t in d.token_ids]

    ids = prompt_ids(server, "Hello there! How are you today?")
    [expected] = server.engine().generate([ids], SamplingParams(temperature=0.0, max_tokens=24))
    assert tokens == expected.token_ids
    assert text == expected.text
    assert summary.usage.prompt_tokens == len(ids)
    assert summary.usage.output_tokens == len(tokens) == 24
    assert summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert summary.request_id == "r-1" and summary.model == "tiny"
    ttft = summary.timing.time_to_first_token.ToNanoseconds()
    assert 0 < ttft <= summary.timing.total.ToNanoseconds()


def test_prefix_cache_is_reported(stub) -> None:
    """The same long prompt twice: the second time its full blocks come from the prefix cache."""
    text = "The capital of France is Paris. The capital of Italy is Rome. " * 4
    _, first = collect(stub.Generate(user_request(text, max_output_tokens=2, sampling=GREEDY)))
    _, second = collect(stub.Generate(user_request(text, max_output_tokens=2, sampling=GREEDY)))
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.cached_prompt_tokens >= 16
    assert second.usage.cached_prompt_tokens < second.usage.prompt_tokens


def test_logprobs(stub) -> None:
    request = user_request("Hello", max_output_tokens=5, sampling=GREEDY, logprobs=True, top_logprobs=3)
    deltas, _ = collect(stub.Generate(request))
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == [t for d in deltas for t in d.token_ids]
    for lp in lps:
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token_id == lp.token_id  # greedy: the chosen token is the most likely
        assert lp.logprob <= 0 and math.isclose(lp.logprob, lp.top_logprobs[0].logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_seeded_sampling_is_reproducible(stub) -> None:
    sampling = sampling_pb2.SamplingConfig(temperature=1.0, top_p=0.9, seed=1234)
    runs = [collect(stub.Generate(user_request("Hello", max_output_tokens=12, sampling=sampling))) for _ in range(2)]
    ids = [[t for d in deltas for t in d.token_ids] for deltas, _ in runs]
    assert ids[0] == ids[1]


def test_stop_token_ids(server: ServerThread, stub) -> None:
    deltas, _ = collect(stub.Generate(user_request("Hello", max_output_tokens=8, sampling=GREEDY, ignore_eos=True)))
    tokens = [t for d in deltas for t in d.token_ids]
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    deltas, summary = collect(
        stub.Generate(
            user_request("Hello", max_output_tokens=8, sampling=GREEDY, ignore_eos=True, stop_token_ids=[stop_at])
        )
    )
    assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert summary.usage.output_tokens == first + 1


def test_sixteen_concurrent_clients(server: ServerThread) -> None:
    results: list[generation_pb2.GenerateSummary | Exception] = [None] * 16  # type: ignore[list-item]

    def client(i: int) -> None:
        try:
            stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
            _, summary = collect(stub.Generate(user_request(f"Client {i} says hello", max_output_tokens=8 + i)))
            results[i] = summary
        except Exception as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, summary in enumerate(results):
        assert isinstance(summary, generation_pb2.GenerateSummary), summary
        assert summary.usage.output_tokens <= 8 + i
    assert server.wait_kv_free() == (server.engine().kv_usage().total_blocks,) * 2


def _bad(**fields) -> generation_pb2.GenerateRequest:
    return user_request("Hello", **fields)


def _contents(*contents: content_pb2.Content) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(contents=list(contents))


TEXT = content_pb2.Part(text="Hi")
INVALID = [
    (generation_pb2.GenerateRequest(), "contents"),
    (_contents(content_pb2.Content(role="wizard", parts=[TEXT])), "contents[0].role"),
    (_contents(content_pb2.Content(role="user")), "contents[0].parts"),
    (_contents(content_pb2.Content(role="user", parts=[TEXT, content_pb2.Part()])), "contents[0].parts[1]"),
    (
        _contents(content_pb2.Content(parts=[content_pb2.Part(image=content_pb2.ImagePart(data=b"\x89PNG"))])),
        "contents[0].parts[0].image",
    ),
    (
        _contents(content_pb2.Content(parts=[content_pb2.Part(audio=content_pb2.AudioPart(data=b"RIFF"))])),
        "contents[0].parts[0].audio",
    ),
    (_bad(sampling=sampling_pb2.SamplingConfig(temperature=-0.5)), "sampling.temperature"),
    (_bad(sampling=sampling_pb2.SamplingConfig(temperature=float("nan"))), "sampling.temperature"),
    (_bad(sampling=sampling_pb2.SamplingConfig(top_p=0.0)), "sampling.top_p"),
    (_bad(sampling=sampling_pb2.SamplingConfig(top_p=1.5)), "sampling.top_p"),
    (_bad(sampling=sampling_pb2.SamplingConfig(top_k=-2)), "sampling.top_k"),
    (_bad(sampling=sampling_pb2.SamplingConfig(min_p=2.0)), "sampling.min_p"),
    (_bad(sampling=sampling_pb2.SamplingConfig(repetition_penalty=0.0)), "sampling.repetition_penalty"),
    (_bad(sampling=sampling_pb2.SamplingConfig(presence_penalty=3.0)), "sampling.presence_penalty"),
    (_bad(sampling=sampling_pb2.SamplingConfig(frequency_penalty=-3.0)), "sampling.frequency_penalty"),
    (_bad(sampling=sampling_pb2.SamplingConfig(logit_bias={100000: 1.0})), "sampling.logit_bias"),
    (_bad(max_output_tokens=0), "max_output_tokens"),
    (_bad(max_output_tokens=100_000), "max_output_tokens"),  # above the context
    (_bad(max_output_tokens=CONTEXT - 4), "max_output_tokens"),  # fits the context alone, not with the prompt
    (_bad(min_output_tokens=9, max_output_tokens=4), "min_output_tokens"),
    (_bad(stop_sequences=[""]), "stop_sequences"),
    (_bad(stop_token_ids=[-1]), "stop_token_ids"),
    (_bad(top_logprobs=3), "top_logprobs"),  # without logprobs
    (_bad(logprobs=True, top_logprobs=21), "top_logprobs"),
    (user_request("Hello " * CONTEXT), "contents"),  # prompt longer than the context
    (_bad(request_id="x" * 257), "request_id"),
]


@pytest.mark.parametrize(("request_", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_argument_names_the_field(server: ServerThread, stub, request_, field: str) -> None:
    request_.model = "tiny"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    fields = [v.field for v in field_violations(info.value)]
    assert field in fields, (fields, info.value.details())
    assert all(v.description for v in field_violations(info.value))
    # ... and the server keeps serving.
    _, summary = collect(stub.Generate(user_request("Still there?", max_output_tokens=2)))
    assert summary.usage.output_tokens >= 1


def test_every_violation_reported_at_once(stub) -> None:
    request = user_request("Hi", sampling=sampling_pb2.SamplingConfig(temperature=-1, top_p=2, top_k=-3))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request))
    fields = {v.field for v in field_violations(info.value)}
    assert {"sampling.temperature", "sampling.top_p", "sampling.top_k"} <= fields


def test_unknown_model_is_not_found(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(user_request("Hi", model="no-such-model")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in info.value.details()
    [resource] = [d for d in status_details(info.value) if isinstance(d, error_details_pb2.ResourceInfo)]
    assert resource.resource_type == "model" and resource.resource_name == "no-such-model"


LONG = dict(max_output_tokens=4000, ignore_eos=True)  # many seconds even for the tiny model: always interrupted


def test_cancelled_stream_frees_kv(server: ServerThread, stub) -> None:
    engine = server.engine()
    call = stub.Generate(user_request("Talk for a long time.", **LONG))
    first = next(call)
    assert first.HasField("delta")
    assert engine.kv_usage().free_blocks < engine.kv_usage().total_blocks  # it holds blocks while running
    call.cancel()
    free, total = server.wait_kv_free()
    assert free == total
    assert engine.num_unfinished() == 0
    engine.check_integrity()


def test_deadline_frees_kv(server: ServerThread, stub) -> None:
    """The deadline passes while the stream runs (a delta first: proof that it held blocks). On a loaded machine the
    first delta can come after a 1 s deadline: then the call is tried again with twice the deadline."""
    engine = server.engine()
    for deadline_s in (1.0, 2.0, 4.0, 8.0):
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.Generate(user_request("Talk for a long time.", **LONG), timeout=deadline_s):
                received += 1
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if received:
            break
        assert server.wait_kv_free() == (engine.kv_usage().total_blocks,) * 2  # a deadline before any delta frees too
    assert received > 0  # it was streaming when the deadline passed
    free, total = server.wait_kv_free()
    assert free == total
    assert engine.num_unfinished() == 0


def test_queue_bound(checkpoint: Path) -> None:
    """With --max-queue 1, a second request while one runs gets RESOURCE_EXHAUSTED with a RetryInfo."""
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], EngineOptions(kv_cache_gib=KV_GIB), max_queue=1) as s:
        stub = generation_pb2_grpc.GenerationServiceStub(s.channel())
        running = stub.Generate(user_request("Talk for a long time.", **LONG))
        assert next(running).HasField("delta")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(user_request("Me too", max_output_tokens=2)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        [retry] = [d for d in status_details(info.value) if isinstance(d, error_details_pb2.RetryInfo)]
        assert retry.retry_delay.ToNanoseconds() > 0
        running.cancel()
        s.wait_kv_free()
        deadline = time.monotonic() + 5
        while s.registry.lookup("tiny").in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        _, summary = collect(stub.Generate(user_request("Now me", max_output_tokens=2)))  # the slot is free again
        assert summary.usage.output_tokens >= 1


def test_drain_lets_streams_finish(checkpoint: Path) -> None:
    """stop(grace): the in-flight stream completes; calls after the drain began are refused. The engine is held
    between steps (a step observer waiting on an event) while the drain is checked, so the stream outlasts those
    RPCs on any machine, however fast; released, its 50 tokens take well under the grace."""
    srv = ServerThread([ModelSpec(path=checkpoint, name="tiny")], EngineOptions(kv_cache_gib=KV_GIB))
    with srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        release, held = threading.Event(), threading.Event()

        def hold(_step) -> None:  # runs on the engine's thread after each step
            held.set()
            release.wait(60)

        srv.engine().step_observers.append(hold)
        running = stub.Generate(user_request("Talk for a long time.", max_output_tokens=50, ignore_eos=True))
        assert next(running).HasField("delta")
        assert held.wait(30)
        stopping = threading.Thread(target=srv.run, args=(srv.server.stop(60.0),))
        stopping.start()
        while not srv.registry.draining:
            time.sleep(0.001)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(user_request("Late", max_output_tokens=2)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        health = health_pb2_grpc.HealthStub(srv.channel()).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert stopping.is_alive()  # still draining: the stream below is in flight, its engine held
        release.set()
        deltas, summary = collect(running)
        assert summary.usage.output_tokens == 50
        stopping.join(timeout=30)
        assert not stopping.is_alive()


def test_chat_template_refusal_is_invalid_argument(tmp_path: Path) -> None:
    """A template that raises (as some do for a system turn) is the request's fault, named on `contents`."""
    ckpt = make_checkpoint(tmp_path / "no-system", family="llama")
    template = (ckpt / "chat_template.jinja").read_text()
    refuse = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    (ckpt / "chat_template.jinja").write_text(refuse + template)
    with ServerThread([ModelSpec(path=ckpt)], EngineOptions(kv_cache_gib=KV_GIB)) as srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        request = user_request("Hi", max_output_tokens=2)
        request.contents.insert(0, content_pb2.Content(role="system", parts=[content_pb2.Part(text="Be brief.")]))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(info.value)] == ["contents"]
        assert "no system turns" in info.value.details()
        *_, last = stub.Generate(user_request("Hi", max_output_tokens=2))  # without the system turn: served
        assert last.HasField("summary")


def test_logit_bias_and_penalties_reach_the_sampler(stub) -> None:
    forced = 200
    sampling = sampling_pb2.SamplingConfig(temperature=0.0, logit_bias={forced: 100.0})
    deltas, _ = collect(stub.Generate(user_request("Hello", max_output_tokens=6, sampling=sampling, ignore_eos=True)))
    assert [t for d in deltas for t in d.token_ids] == [forced] * 6
    # A repetition penalty strong enough beats the bias once the token has been generated.
    sampling = sampling_pb2.SamplingConfig(temperature=0.0, logit_bias={forced: 5.0}, frequency_penalty=2.0)
    deltas, _ = collect(stub.Generate(user_request("Hello", max_output_tokens=6, sampling=sampling, ignore_eos=True)))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens.count(forced) < 6


def _turns(n: int) -> generation_pb2.GenerateRequest:
    return _contents(*[content_pb2.Content(role="user") for _ in range(n)])  # no parts: only the turn count


def _parts(n: int) -> generation_pb2.GenerateRequest:
    return _contents(content_pb2.Content(role="user", parts=[content_pb2.Part(text="a")] * n))


def _utf8(n_bytes: int) -> str:
    return "é" * (n_bytes // 2) + "a" * (n_bytes % 2)  # two bytes a character: bytes are counted, not characters


def _text(n_bytes: int) -> generation_pb2.GenerateRequest:
    return user_request(_utf8(n_bytes))


# (request of size n, the limit, the field named, what the size violation says): services/limits.py's numbers,
# written out here so that changing one is a visible decision.
SIZE_LIMITS = {
    "turns": (_turns, 1024, "contents", "1025 turns; at most 1024"),
    "parts": (_parts, 1024, "contents", "1025 parts; at most 1024"),
    "text": (_text, 1 << 20, "contents", f"{(1 << 20) + 1} bytes of text; at most {1 << 20}"),
    "stop-ids": (lambda n: _bad(stop_token_ids=list(range(n))), 64, "stop_token_ids", "65 ids; at most 64"),
    "stop-bytes": (lambda n: _bad(stop_sequences=[_utf8(n)]), 256, "stop_sequences[0]", "longer than 256 bytes"),
    "biases": (
        lambda n: _bad(sampling=sampling_pb2.SamplingConfig(logit_bias={i: 0.5 for i in range(n)})),
        1024,
        "sampling.logit_bias",
        "1025 entries; at most 1024",
    ),
}


def _refusal(stub, request: generation_pb2.GenerateRequest) -> list[tuple[str, str]] | None:
    """None when the request was served; else the (field, description) pairs of its INVALID_ARGUMENT."""
    request.model = "tiny"
    request.max_output_tokens = request.max_output_tokens or 2
    try:
        collect(stub.Generate(request, timeout=60))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        return [(v.field, v.description) for v in field_violations(err)]
    return None


@pytest.mark.parametrize("kind", list(SIZE_LIMITS))
def test_size_limit_at_its_edge(stub, kind: str) -> None:
    """The limit itself passes the size check (the request may still be refused for what it says: 1,024 empty turns,
    a 1 MiB prompt past the context, biases on ids past the vocabulary); one more is INVALID_ARGUMENT naming the field
    with the size; the server keeps serving."""
    build, limit, field, says = SIZE_LIMITS[kind]
    at_limit = _refusal(stub, build(limit))
    assert at_limit is None or not any("at most" in d and str(limit) in d for _, d in at_limit), at_limit
    if kind.startswith("stop"):
        assert at_limit is None  # nothing else wrong with these: served
    over = _refusal(stub, build(limit + 1))
    assert over is not None and (field, says) in over, over
    _, summary = collect(stub.Generate(user_request("Still there?", max_output_tokens=2)))
    assert summary.usage.output_tokens >= 1
