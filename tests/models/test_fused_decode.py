"""The one-call CPU decode step (models/fused_decode.py) computes what the per-op torch layers compute: hidden states
and the KV written, for Llama / Qwen2 (qkv bias) / Qwen3 (q/k norms), float32 and quantised layers, one row and
several rows at different lengths; it notices layers replaced after it was built; the torch path serves what it
does not cover."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.kernel_support import kernel_target as kernel_target  # noqa: F401  (fixture)
from support.kernel_support import require_kernels

from omnivox.models import cpu_kernels, fused_decode, quant
from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.loading import load_decoder

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass

BLOCK = 4
PROMPTS = [[5, 17, 33, 9, 44], [100, 4, 250], [3, 8, 9, 10, 11, 12, 13, 14, 15, 16], [7], [61, 62]]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=11)


class Batch:
    """Paged KV for a few requests, each on its own blocks; prefill through the torch path, then decode rows."""

    def __init__(self, model, prompts: list[list[int]], blocks_each: int = 8) -> None:
        cfg = model.config
        n = len(prompts) * blocks_each
        self.kv = [
            (
                torch.zeros(n * BLOCK, cfg.num_kv_heads, cfg.head_dim),
                torch.zeros(n * BLOCK, cfg.num_kv_heads, cfg.head_dim),
            )
            for _ in range(cfg.num_layers)
        ]
        self.tables = torch.arange(n).view(len(prompts), blocks_each)
        self.lens = [len(p) for p in prompts]
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                slots = self._slots(i, range(len(p)))
                meta = AttentionMetadata(
                    BLOCK, slots, 0, None, None, None, [PrefillChunk(0, len(p), len(p), self.tables[i])]
                )
                model(torch.tensor(p), torch.arange(len(p)), self.kv, meta)

    def _slots(self, i: int, positions) -> torch.Tensor:
        return torch.tensor([int(self.tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    def decode_meta(self, rows: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        pos = torch.tensor([self.lens[i] for i in rows])
        slots = torch.cat([self._slots(i, [self.lens[i]]) for i in rows])
        meta = AttentionMetadata(BLOCK, slots, len(rows), self.tables[rows], None, pos + 1, [])
        return pos, meta


def _forward(model, fused: bool, monkeypatch, *args) -> torch.Tensor:
    """model(*args) through the fused path or the torch layers, checking which one ran."""
    calls = []
    real = cpu_kernels.decoder_layers
    monkeypatch.setattr(cpu_kernels, "decoder_layers", lambda *a: calls.append(1) or real(*a))
    if not fused:
        monkeypatch.setattr(fused_decode.FusedDecode, "applies", lambda self, x, meta: False)
    with torch.inference_mode():
        hidden = model(*args)
    monkeypatch.undo()
    assert bool(calls) == fused, "the fused path did not run" if fused else "the fused path ran"
    return hidden


def _step(model, batch: Batch, rows: list[int], tokens: list[int], fused: bool, monkeypatch) -> torch.Tensor:
    pos, meta = batch.decode_meta(rows)
    return _forward(model, fused, monkeypatch, torch.tensor(tokens), pos, batch.kv, meta)


@pytest.mark.parametrize(
    ("mode", "rows", "tolerance"),
    # float32: same arithmetic, other summation order (measured <= 2e-7 relative over the three families). Quantised:
    # an int16 activation now and then rounds the other way when its input differs in the last bit (measured
    # <= 1.5e-5 int8, 5.4e-5 int4).
    [
        ("none", [0], 2e-6),
        ("int8", [0], 5e-4),
        ("int4", [2], 5e-4),
        ("int8", [0, 1, 2], 5e-4),
        ("int4", [4, 0, 3, 1, 2], 5e-4),
    ],
)
def test_fused_step_equals_torch_layers(checkpoint, mode, rows, tolerance, kernel_target, monkeypatch):
    require_kernels()
    model = load_decoder(checkpoint, quantization=mode).eval()
    tokens = [20 + i for i in rows]
    results = []
    for fused in (True, False):
        batch = Batch(model, PROMPTS)
        hidden = _step(model, batch, rows, tokens, fused, monkeypatch)
        written = [
            (k[batch.decode_meta(rows)[1].slot_mapping], v[batch.decode_meta(rows)[1].slot_mapping])
            for k, v in batch.kv
        ]
        results.append((hidden, written))
    (h1, kv1), (h0, kv0) = results
    assert float((h1 - h0).norm() / h0.norm()) < tolerance
    for (k1, v1), (k0, v0) in zip(kv1, kv0, strict=True):
        assert float((k1 - k0).norm() / k0.norm()) < tolerance and float((v1 - v0).norm() / v0.norm()) < tolerance


def test_fused_table_follows_replaced_layers(checkpoint, monkeypatch):
    """Quantising a model in place after a fused float step rebuilds the table (stale pointers would read freed
    float weights); a float model with several rows, and a grad-enabled call, take the torch path."""
    require_kernels()
    model = load_decoder(checkpoint, quantization="none").eval()
    _step(model, Batch(model, PROMPTS), [1], [30], True, monkeypatch)
    _step(model, Batch(model, PROMPTS), [0, 1], [30, 31], False, monkeypatch)  # float32 rows > 1: torch GEMM
    quant.quantize_decoder(model, "int8")
    fused = _step(model, Batch(model, PROMPTS), [1, 2], [30, 31], True, monkeypatch)
    torch_path = _step(model, Batch(model, PROMPTS), [1, 2], [30, 31], False, monkeypatch)
    assert float((fused - torch_path).norm() / torch_path.norm()) < 5e-4
    pos, meta = Batch(model, PROMPTS).decode_meta([0])
    with torch.enable_grad():
        assert not fused_decode.fused_decode_for(model).applies(torch.zeros(1, 64), meta)


@pytest.mark.parametrize("mode", ["int8", "int4"])
# 2 + 9 rows: the many-row kernel (where built) for both block kinds; 2 + 40: past MAX_ROWS, a mixed step the C step
# serves only where a many-row kernel serves every layer (MANY_MAX_ROWS), else the torch path
@pytest.mark.parametrize("chunk", [5, 9, 40])
def test_fused_step_with_a_verify_chunk_equals_torch_layers(checkpoint, mode, chunk, kernel_target, monkeypatch):
    """Decode rows plus a prefill chunk on a cached context (speculative verify rows: 1 + 4 tokens; a short prompt;
    a 40-token chunk beside the decodes), as the runner lays them out: the chunk's rows attend causally through the
    decode kernel, equal to the torch path's SDPA."""
    require_kernels()
    model = load_decoder(checkpoint, quantization=mode).eval()
    many = cpu_kernels.many_row_kernel() is not None
    assert fused_decode.fused_decode_for(model).max_rows == (
        fused_decode.MANY_MAX_ROWS if many else fused_decode.MAX_ROWS
    )
    results = []
    for fused in (True, False) if chunk + 2 <= fused_decode.MAX_ROWS or many else (False,):
        batch = Batch(model, PROMPTS, blocks_each=16)
        _, decode = batch.decode_meta([0, 1])
        start = batch.lens[2]
        chunk_slots = batch._slots(2, range(start, start + chunk))
        table = batch.tables[2][: -(-(start + chunk) // BLOCK)]
        meta = AttentionMetadata(
            BLOCK,
            torch.cat([decode.slot_mapping, chunk_slots]),
            2,
            decode.decode_block_tables,
            None,
            decode.decode_lens,
            [PrefillChunk(2, chunk, start + chunk, table)],
        )
        positions = torch.cat([decode.decode_lens - 1, torch.arange(start, start + chunk)])
        ids = torch.tensor([40, 41, *range(50, 50 + chunk)])
        hidden = _forward(model, fused, monkeypatch, ids, positions, batch.kv, meta)
        results.append((hidden, [k[chunk_slots] for k, _ in batch.kv]))
    if len(results) == 1:  # no many-row kernel on this host: 42 rows took the torch path
        return
    (h1, k1), (h0, k0) = results
    assert float((h1 - h0).norm() / h0.norm()) < 5e-4
    for a, b in zip(k1, k0, strict=True):
        assert float((a - b).norm() / b.norm()) < 5e-4


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gemma"), "gemma", seed=11)


@pytest.mark.parametrize(
    ("mode", "rows", "tolerance", "gate_scale"),
    # gate weights x 1e4: gates in the thousands, where the C step's exp overflows (GELU must give -0 there, not NaN)
    [("none", [0], 2e-6, 1.0), ("int8", [4, 0, 3], 5e-4, 1.0), ("none", [0], 2e-6, 1e4)],
)
def test_fused_step_takes_gemma_gelu_tanh_mlp(gemma_checkpoint, mode, rows, tolerance, gate_scale, monkeypatch):
    """Gemma 1 (Llama's layer with a tanh-GELU gate, (1 + w) norms folded at load, scaled embeddings) decodes through
    the fused step (`_forward` asserts it ran), equal to the torch layers' F.gelu(approximate="tanh")."""
    require_kernels()
    model = load_decoder(gemma_checkpoint, quantization=mode).eval()
    assert model.layers[0].mlp.act == "gelu_tanh"
    if gate_scale != 1.0:
        with torch.no_grad():
            for layer in model.layers:
                layer.mlp.gate_up_proj.weight[: layer.mlp.inter].mul_(gate_scale)
    tokens = [20 + i for i in rows]
    fused, torch_path = (_step(model, Batch(model, PROMPTS), rows, tokens, f, monkeypatch) for f in (True, False))
    assert float((fused - torch_path).norm() / torch_path.norm()) < tolerance
