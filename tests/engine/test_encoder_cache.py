"""The encoder cache and worker behind embedding segments: encoded once, batched, off the decode path, released."""

from __future__ import annotations

import threading

import pytest
import torch
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import EmbeddingSegment, SamplingParams
from omnivox.engine.encoder_cache import EncoderCache, EncoderWorker

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 60))  # a 20-token "image" at positions 8..28


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("enc"), "llama")


class FakeEncoder:
    """Embeds token ids with the model's own embedding table; counts batches; can be held at a gate."""

    def __init__(self, engine, fail_on: int | None = None) -> None:
        self.engine, self.fail_on = engine, fail_on
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, payloads):
        self.entered.set()
        self.gate.wait(10)
        self.batches.append([p[0] for p in payloads])
        if self.fail_on is not None and any(p[0] == self.fail_on for p in payloads):
            raise ValueError("bad input")
        return [self.engine.embed_tokens(p) for p in payloads]


def image(worker: EncoderWorker, first: int) -> EmbeddingSegment:
    ids = list(range(first, first + 20))
    return EmbeddingSegment(8, 20, key=f"img-{first}", source=worker.handle(f"img-{first}", ids))


def test_same_input_encoded_once_and_others_batched(ckpt):
    engine = tiny_engine(ckpt)
    enc = FakeEncoder(engine)
    cache = EncoderCache(budget_bytes=1 << 20)
    worker = EncoderWorker(enc, cache)
    enc.gate.clear()  # the first batch waits: everything admitted meanwhile queues behind it
    segs = [[image(worker, 200)], [image(worker, 200)], [image(worker, 230)], [image(worker, 260)]]
    prompts = [PROMPT, [9, *PROMPT[1:]], PROMPT, PROMPT]
    thread = threading.Thread(target=lambda: enc.entered.wait(10) and enc.gate.set())
    thread.start()
    outs = engine.generate(prompts, GREEDY, segments=segs)
    thread.join()
    assert sorted(x for b in enc.batches for x in b) == [200, 230, 260]  # img-200 shared by two requests: once
    assert len(enc.batches) <= 2
    assert outs[0].token_ids != outs[2].token_ids
    ready = engine.embed_tokens(list(range(200, 220)))
    plain = engine.generate([PROMPT], GREEDY, segments=[[EmbeddingSegment.from_embeds(8, ready, key="x")]])[0]
    assert outs[0].token_ids == plain.token_ids
    assert cache.total_refs() == 0 and cache.hits == 1 and cache.misses == 3
    engine.check_integrity()
    worker.shutdown()


def test_decodes_go_on_while_an_image_is_encoded(ckpt):
    engine = tiny_engine(ckpt)
    enc = FakeEncoder(engine)
    worker = EncoderWorker(enc, EncoderCache(1 << 20))
    enc.gate.clear()
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id="text")
    engine.step()
    engine.add_request(PROMPT, GREEDY, request_id="img", segments=[image(worker, 300)])

    def step_decodes_text_only() -> None:  # the image's prefill stops before the segment; the text decodes
        engine.step()
        plan = engine.last_step.plan
        assert [c.request.request_id for c in plan.decodes] == ["text"]
        assert all(c.end <= 8 for c in plan.prefills)

    for _ in range(10):
        step_decodes_text_only()
    # The worker thread may not have been scheduled yet on a loaded host (ten steps took less than its start at
    # load 10): wait for it to be inside the encode, then step on while it is held there.
    assert enc.entered.wait(30)
    for _ in range(3):
        step_decodes_text_only()
    enc.gate.set()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    worker.shutdown()


