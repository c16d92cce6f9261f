"""Tensor parallelism (models/tensor_parallel.py): 2 processes over gloo on CPU give the logits of one process
within 1e-5 and the same 32 greedy tokens, on tiny random Llama (untied, and tied with an odd vocabulary), Qwen2
(q/k/v biases) and Qwen3 (q/k norms) — two requests batched, one of them cancelled mid-way. Each rank's KV cache
holds half the KV heads. `load_shard` (each tensor sliced as it is read) gives the same shard as `shard_decoder`.

The model is driven directly (prefill chunks over the paged cache, one token per request per step); the engine over
tensor-parallel ranks is tested in tests/engine/test_tensor_parallel_engine.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.checkpoints import make_checkpoint

from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.config import ModelConfig
from omnivox.models.loading import load_decoder
from omnivox.models.tensor_parallel import check_divisible, load_shard, local_kv_heads, shard_decoder
from omnivox.models.tensor_parallel_worker import dumps, receive, send

# Name -> (family, config overrides). "llama-tied": tied embeddings and an odd vocabulary (the last shard is padded).
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "vocab_size": 383}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),  # o_proj and down_proj biases added once
    # every expert's intermediate dimension sharded (w1 / w3 rows, w2 columns), one all-reduce of the experts' sum
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2_moe", {"decoder_sparse_step": 2}),  # a dense layer 0, the shared expert row-parallel too
}
WORLD = 2
BLOCK = 16
NEW_TOKENS = 32
CANCEL_AFTER = 10  # request 1 leaves the batch after this many tokens
PROMPTS = [[1, 17, 42, 99, 7, 250, 3], [1, 300, 5, 6, 8, 13, 21, 34, 55, 89, 144]]


def greedy(model, kv_heads: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of every prompt and each step's logits [batch, vocab] (batched; request 1 cancelled)."""
    cfg: ModelConfig = model.config
    blocks_per_req = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // BLOCK)
    num_blocks = blocks_per_req * len(PROMPTS)
    kv = [
        tuple(torch.zeros(num_blocks * BLOCK, kv_heads, cfg.head_dim) for _ in range(2)) for _ in range(cfg.num_layers)
    ]
    tables = [torch.arange(i * blocks_per_req, (i + 1) * blocks_per_req) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    pending = [list(p) for p in PROMPTS]  # tokens not yet in the cache, per request
    active = list(range(len(PROMPTS)))
    step_logits = []
    while active:
        ids, positions, slots, chunks, last_rows = [], [], [], [], []
        for r in active:
            done = len(tokens[r]) - len(pending[r])
            pos = list(range(done, len(tokens[r])))
            chunks.append(PrefillChunk(len(ids), len(pos), len(tokens[r]), tables[r][: -(-len(tokens[r]) // BLOCK)]))
            ids += pending[r]
            positions += pos
            slots += [int(tables[r][p // BLOCK]) * BLOCK + p % BLOCK for p in pos]
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata(BLOCK, torch.tensor(slots), 0, None, None, None, chunks)
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv, meta)
        logits = model.compute_logits(hidden[last_rows])  # [len(active), vocab]
        step_logits.append(logits)
        for r, row in zip(active, logits, strict=True):
            nxt = int(row.argmax())
            tokens[r].append(nxt)
            pending[r] = [nxt]
        active = [r for r in active if len(tokens[r]) - len(PROMPTS[r]) < (CANCEL_AFTER if r == 1 else NEW_TOKENS)]
    return [t[len(p) :] for t, p in zip(tokens, PROMPTS, strict=True)], step_logits


def _worker(rank: int, root: str, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        # The engine's control channel (models/tensor_parallel_worker.py): a message within the inline buffer, and
        # one past it (400 KB: a second broadcast), arrive whole; tensors travel as their bytes, whatever their
        # dtype, shape or strides.
        odd = {
            "ids": torch.arange(5),
            "bf16": torch.linspace(-3, 3, 12).to(torch.bfloat16).view(3, 4),
            "mask": torch.tensor([[True, False, True]]),
            "transposed": torch.arange(12).view(3, 4).t(),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 7, dtype=torch.int32),
        }
        for message in (odd, {"embeds": torch.arange(100_000, dtype=torch.float32)}):
            if rank == 0:
                send(message, None)
            else:
                got = receive(None)
                assert got.keys() == message.keys()
                for k, want in message.items():
                    assert got[k].dtype == want.dtype and got[k].shape == want.shape and torch.equal(got[k], want), k
                got[next(iter(got))].add_(0)  # a writable tensor, as the worker's own would be
        for family in MODELS:
            with torch.no_grad():
                model = shard_decoder(load_decoder(Path(root) / family))
                assert model.layers[0].self_attn.qkv_proj.weight.shape[0] * WORLD == (
                    (model.config.num_heads + 2 * model.config.num_kv_heads) * model.config.head_dim
                )
                out = greedy(model, local_kv_heads(model.config, WORLD))
                # Loading only this rank's slice gives the same shard, tensor for tensor.
                sliced = load_shard(Path(root) / family, rank, WORLD, torch.device("cpu"), torch.float32)
                want = model.state_dict()
                assert sliced.state_dict().keys() == want.keys()
                for name, value in sliced.state_dict().items():
                    assert torch.equal(value, want[name]), (family, name)
            if rank == 0:
                torch.save(out, Path(root) / f"{family}-tp.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    for name, (family, overrides) in MODELS.items():
        make_checkpoint(out / name, family=family, with_tokenizer=False, **overrides)
    return out


def test_two_ranks_match_one(root: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    mp.spawn(_worker, args=(str(root), str(root / "init")), nprocs=WORLD, join=True)
    for family in MODELS:
        with torch.no_grad():
            model = load_decoder(root / family)
            want_tokens, want_logits = greedy(model, model.config.num_kv_heads)
        got_tokens, got_logits = torch.load(root / f"{family}-tp.pt")
        assert got_tokens == want_tokens, family
        assert [len(t) for t in got_tokens] == [NEW_TOKENS, CANCEL_AFTER]
        assert len(got_logits) == len(want_logits) == NEW_TOKENS
        for got, want in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=family)


def test_heads_must_divide() -> None:
    cfg = ModelConfig.from_hf(
        __import__("transformers").LlamaConfig(
            hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3
        )
    )
    check_divisible(cfg, 3)
    with pytest.raises(ValueError, match="--tensor-parallel 2 does not divide the model's KV heads"):
        check_divisible(cfg, 2)


def test_control_messages_carry_tensors_as_their_bytes() -> None:
    """A control message's tensors are pickled as raw bytes, not through torch's storage pickling (torch.save per
    tensor: ~40 us each way, a decode step's message ~0.5 ms to pickle and as much to load)."""
    data = dumps({"ids": torch.arange(5), "tables": torch.zeros(64, 10, dtype=torch.int64)})
    assert b"_tensor_from_bytes" in data and b"_load_from_bytes" not in data and b"_rebuild_tensor" not in data
    assert len(data) < 8 * (5 + 640) + 400  # the bytes themselves plus a few names
