"""What test_generate_edges.py and test_tool_schemas.py (and the engine edges) share: a tiny random Llama behind a real
gRPC server (ChatML template without tools, so tools go into the text as Qwen2.5 writes them), and two calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2
from support.checkpoints import make_checkpoint
from support.grpc_errors import violation_descriptions
from support.service_harness import ServerThread


@contextmanager
def tiny_server(folder: Path) -> Iterator[ServerThread]:
    """The server; its checkpoint folder is `server.checkpoint`. 2048 positions: a tool prompt is ~900 tokens."""
    ckpt = make_checkpoint(folder / "tiny", family="llama", max_position_embeddings=2048)
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.02, max_num_seqs=64)) as srv:
        srv.checkpoint = ckpt
        yield srv


def run(stub, request: generation_pb2.GenerateRequest) -> tuple[str, list, generation_pb2.GenerateSummary]:
    """(text, deltas, summary) of one Generate call."""
    text, deltas, summary = "", [], None
    for response in stub.Generate(request, timeout=60):
        if response.WhichOneof("response") == "delta":
            text += response.delta.text
            deltas.append(response.delta)
        else:
            summary = response.summary
    assert summary is not None
    return text, deltas, summary


def invalid_argument(stub, request: generation_pb2.GenerateRequest) -> dict[str, str]:
    """Send a request the server must refuse; return the INVALID_ARGUMENT's field -> description."""
    with pytest.raises(grpc.RpcError) as info:
        run(stub, request)
    return violation_descriptions(info.value)