def test_cancel_while_encoding_and_failures_release_references(ckpt):
    engine = tiny_engine(ckpt)
    enc = FakeEncoder(engine, fail_on=100)
    cache = EncoderCache(1 << 20)
    worker = EncoderWorker(enc, cache)
    enc.gate.clear()
    engine.add_request(PROMPT, GREEDY, request_id="cancelled", segments=[image(worker, 330)])
    engine.step()
    assert cache.refs("img-330") == 1
    engine.abort("cancelled")
    engine.step()
    assert cache.refs("img-330") == 0
    enc.gate.set()
    bad, good = engine.generate([PROMPT, PROMPT], GREEDY, segments=[[image(worker, 100)], [image(worker, 130)]])
    assert bad.finish_reason == "error" and good.finish_reason == "length"  # a failing batch is retried one by one
    assert cache.total_refs() == 0 and "img-100" not in cache
    engine.check_integrity()
    assert engine.generate([PROMPT], GREEDY, segments=[[image(worker, 130)]])[0].finish_reason == "length"
    worker.shutdown()


def test_prefix_hit_never_encodes_and_eviction_re_encodes_identically(ckpt):
    engine = tiny_engine(ckpt)
    enc = FakeEncoder(engine)
    one = 20 * engine.model_config.hidden_size * 4
    cache = EncoderCache(budget_bytes=one)  # room for one image's features
    worker = EncoderWorker(enc, cache)
    first = engine.generate([PROMPT], GREEDY, segments=[[image(worker, 160)]])[0]
    again = engine.generate([PROMPT], GREEDY, segments=[[image(worker, 160)]])[0]
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    assert enc.batches == [[160]]  # the prefix cache covered the image: not even a cache lookup was needed
    engine.generate([PROMPT], GREEDY, segments=[[image(worker, 190)]])  # evicts img-500 (budget: one image)
    assert "img-160" not in cache and "img-190" in cache and cache.evictions == 1
    fresh = tiny_engine(ckpt)  # no prefix cache: the image must be encoded again
    lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    a = fresh.generate([PROMPT], lp, segments=[[image(worker, 160)]])[0]
    b = tiny_engine(ckpt).generate([PROMPT], lp, segments=[[image(worker, 160)]])[0]  # a cache hit this time
    assert enc.batches == [[160], [190], [160]]
    assert a.token_ids == b.token_ids == first.token_ids
    # Same tokens, same log-probabilities within float32 rounding, not bit for bit: the two runs cut their prefill
    # differently (one waits for the encoder, one finds the image cached), and MKL's AVX2 sgemm gives a row a result
    # that depends on how many rows share the call (7th significant digit; its AVX-512 kernels happen not to). The
    # engine does not promise batch- or chunk-invariant floats (tests/engine/test_engine.py states the bound).
    assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], rel=1e-5, abs=1e-5)
    assert cache.total_refs() == 0
    worker.shutdown()


def test_a_feature_larger_than_the_budget_stays_while_referenced():
    cache = EncoderCache(budget_bytes=16)
    worker = EncoderWorker(lambda ps: [torch.ones(4, 4) for _ in ps], cache)
    h = worker.handle("big", "payload")
    h.start()
    assert h.result().shape == (4, 4) and "big" in cache  # 64 bytes > 16, but referenced
    h.release()
    assert "big" not in cache
    worker.shutdown()


def test_the_worker_thread_runs_on_the_encoders_cuda_device(monkeypatch):
    """`--device cuda:1`: the encoder thread makes that device its current one before its first encode, as the engine
    thread does (kernels and allocations naming no device would otherwise land on cuda:0). torch's set_device is
    recorded here instead of called, so this runs without a GPU; a CPU worker never calls it."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))

    def encode(ps):
        calls.append((threading.current_thread().name, "encode"))
        return [torch.ones(2, 2) for _ in ps]

    for device, expected in (("cuda:1", [("omnivox-gpu1", torch.device("cuda:1"))]), ("cpu", [])):
        calls.clear()
        worker = EncoderWorker(encode, EncoderCache(1 << 20), name="gpu1", device=device)
        h = worker.handle("x", "payload")
        h.start()
        assert h.result().shape == (2, 2)
        worker.shutdown()
        assert calls == [*expected, ("omnivox-gpu1", "encode")]
