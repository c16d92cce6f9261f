"""A model group over two nodes (models/pipeline.py, models/node_worker.py): two process trees on loopback, gloo,
configured only through the variables LeaderWorkerSet sets (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS),
each tree tensor parallel over 2 ranks, pipeline stages across the trees (3 layers: 2 on the leader, 1 on the
worker). The worker tree is a real `omnivox serve` in a session of its own; the leader is this test's engine.

- Llama and Qwen3-MoE: the same greedy tokens and every step's logits within 1e-5 of one process, for four requests
  of different lengths batched with chunked prefill (one with an embedding segment); the pool whole afterwards; on
  shutdown the worker tree exits 0 and leaves no process.
- Killing the worker tree while idle stops the leader's engine (ModelGroupBroken) within a few seconds (heartbeats:
  no collective runs while idle); `omnivox serve` leader and worker as two trees: greedy tokens over gRPC equal one
  process's, and killing the worker tree mid-stream ends the call UNAVAILABLE and the leader exits non-zero; killing
  the leader tree ends the worker node with exit status 1 within seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from support.checkpoints import make_checkpoint
from support.node_groups import NodeTree, free_port, lws_env, processes_in_session
from support.service_harness import user_request

from omnivox.engine import EmbeddingSegment, Engine, SamplingParams
from omnivox.engine.errors import ModelGroupBroken
from omnivox.engine.tensor_parallel import TensorParallelModel
from omnivox.models.pipeline import PipelineStage, stage_layers
from omnivox.services.cli._node_flags import node_group
from omnivox.services.processing.prompt import ChatPromptBuilder
from omnivox.v1 import generation_pb2_grpc, sampling_pb2

PROMPTS = [[1, 17, 42, 99, 7], [1, *range(300, 340)], [1, 5, 6, 8, 13, 21, 34, 55, 89], [1, *range(50, 70)]]
NEW_TOKENS = 16
KV_GIB = 0.0006  # the single process's cache; a rank holds half the heads of its stage's layers
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=24, max_num_seqs=len(PROMPTS))
pytestmark = pytest.mark.slow  # two trees of 2 ranks each start (imports: ~30 s each on a busy 2-core machine)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multinode")
    return {
        family: make_checkpoint(root / family, family=family, num_hidden_layers=3, **extra)
        for family, extra in (("llama", {}), ("qwen3_moe", {}))
    }


def worker_tree(checkpoint: Path, port: int, *extra: str) -> NodeTree:
    return NodeTree(
        2, 1, "--model", str(checkpoint), "--tensor-parallel", "2", "--device", "cpu", "--threads", "1",
        "--master-port", str(port), *extra,
    )  # fmt: skip


def leader_group(monkeypatch: pytest.MonkeyPatch, port: int):
    """The leader's NodeGroup as `serve` builds it: from LeaderWorkerSet's variables alone (no --nnodes flags)."""
    for name, value in lws_env(2, 0).items():
        if name.startswith("LWS_"):
            monkeypatch.setenv(name, value)
    args = argparse.Namespace(nnodes=None, node_rank=None, master_addr=None, master_port=port, models=[Path("m")])
    nodes = node_group(args)
    assert nodes is not None and (nodes.nnodes, nodes.node_rank, nodes.master_addr) == (2, 0, "127.0.0.1")
    return nodes


def session_ends(sid: int, timeout: float = 5.0) -> bool:
    """Whether every process of the session is gone within `timeout` (a rank notices its parent's death by polling
    once a second)."""
    deadline = time.monotonic() + timeout
    while processes_in_session(sid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run(engine: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Step by hand: every request's tokens and every step's logits; the last request carries an embedding segment."""
    step_logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(plan, *args):
        logits, sampling = execute(plan, *args)
        if logits is not None:
            step_logits.append(logits.clone())
        return logits, sampling

    engine.runner.execute = recording
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    embeds = torch.randn(6, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.02
    segments = [None] * (len(PROMPTS) - 1) + [[EmbeddingSegment.from_embeds(4, embeds)]]
    ids = [engine.add_request(p, params, segments=s) for p, s in zip(PROMPTS, segments, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
    return [tokens[i] for i in ids], step_logits


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_two_trees_serve_as_one_process(checkpoints, monkeypatch, family: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    single = Engine.from_pretrained(checkpoints[family], kv_cache_gib=KV_GIB, **ENGINE)
    want_tokens, want_logits = run(single)
    port = free_port()
    worker = worker_tree(checkpoints[family], port)
    try:
        nodes = leader_group(monkeypatch, port)
        group = Engine.from_pretrained(
            checkpoints[family], kv_cache_gib=KV_GIB / 2, tensor_parallel=2, node_group=nodes, **ENGINE
        )
        try:
            model = group.model
            assert isinstance(model, TensorParallelModel) and isinstance(model.shard, PipelineStage)
            assert len(group.runner.kv_caches) == len(stage_layers(3, 0, 2)) == 2  # the leader's stage: 2 layers
            assert group.pool.usage().total_blocks >= single.pool.usage().total_blocks
            got_tokens, got_logits = run(group)
            assert got_tokens == want_tokens
            assert len(got_logits) == len(want_logits)
            for got, want in zip(got_logits, want_logits, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            group.check_integrity()
            assert group.pool.num_free == group.pool.usage().total_blocks
            if family == "llama":  # the worker tree killed while the leader idles: heartbeats, not a collective
                failures: list[Exception] = []
                group.failure_observers.append(failures.append)
                group.start()
                time.sleep(1.0)  # idle, beating
                assert not failures
                killed = time.monotonic()
                worker.kill_tree()
                while not failures and time.monotonic() - killed < 15:
                    time.sleep(0.05)
                assert failures and isinstance(failures[0], ModelGroupBroken), failures
                assert time.monotonic() - killed < 6.0  # LOST_AFTER_S (3 s) + a poll or two
                assert "node 1 lost" in str(failures[0])
        finally:
            group.shutdown()
        if family != "llama":
            assert worker.proc.wait(60) == 0, worker.text()  # the leader's Stop: a clean end
            assert "stopped by the leader" in worker.text()
        assert session_ends(worker.proc.pid), worker.text()
    finally:
        worker.kill_tree()


def test_serve_leader_and_worker_and_a_lost_worker(checkpoints, tmp_path) -> None:
    """Both trees are `omnivox serve`, the same command line, told apart by LWS_WORKER_INDEX only."""
    checkpoint = make_checkpoint(tmp_path / "long", family="llama", num_hidden_layers=3, max_position_embeddings=4096)
    port = free_port()
    args = ("--kv-cache-gib", "0.01", "--port", "0", "--grace-period", "1")
    worker = worker_tree(checkpoint, port, *args)
    leader = NodeTree(
        2, 0, "--model", str(checkpoint), "--tensor-parallel", "2", "--device", "cpu", "--threads", "1",
        "--master-port", str(port), *args,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while not (address := re.search(r"serving \S+ on (\S+)$", leader.text(), re.M)):
            assert leader.proc.poll() is None and worker.proc.poll() is None, leader.text() + worker.text()
            assert time.monotonic() < deadline, leader.text()
            time.sleep(0.2)
        with grpc.insecure_channel(address[1]) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            sampling = sampling_pb2.SamplingConfig(temperature=0)
            request = user_request("Hello there", max_output_tokens=12, ignore_eos=True, sampling=sampling)
            tokens = [t for r in stub.Generate(request, timeout=120) if r.HasField("delta") for t in r.delta.token_ids]
            engine = Engine.from_pretrained(checkpoint, device="cpu", dtype="float32", kv_cache_gib=0.005)
            prompt = ChatPromptBuilder(engine.tokenizer).build(user_request("Hello there").contents)
            [want] = engine.generate(
                [prompt.token_ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            )
            assert tokens == want.token_ids

            long = user_request("Hello there", max_output_tokens=3000, ignore_eos=True, sampling=sampling)
            stream = stub.Generate(long, timeout=120)
            first = next(stream)  # streaming: the group is mid-request
            assert first.HasField("delta")
            killer = threading.Timer(0.2, worker.kill_tree)
            killer.start()
            killed = time.monotonic() + 0.2
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "tensor-parallel group broken" in err.value.details()
        status = leader.proc.wait(30)
        exited_after = time.monotonic() - killed
        assert status != 0, leader.text()
        assert exited_after < 10, (exited_after, leader.text())
        assert session_ends(leader.proc.pid), leader.text()  # its own rank went with it
    finally:
        leader.kill_tree()
        worker.kill_tree()


def test_a_lost_leader_ends_the_worker_node_non_zero(checkpoints) -> None:
    """The other direction: the leader pod lost (its tree killed) while the group idles; the worker node's control
    receive fails and it exits 1 within seconds, so LeaderWorkerSet sees the group fail (1 rank per node here)."""
    port = free_port()
    flags = ("--device", "cpu", "--threads", "1", "--master-port", str(port), "--kv-cache-gib", "0.005", "--port", "0")
    worker = NodeTree(2, 1, "--model", str(checkpoints["llama"]), *flags)
    leader = NodeTree(2, 0, "--model", str(checkpoints["llama"]), *flags)
    try:
        deadline = time.monotonic() + 300
        while "serving " not in leader.text():
            assert leader.proc.poll() is None and worker.proc.poll() is None, leader.text() + worker.text()
            assert time.monotonic() < deadline, leader.text()
            time.sleep(0.2)
        time.sleep(1.0)  # idle
        killed = time.monotonic()
        leader.kill_tree()
        assert worker.proc.wait(30) == 1, worker.text()
        assert time.monotonic() - killed < 10, worker.text()
        assert session_ends(worker.proc.pid), worker.text()
    finally:
        leader.kill_tree()
        worker.kill_tree()
