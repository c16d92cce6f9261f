"""Quantised linear layers: the 4-bit C kernel equals its portable torch twin; int8 and 4-bit layers stay within a
stated error of float32 `F.linear` on odd shapes, at one row and many."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from support.kernel_support import KERNEL_TARGETS, require_kernels, target_library

from omnivox.models import cpu_kernels, quant

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass

SHAPES = [(1, 32), (7, 40), (33, 100), (96, 64), (130, 576)]  # (out, in): odd sizes, K not a multiple of 32
ROWS = [
    1,
    2,
    3,
    6,
    17,
    quant.LARGE_BATCH + 3,
]  # batch-1 GEMV, 2- and 3-row tiles, 4-row tiles + a remainder, float GEMM


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


LAYERS = {"q8": quant.Int8Linear, "q4": quant.Int4Linear}


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", ROWS[:5])
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_block_kernels_equal_portable_path(target, kind, n, k, m):
    lib = target_library(target)
    torch.manual_seed(n * k + m)
    layer = LAYERS[kind].from_float(torch.randn(n, k), torch.randn(n))
    x = F.pad(torch.randn(m, k), (0, layer.padded_in - k))
    ours = cpu_kernels.block_matmul(kind, x, layer.blocks, n, layer.bias, lib=lib)
    portable = quant.block_matmul_portable(kind, x, layer.blocks, layer.bias)
    # Same integer group dots and scales; only the float summation order differs.
    torch.testing.assert_close(ours, portable, rtol=1e-4, atol=1e-4)


def many_row_library(build: str) -> ctypes.CDLL:
    """A build holding the many-row kernel `build` names: "vnni-native" where this CPU has AVX-512 VNNI;
    "vnni-emulation", the same source against scalar versions of its intrinsics (models/intrinsics_scalar.h), on every
    host; "avx2-TARGET", the AVX2 kernel in each build this host runs."""
    kernel, _, target = build.partition("-")
    if target == "emulation":
        lib = cpu_kernels.vnni_emulation()
        if lib is None:
            require_kernels()  # skips without a compiler
            failure = cpu_kernels.build_failure("emulation")
            pytest.fail(f"a C compiler exists but the emulated VNNI kernel did not build: {failure}")
        return lib
    lib = target_library(target)
    if kernel == "vnni" and not cpu_kernels.vnni_available(lib):
        pytest.skip("this CPU or compiler has no AVX-512 VNNI: the AVX2 kernel serves (tested on its emulation too)")
    if kernel == "avx2" and not lib.avx2_rows_available():
        pytest.skip(f"the {target} build has no AVX2")
    return lib


MANY_ROW_BUILDS = ["vnni-native", "vnni-emulation", *(f"avx2-{t}" for t in KERNEL_TARGETS)]


@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 40), (33, 100), (130, 576)])  # partial and full tiles, odd K
@pytest.mark.parametrize("m", [1, 5, 17, 35])
@pytest.mark.parametrize("act_bits", quant.ACT_BITS)
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("build", MANY_ROW_BUILDS)
def test_many_row_kernel_equals_portable_path(build, kind, act_bits, n, k, m):
    lib = many_row_library(build)
    torch.manual_seed(n * k + m + act_bits)
    layer = LAYERS[kind].from_float(torch.randn(n, k), torch.randn(n))
    x = F.pad(torch.randn(m, k) * 3, (0, layer.padded_in - k))
    ours = cpu_kernels.block_matmul_many(kind, x, layer.blocks, n, layer.bias, act_bits, lib=lib, kernel=build[:4])
    portable = quant.block_matmul_portable(kind, x, layer.blocks, layer.bias, act_bits)
    # The same integer group dots and scales (15 bits: two int8 passes recombined exactly); only the float summation
    # order differs.
    torch.testing.assert_close(ours, portable, rtol=1e-4, atol=1e-4)
    # 15-bit activations stay within the int16 kernels' error of float activations; 8 bits measured 0.5-1.2 %
    ref = F.linear(x[:, :k], layer.dequantize(), layer.bias)
    assert _rel_err(ours, ref) < (3e-4 if act_bits == 15 else 0.03)


def with_minus_128(layer: quant.Int8Linear) -> quant.Int8Linear:
    """The layer with a third of its Q8_0 weights set to -128: our quantiser never writes it (it clamps to +-127, as
    llama.cpp's), but a GGUF's Q8_0 block may hold any int8."""
    blocks = layer.blocks.view(layer.blocks.shape[0], -1, quant.Q8_BLOCK_BYTES)
    blocks[..., 2::3] = 128  # the byte of int8 -128
    return layer


@pytest.mark.parametrize("act_bits", quant.ACT_BITS)
@pytest.mark.parametrize("build", MANY_ROW_BUILDS)
def test_many_row_kernel_takes_q8_weights_of_minus_128(build, act_bits):
    """The AVX2 8-bit path multiplies |w| (unsigned) by x with w's sign (`vpsignb`): |x| against w with x's sign, as
    it was, turned -128 into -128 again where x < 0 (its negation overflows int8): 35 x 64 outputs off."""
    lib = many_row_library(build)
    torch.manual_seed(act_bits)
    layer = with_minus_128(quant.Int8Linear.from_float(torch.randn(64, 96), torch.randn(64)))
    x = F.pad(torch.randn(35, 96) * 3, (0, layer.padded_in - 96))
    ours = cpu_kernels.block_matmul_many("q8", x, layer.blocks, 64, layer.bias, act_bits, lib=lib, kernel=build[:4])
    portable = quant.block_matmul_portable("q8", x, layer.blocks, layer.bias, act_bits)
    torch.testing.assert_close(ours, portable, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_block_kernels_take_q8_weights_of_minus_128(target):
    lib = target_library(target)
    layer = with_minus_128(quant.Int8Linear.from_float(torch.randn(40, 64), None))
    x = F.pad(torch.randn(3, 64), (0, layer.padded_in - 64))
    ours = cpu_kernels.block_matmul("q8", x, layer.blocks, 40, None, lib=lib)
    torch.testing.assert_close(ours, quant.block_matmul_portable("q8", x, layer.blocks, None), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_dequantize_kernels_equal_torch(target, kind):
    lib = target_library(target)
    layer = LAYERS[kind].from_float(torch.randn(37, 96))
    assert torch.equal(cpu_kernels.block_dequantize(kind, layer.blocks, 37, 96, lib=lib), layer.dequantize())


def test_q4_round_trip_is_within_half_a_level():
    w = torch.randn(19, 70) * 3
    blocks = quant.quantize_q4(w)
    d, m, _ = quant.q4_parts(blocks)
    back = quant.dequantize_q4(blocks, 70)
    step = d.repeat_interleave(32, dim=1)[:, :70]
    # half a level, plus fp16 rounding of d and m (1e-3 relative)
    assert ((back - w).abs() <= step * 0.5 + 2e-3 * w.abs().amax()).all()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(
    ("kind", "tolerance"),
    # Measured on these shapes (random normal weights and inputs): int8 weights 0.6 % relative error at most,
    # 4-bit groups 7-9.5 % (16 levels per group of 32), up to 15 % on the 1 x 32 layer (one group, six rows);
    # int16 activations add ~1e-4 at most (checked on its own below).
    [("int8", 0.01), ("int4", 0.2)],
)
def test_quantised_linear_close_to_float(kind, tolerance, n, k, m):
    torch.manual_seed(n + k + m)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    layer = (quant.Int8Linear if kind == "int8" else quant.Int4Linear).from_float(w, b)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (m, n)
    ref = F.linear(x, w, b)
    assert _rel_err(y, ref) < tolerance
    # and against the layer's own dequantised weights, the error left is the activations' int16 quantisation only
    # (measured 3e-5 int8, 8e-5 int4 at most; int8 activations, as llama.cpp uses, measured 0.5-1.2 %)
    assert _rel_err(y, F.linear(x, layer.dequantize(), b)) < 3e-4


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_layer_without_the_kernel_equals_with(monkeypatch, kind):
    require_kernels()
    layer = LAYERS[kind].from_float(torch.randn(50, 72), torch.randn(50))
    x = torch.randn(3, 72)
    with torch.inference_mode():
        fast = layer(x)
        monkeypatch.setattr(cpu_kernels, "kernel_available", lambda: False)
        slow = layer(x)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_quantised_layers_hold_no_float_weights():
    w = torch.randn(256, 512)
    int8, int4 = quant.Int8Linear.from_float(w), quant.Int4Linear.from_float(w)
    for layer in (int8, int4):
        assert not any(t.is_floating_point() for t in layer.state_dict().values())
    assert quant.weight_bytes(int8) == 256 * 512 * 34 // 32  # Q8_0: 34 bytes per 32 weights
    assert quant.weight_bytes(int4) == 256 * 512 * 20 // 32  # Q4_1: 20 bytes per 32 weights


def test_q8_round_trip_is_within_half_a_level():
    w = torch.randn(19, 70) * 3
    blocks = quant.quantize_q8(w)
    d, _ = quant.q8_parts(blocks)
    step = d.repeat_interleave(32, dim=1)[:, :70]
    assert ((quant.dequantize_q8(blocks, 70) - w).abs() <= step * 0.5 + 1e-3 * w.abs().amax()).all()
