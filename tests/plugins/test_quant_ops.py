"""Quantized linear kernels against their PyTorch references, per instruction set, on fresh
random shapes (odd row counts, tails that are not a multiple of the vector width, a padded
last int4 group). The AVX-512 W8A16 / W4A16 kernels quantize the input rows to int16
(relative error 1.5e-5 of a row's largest value), hence float32 tolerances of 5e-4."""
import pytest
import torch

from kiln.plugins import ops, reference
from kiln.quantize.formats import dequantize_int4, pack_int4, quantize_int4, quantize_int8, unpack_int4

SHAPES = [(1, 576, 64), (3, 64, 40), (5, 1536, 96), (8, 200, 33), (13, 96, 7), (1, 32, 1), (2, 2112, 19),
          (6, 160, 50)]


def rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_linear_w8_matches_reference(isa, dtype, rows, k, n):
    g = torch.Generator().manual_seed(hash((isa, str(dtype), rows, k, n)) % 2**31)
    x = rand(g, rows, k).to(dtype)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    bias = rand(g, n).to(dtype)
    got, want = ops.linear_w8(x, q, s, bias), reference.linear_w8(x, q, s, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 5e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows, k, n", [s for s in SHAPES if s[1] % 2 == 0])
def test_linear_w4_matches_reference(isa, dtype, group, rows, k, n):
    g = torch.Generator().manual_seed(hash((isa, str(dtype), group, rows, k, n)) % 2**31)
    x = rand(g, rows, k).to(dtype)
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    got, want = ops.linear_w4(x, packed, scales, group), reference.linear_w4(x, packed, scales, group)
    tol = 5e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for out_dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(ops.dequantize_int4(packed, scales, group, out_dtype),
                                   reference.dequantize_int4(packed, scales, group, out_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES + [(40, 1536, 64), (2, 130, 9)])
def test_linear_w8a8_matches_exact_integer_reference(isa, dtype, rows, k, n):
    g = torch.Generator().manual_seed(hash((isa, str(dtype), rows, k, n)) % 2**31)
    x = rand(g, rows, k, scale=4).to(dtype)
    x[0, : min(k, 3)] = 0  # zeros and a zero row must not divide by zero
    if rows > 2:
        x[2] = 0
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    weight_sum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    got = ops.linear_w8a8(x, q, s, weight_sum)
    want = reference.linear_w8a8(x, q, s)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of outputs up to ~16 apart
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.07)


def test_int4_packing_round_trips():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (7, 64), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 32)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)  # even input in the low nibble


def test_int4_padded_last_group():
    g = torch.Generator().manual_seed(1)
    w = rand(g, 4, 96)  # group 64 -> groups of 64 and 32
    packed, scales = quantize_int4(w, 64)
    assert scales.shape == (4, 2)
    assert torch.allclose(scales[:, 1], w[:, 64:].abs().amax(dim=1) / 7)
    err = (dequantize_int4(packed, scales, 64) - w).abs()
    assert (err <= scales.repeat_interleave(64, dim=1)[:, :96] / 2 + 1e-6).all()  # half a step at most


def test_quant_ops_validate_their_inputs(plugin_isas):
    q, s = quantize_int8(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        ops.linear_w8(torch.randn(2, 15), q, s)
    packed, scales = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.linear_w4(torch.randn(2, 64), packed, scales, 64)
    with pytest.raises(RuntimeError, match="weight_sum"):
        ops.linear_w8a8(torch.randn(2, 16), q, s, torch.zeros(3, dtype=torch.int32))


def test_quant_ops_opcheck(plugin_isas):
    q, s = quantize_int8(torch.randn(8, 64))
    packed, scales = quantize_int4(torch.randn(8, 64), 32)
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.kiln.linear_w8.default, (x, q, s, None))
    torch.library.opcheck(torch.ops.kiln.linear_w4.default, (x, packed, scales, 32, None))
    torch.library.opcheck(torch.ops.kiln.dequantize_int4.default, (packed, scales, 32, torch.bfloat16))
    torch.library.opcheck(torch.ops.kiln.linear_w8a8.default,
                          (x, q, s, q.to(torch.int32).sum(1, dtype=torch.int32), None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows, k, n", [s for s in SHAPES if s[1] % 2 == 0] + [(40, 576, 24)])
def test_linear_w4a8_matches_exact_integer_reference(isa, dtype, group, rows, k, n):
    g = torch.Generator().manual_seed(hash((isa, str(dtype), group, rows, k, n)) % 2**31)
    x = rand(g, rows, k, scale=3).to(dtype)
    x[0, : min(k, 40)] = 0  # an all-zero group must not divide by zero
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    got, want = ops.linear_w4a8(x, packed, scales, group), reference.linear_w4a8(x, packed, scales, group)
    if dtype == torch.float32:  # the same integers; float sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.07)
