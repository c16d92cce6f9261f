"""RequestOutputs share their request's append-only history (each step's output costs O(its new tokens)): every output
still reads the tokens, text and logprobs of its own moment, however late it is read; and the per-tokenizer cache of
skipped special ids follows tokens added later."""

from __future__ import annotations

import pytest
from support.engines import tiny_checkpoint, tiny_engine
from transformers import AutoTokenizer

from omnivox.engine import SamplingParams
from omnivox.engine.detokenizer import IncrementalDetokenizer, skipped_token_ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("history"), "llama")


@pytest.fixture(scope="module")
def engine(ckpt):
    return tiny_engine(ckpt)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_each_output_reads_its_own_moment_after_later_steps(engine, logprobs):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True, logprobs=logprobs)
    seen = []
    engine.add_request(list(range(5, 25)), params, on_output=seen.append)
    while engine.has_unfinished():
        engine.step()
    assert len(seen) > 10 and seen[-1].finished
    tokens, text, lps = [], "", []
    for out in seen:  # read after the request finished: each still shows what it showed when made
        tokens += out.new_token_ids
        text += out.new_text
        assert out.token_ids == tokens and out.text == text
        if logprobs is None:
            assert out.logprobs is None and out.new_logprobs is None
        else:
            lps += out.new_logprobs
            assert out.logprobs == lps and len(lps) == len(tokens)
    (again,) = engine.generate([list(range(5, 25))], params)  # seeded: the one-shot output is the same
    assert (again.token_ids, again.text, again.logprobs) == (tokens, text, lps if logprobs is not None else None)


def test_stop_string_text_cut_equals_the_one_shot_text(engine):
    """A stop string found in the text's tail cuts it there: the streamed text and the final text both end before it,
    with nothing from it ever released."""
    free = engine.generate([list(range(30, 40))], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2 :][:3]
    assert len(stop) == 3 and stop in free.text
    seen = []
    engine.add_request(
        list(range(30, 40)),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        on_output=seen.append,
    )
    while engine.has_unfinished():
        engine.step()
    assert seen[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in seen) == seen[-1].text == free.text[: free.text.index(stop)]


def test_skipped_ids_cache_follows_tokens_added_later(ckpt):
    tok = AutoTokenizer.from_pretrained(ckpt)
    before = skipped_token_ids(tok)
    assert skipped_token_ids(tok) is before  # cached
    tok.add_special_tokens({"additional_special_tokens": ["<extra_special>"]})
    new_id = tok.convert_tokens_to_ids("<extra_special>")
    after = skipped_token_ids(tok)
    assert after == before | {new_id}
    detok = IncrementalDetokenizer(tok, [1], None, False, skip_special_tokens=True)
    ids = tok.encode("Hello there", add_special_tokens=False)
    for t in [ids[0], new_id, *ids[1:]]:
        detok.add(t)
    assert detok.take(final=True) == tok.decode(ids)


def test_output_processing_benchmark_runs_against_the_copying_side(tmp_path):
    import json

    from omnivox.benchmarks import output_processing

    out = tmp_path / "outproc.json"
    output_processing.main(["--before", "8cee4cf~1", "--lengths", "10", "60", "--steps", "5", "--repeats", "1",
                            "--out", str(out)])  # fmt: skip
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"plain", "logprobs"}
    assert all(set(c["us_per_step"]) == {"before", "after"} for c in cases.values())
