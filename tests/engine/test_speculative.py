"""Speculative decoding: the rejection scheme is exact in distribution, greedy output never changes, blocks follow
the committed tokens, and the n-gram and draft-model proposers propose what they should."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.drafts import GeneralDraft
from support.engines import device_under_test, tiny_checkpoint, tiny_engine
from support.host_reads import count_host_reads, synchronising_calls
from support.sampling_checks import PROMPT, chi_square_ok
from support.sampling_checks import spread as spread  # noqa: F401  (fixture)

from omnivox.engine import SamplingParams
from omnivox.engine.draft import DraftModelProposer
from omnivox.engine.speculative import NgramProposer, resolve

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(11, 30)), [5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 45))]


@pytest.mark.parametrize("kind", ["point-mass", "general"])
def test_rejection_scheme_reproduces_p_within_tv_001(kind):
    torch.manual_seed(0)
    n, v = 200_000, 8
    p = torch.softmax(torch.randn(v) * 1.5, 0)
    q = torch.softmax(torch.randn(v) * 1.5, 0) if kind == "general" else None
    if q is None:
        drafts = torch.full((n,), 3)  # always the same token
        q_rows = None
    else:
        drafts = torch.multinomial(q, n, replacement=True)
        q_rows = q.expand(n, v)
    _, tokens = resolve(p.expand(n, v), q_rows, drafts, torch.rand(n), torch.empty(n, v).exponential_())
    freq = torch.bincount(tokens, minlength=v).double() / n
    tv = 0.5 * (freq - p.double()).abs().sum().item()
    assert tv < 0.01, tv
    # And the check has power: the drafts alone (no rejection) are far from p.
    if q is not None:
        assert 0.5 * (q - p).abs().sum().item() > 0.05


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    return tiny_checkpoint(root, request.param), tiny_checkpoint(root, request.param, seed=7)


class Stateful:
    """A stateful constraint (the shape of a grammar matcher): bans one token after each even count of advances."""

    def __init__(self) -> None:
        self.n = 0
        self.mask = torch.ones(384, dtype=torch.bool)
        self.banned = self.mask.clone()
        self.banned[::3] = False

    def allowed(self, output_token_ids):
        assert self.n == len(output_token_ids)
        return self.banned if self.n % 2 == 0 else self.mask

    def advance(self, tokens):
        self.n += len(tokens)

    def rollback(self, n):
        self.n -= n


def run_all(engine, prompts, params):
    ids = [engine.add_request(p, params[i], request_id=f"r{i}") for i, p in enumerate(prompts)]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        for req in engine.scheduler.running:  # blocks held = what the committed tokens need
            assert len(req.block_table) <= -(-(req.num_tokens + len(req.draft_token_ids)) // engine.block_size)
    return [out[i] for i in ids]


def test_greedy_output_identical_with_every_proposer(family):
    target, other = family
    plain = tiny_engine(target)
    params = [
        GREEDY,
        GREEDY,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, constraint_factory=Stateful),
    ]
    expected = run_all(plain, PROMPTS, params)
    for name, proposer in (
        ("draft=target", DraftModelProposer.from_pretrained(target, device="cpu", k=3, kv_cache_gib=0.01)),
        ("random draft", DraftModelProposer.from_pretrained(other, device="cpu", k=3, kv_cache_gib=0.01)),
        ("ngram", NgramProposer(k=3, min_n=1, max_n=3)),
    ):
        spec = tiny_engine(target, proposer=proposer)
        drafted = accepted = 0
        ids = [spec.add_request(p, params[i], request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        finals = {}
        while spec.has_unfinished():
            for o in spec.step():
                if o.finished:
                    finals[o.request_id] = o.token_ids
            drafted += spec.last_step.stats.num_drafted
            accepted += spec.last_step.stats.num_accepted
        got = [finals[i] for i in ids]
        assert got == expected, name
        assert drafted > 0, name
        if name == "draft=target":
            assert accepted >= 0.8 * drafted, (accepted, drafted)  # the constraint cuts some proposals
        spec.check_integrity()
        assert spec.pool.num_free == spec.pool.usage().total_blocks
        if isinstance(proposer, DraftModelProposer):
            assert proposer.pool.num_free == proposer.pool.usage().total_blocks  # shadows freed at finish


def test_json_schema_request_identical_with_speculation(family):
    """A grammar-constrained request (llguidance JSON schema): drafts are cut at the first token the grammar
    rejects, every verification row is masked by the grammar advanced over the drafts, output unchanged."""
    import llguidance

    from omnivox.engine.structured import compile_grammar, grammar_tokenizer

    target, _ = family
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})

    def run(engine):
        cfg = engine.model_config
        factory = compile_grammar(
            grammar_tokenizer(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids),
            grammar,
            cfg.vocab_size,
            cfg.eos_token_ids,
        )
        params = [SamplingParams(temperature=0, max_tokens=40, constraint_factory=factory), GREEDY]
        return run_all(engine, PROMPTS[:2], params), engine

    expected, _ = run(tiny_engine(target))
    for proposer in (
        DraftModelProposer.from_pretrained(target, device="cpu", k=3, kv_cache_gib=0.01),
        NgramProposer(k=3, min_n=1, max_n=3),
    ):
        got, engine = run(tiny_engine(target, proposer=proposer))
        assert got == expected
        engine.check_integrity()


def test_ngram_proposes_what_followed_the_last_match():
    from omnivox.engine.request import Request

    prop = NgramProposer(k=3, min_n=2, max_n=4)
    req = Request("r", [1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3], SamplingParams(), 10, ())
    assert prop(req) == [4, 7, 8]  # "1 2 3" last seen before "4 7 8"
    assert prop(Request("s", [1, 2, 3, 4, 5], SamplingParams(), 10, ())) == []


def test_first_two_tokens_keep_their_distribution_at_temperature_1(spread):  # noqa: F811
    path, first_logits = spread
    from support.checkpoints import load_reference

    model = load_reference(path)
    with torch.no_grad():  # p(t2 | t1) for every t1
        batch = torch.tensor([PROMPT + [t] for t in range(384)])
        second = torch.softmax(model(batch).logits[:, -1].double(), -1).numpy()
    p1 = torch.softmax(torch.tensor(first_logits), 0).numpy()
    joint = (p1[:, None] * second).ravel()
    draft = GeneralDraft(384)
    engine = tiny_engine(path, proposer=draft, max_num_batched_tokens=512)
    engine.core.gate.max_batch = 10**6  # verify in every step, however large the batch
    engine.core.gate.min_acceptance = 0.0
    n = 3000
    # max_tokens=3: the second token is the one verified against the draft (the first comes from the prefill)
    outs = engine.generate([PROMPT] * n, [SamplingParams(max_tokens=3, ignore_eos=True, seed=i) for i in range(n)])
    assert draft.proposed >= n
    counts = np.zeros(384 * 384)
    for o in outs:
        counts[o.token_ids[0] * 384 + o.token_ids[1]] += 1
    ok, stat, limit = chi_square_ok(counts, joint)
    assert ok, (stat, limit)
    engine.check_integrity()


def _drafted(i: int, params: SamplingParams, drafts: list[int], seed: int | None = None, device: str = "cpu"):
    from omnivox.engine.request import Request

    req = Request(f"v{i}", [3, 4, 5 + i], params, 32, (2,))
    req.draft_token_ids = list(drafts)
    req.generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return req


def _mixed_drafts(device: str = "cpu"):
    return [
        _drafted(0, SamplingParams(temperature=0), [7, 8, 9], device=device),
        _drafted(1, SamplingParams(temperature=1.0, seed=3), [10, 11], seed=3, device=device),
        _drafted(2, SamplingParams(temperature=0.8, top_p=0.9), [12, 13], device=device),
        _drafted(3, SamplingParams(temperature=0), [14], device=device),
    ]


def test_verification_reads_the_host_once_per_step(monkeypatch):
    """Greedy and sampled requests, with and without draft distributions, seeded or not: their verification reads
    the device once in all (the sampler's transfer), not once per request."""
    from omnivox.engine.sampler import Sampler
    from omnivox.engine.speculative import verify_requests

    V = 64
    sampler = Sampler(V, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    reqs = _mixed_drafts()
    rows = [torch.randn(len(r.draft_token_ids) + 1, V, generator=g) for r in reqs]
    calls = count_host_reads(monkeypatch)
    out = verify_requests(sampler, rows, reqs, [None, q, None, None])
    monkeypatch.undo()
    assert calls == {"tolist": 1} and sampler.transfer.num_copies == 1
    for r, tokens, logits in zip(reqs, out, rows, strict=True):
        assert 1 <= len(tokens) <= len(r.draft_token_ids) + 1 and tokens[:-1] == r.draft_token_ids[: len(tokens) - 1]
        if r.params.is_greedy:  # greedy: the drafts that match the argmax, then the argmax
            picks = logits.argmax(-1).tolist()
            n = next((j for j, d in enumerate(r.draft_token_ids) if d != picks[j]), len(r.draft_token_ids))
            assert tokens == r.draft_token_ids[:n] + [picks[n]]


def test_mixed_step_reads_the_host_once(tmp_path, monkeypatch):
    """A step with a chunked prefill, plain decodes and drafts to verify reads the device once in all: the plain
    rows' draws and the verification's go down in one copy. Outputs equal each request run alone without drafts."""
    path = tiny_checkpoint(tmp_path, "llama")
    drafting = (
        [5, 6, 7, 8] * 6,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    plain = (
        list(range(20, 45)),  # logprobs: never drafted, always a plain row
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=2),
    )
    alone = [tiny_engine(path).generate([p], [s])[0] for p, s in (drafting, plain)]
    engine = tiny_engine(path, proposer=NgramProposer(k=3, min_n=1, max_n=3), max_num_batched_tokens=12)
    engine.core.gate.max_batch, engine.core.gate.min_acceptance = 10**6, 0.0
    engine.add_request(*drafting, request_id="a")
    finals, mixed, step = {}, 0, 0
    while engine.has_unfinished():
        if step == 4:  # its prefill (25 tokens, 12-token chunks) joins the drafting request's decodes
            engine.add_request(*plain, request_id="b")
        copies = engine.core.sampler.transfer.num_copies
        calls = count_host_reads(monkeypatch)
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        monkeypatch.undo()
        verifies = [c.num_verify for c in engine.last_step.plan.chunks if c.samples]
        mixed += max(verifies, default=0) > 1 and 1 in verifies
        assert calls == ({"tolist": 1} if verifies else {}), (step, verifies, calls)
        assert engine.core.sampler.transfer.num_copies - copies == (1 if verifies else 0)
        step += 1
    assert mixed >= 2, "the workload must hold steps with both plain and drafted rows"
    assert [finals[i].token_ids for i in "ab"] == [a.token_ids for a in alone]
    for x, y in zip(finals["b"].logprobs, alone[1].logprobs, strict=True):  # float32 sums vary with the batch
        assert [t for t, _ in x.top] == [t for t, _ in y.top] and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    engine.check_integrity()


@pytest.mark.skipif(device_under_test().type != "cuda", reason="needs OMNIVOX_TEST_DEVICE=cuda (gpu_check.sh)")
def test_cuda_mixed_engine_step_makes_no_synchronising_call(tmp_path):
    """Whole engine steps on the GPU (scheduling, the forward pass, plain rows sampled and drafts verified, their one
    read back): torch's sync debug mode names any call that waits for the GPU; the event wait of the one read is
    not one of them."""
    path = tiny_checkpoint(tmp_path, "llama")
    engine = tiny_engine(path, proposer=NgramProposer(k=3, min_n=1, max_n=3), max_num_batched_tokens=12)
    engine.core.gate.max_batch, engine.core.gate.min_acceptance = 10**6, 0.0
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=2)
    engine.generate([[5, 6, 7, 8] * 6, list(range(20, 45))], [greedy, sampled])  # warm-up: compiles, allocations
    engine.add_request([6, 7, 8, 9] * 6, greedy, request_id="a")
    syncs: list[str] = []
    mixed = step = 0
    while engine.has_unfinished():
        if step == 4:
            engine.add_request(list(range(21, 46)), sampled, request_id="b")
        with synchronising_calls(engine.core.runner.device) as seen:
            engine.step()
        syncs += seen
        verifies = [c.num_verify for c in engine.last_step.plan.chunks if c.samples]
        mixed += max(verifies, default=0) > 1 and 1 in verifies
        step += 1
    assert syncs == [], sorted(set(syncs))
    assert mixed >= 1, "no step held both plain and drafted rows"


@pytest.mark.parametrize("accepted", [False, True])
def test_seeded_stream_as_if_the_bonus_were_drawn_only_when_needed(accepted):
    """The bonus token is drawn before the host knows whether every draft passed (one read per step); a seeded
    request whose drafts were not all accepted gets its generator set back, so its stream (and every later token)
    is what drawing the bonus only when needed gives."""
    from omnivox.engine.sampler import Sampler
    from omnivox.engine.speculative import verify_requests

    V, k = 50, 3
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1).tolist()
    logits[range(k + 1), best] += 200.0  # p is a point mass on the argmax (exp(-200) is 0 in float32)
    drafts = best[:k] if accepted else [(best[0] + 1) % V, 0, 0]
    req = _drafted(0, SamplingParams(temperature=1.0, seed=5), drafts, seed=5)
    assert not req.params.is_greedy
    (tokens,) = verify_requests(Sampler(V, torch.device("cpu")), [logits], [req], [None])
    assert tokens == (best if accepted else best[:1])
    ref = torch.Generator().manual_seed(5)
    torch.rand(k, generator=ref)
    torch.empty(k, V).exponential_(generator=ref)
    if accepted:
        torch.empty(V).exponential_(generator=ref)
    assert torch.equal(req.generator.get_state(), ref.get_state())


