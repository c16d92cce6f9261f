"""The llama.cpp peers on the embedded default GGUF, when the optional extra `llamacpp` is installed (else skipped)."""

from __future__ import annotations

import pytest

from omnivox.benchmarks.metrics import summarize
from omnivox.benchmarks.systems.hf_loading import load_tokenizer
from omnivox.benchmarks.workload import WorkloadSpec, make_workload

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def requests(default_gguf):
    spec = WorkloadSpec(num_requests=3, prompt_words=(3, 8), output_tokens=(3, 6), shared_prefix_words=2)
    return make_workload(spec, load_tokenizer(default_gguf))


@pytest.mark.timeout(180)
def test_in_process_peer_sees_the_same_prompt_tokens_and_ignores_eos(default_gguf, requests):
    from omnivox.benchmarks.systems.llamacpp import LlamaCppInProcess

    peer = LlamaCppInProcess(str(default_gguf))
    peer.start()
    try:
        # The templated text tokenizes to the very ids every other system gets (what the server peer relies on).
        ids = peer.llm.tokenize(requests[0].templated_text.encode(), add_bos=False, special=True)
        assert ids == requests[0].prompt_token_ids
        traces = peer.run(requests, 1, lambda n: None)
    finally:
        peer.close()
    assert [t.num_tokens for t in traces] == [r.max_tokens for r in requests]
    assert peer.name == "llama.cpp in-process (Q4_1)"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_server_peer_serialises_concurrent_requests_without_interrupting_them(default_gguf, tmp_path, requests):
    from omnivox.benchmarks.systems.llamacpp import LlamaCppServer

    peer = LlamaCppServer(str(default_gguf), log_path=tmp_path / "server.log")
    peer.start()
    try:
        traces = peer.run(requests, 3, lambda n: None)
    finally:
        peer.close()
    assert [t.error for t in traces] == [None] * 3
    m = summarize(peer.name, 3, traces)
    assert m.output_tokens == sum(r.max_tokens for r in requests) and m.num_errors == 0