@pytest.mark.skipif(device_under_test().type != "cuda", reason="needs OMNIVOX_TEST_DEVICE=cuda (gpu_check.sh)")
def test_cuda_verification_makes_no_synchronising_call():
    """On the GPU the verification of a mixed batch waits only in the one transfer (an event wait, which torch's sync
    debug mode does not count); greedy requests accept what the CPU accepts."""
    from omnivox.engine.sampler import Sampler
    from omnivox.engine.speculative import verify_requests

    V, dev = 64, device_under_test()
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    rows = [torch.randn(n + 1, V, generator=g) for n in (3, 2, 2, 1)]
    sampler = Sampler(V, dev)
    verify_requests(sampler, [r.to(dev) for r in rows], _mixed_drafts(str(dev)), [None, q.to(dev), None, None])
    on_device = [r.to(dev) for r in rows]
    reqs = _mixed_drafts(str(dev))
    with synchronising_calls(dev) as syncs:
        out = verify_requests(sampler, on_device, reqs, [None, q.to(dev), None, None])
    assert syncs == [], syncs
    cpu = verify_requests(Sampler(V, torch.device("cpu")), rows, _mixed_drafts(), [None, q, None, None])
    assert [out[i] for i in (0, 3)] == [cpu[i] for i in (0, 3)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_model_reads_its_tokens_back_once_per_proposal(tmp_path, monkeypatch, temperature):
    """The draft's k tokens stay on the device between its steps (each feeds the next step's input ids) and come
    back in one read at the end, not one per token; the shadow then holds the real tokens, and a second proposal
    (after the target accepted some) continues from them."""
    from omnivox.engine.request import Request

    target = tiny_checkpoint(tmp_path, "llama")
    prop = DraftModelProposer.from_pretrained(target, device="cpu", k=3, kv_cache_gib=0.01)
    params = SamplingParams(temperature=temperature, seed=5 if temperature else None)
    req = Request("d", [5, 6, 7, 5, 6, 7, 5, 6], params, 64, (2,))
    req.generator = torch.Generator().manual_seed(5) if temperature else None
    calls = count_host_reads(monkeypatch)
    first = prop(req)
    monkeypatch.undo()
    assert calls == {"tolist": 1}, calls
    assert len(first.tokens) == 3 and all(isinstance(t, int) and 0 <= t < 384 for t in first.tokens)
    assert (first.q is None) == (temperature == 0.0)
    shadow = prop._shadows["d"]
    assert shadow.output_token_ids == first.tokens and -1 not in shadow.output_token_ids
    req.output_token_ids = first.tokens[:2]  # the target accepted two drafts
    second = prop(req)
    assert len(second.tokens) == 3 and prop._shadows["d"].output_token_ids == first.tokens[:2] + second.tokens
    if temperature == 0.0:  # greedy: the draft is the target model itself, so its proposal is the target's tokens
        engine = tiny_engine(target)
        out = engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert first.tokens == out[0].token_ids[:3] and second.tokens == out[0].token_ids[2:5]
