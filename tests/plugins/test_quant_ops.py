"""Quantized linear kernels against their PyTorch references, per instruction set, on fresh
random shapes (odd row counts, tails that are not a multiple of the vector width, a padded
last int4 group). The AVX-512 W8A16 / W4A16 kernels quantize the input rows to 15 or 16 bits, so
they are held to the bound that quantization allows (assert_within_input_quantization); the
integer W8A8 / W4A8 kernels to exact integer references."""
import os

import pytest
import torch

from kiln.plugins import ops, reference
from kiln.plugins.formats import dequantize_int4, pack_int4, unpack_int4
from kiln.quantize.formats import quantize_fp8, quantize_int4, quantize_int8
from tests.helpers import generator

SHAPES = [(1, 576, 64), (3, 64, 40), (5, 1536, 96), (8, 200, 33), (13, 96, 7), (1, 32, 1), (2, 2112, 19),
          (6, 160, 50)]


def rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def assert_within_input_quantization(got, want, x, w):
    """got (a kernel that quantizes its input rows to at least 15 bits: absmax / 16383) against
    want (the float reference) for weights w [n, k]: each input is off by at most half a step, so
    an output by at most half a step times the row's sum |w|; plus float32 summation order and,
    for bf16 outputs, both sides' final rounding. A bound, not a fitted tolerance: a fixed atol
    either fails at random on long rows or hides real errors on short ones."""
    xf, w = x.float(), w.float()
    half_step = xf.abs().amax(dim=1, keepdim=True) / 16383 / 2  # [rows, 1]
    bound = half_step * w.abs().sum(dim=1)[None, :]  # [rows, n]
    bound += 1e-5 * (xf.abs() @ w.abs().T) + 1e-6  # float32 sums in another order
    if got.dtype == torch.bfloat16:
        bound += 2**-7 * want.float().abs()  # got and want each rounded to bf16
    err = (got.float() - want.float()).abs()
    assert (err <= bound).all(), f"error {float((err - bound).max()):.3g} over the bound at {int((err - bound).argmax())}"


LONG_ROWS = [(1, 2280, 24), (4, 4096, 9), (3, 2049, 5)]  # VNNI: rows of >= 2048 take the int8-plane path
# AVX2: 15 rows on, the lanes (15 padded to a chunk); up to 12 rows past the last whole 16 (17, 28, 33) in the
# row kernel, 13 or more (29) padded to a lane chunk of their own (kernels/lanes.h, lane_rows)
W8_LANE_SHAPES = [(16, 576, 21), (33, 1100, 35), (64, 37, 7), (17, 1536, 64), (28, 576, 19), (29, 200, 9),
                  (15, 576, 21)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES + LONG_ROWS + W8_LANE_SHAPES)
def test_linear_w8_matches_reference(isa, dtype, rows, k, n):
    g = generator(isa, str(dtype), rows, k, n)
    x = rand(g, rows, k).to(dtype)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    bias = rand(g, n).to(dtype)
    got, want = ops.linear_w8(x, q, s, bias), reference.linear_w8(x, q, s, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_input_quantization(got, want, x, q.float() * s[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32: no output rounding to hide a sum's last bits
@pytest.mark.parametrize("rows, k, n", [(3, 576, 21), (2, 1100, 16), (4, 37, 7), (7, 1536, 35)] + W8_LANE_SHAPES)
def test_linear_w8_rows_are_the_bits_of_each_row_alone(isa, dtype, rows, k, n):
    """W8A16 rows together give each row the bits it gets alone: each weight row against up to
    four input rows (its own chain count per row count), or on AVX2 from 16 rows each row in a
    vector lane, sums exact integers, reduced to float alike whatever the rows (k past 1,024
    flushes the sums to float midway)."""
    g = generator(isa, str(dtype), rows, k, n, "w8 alone")
    x = rand(g, rows, k, scale=4).to(dtype)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    bias = rand(g, n).to(dtype)
    together = ops.linear_w8(x, q, s, bias)
    alone = torch.cat([ops.linear_w8(x[i:i + 1], q, s, bias) for i in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 96, 128])
@pytest.mark.parametrize("rows, k, n", [s for s in SHAPES if s[1] % 2 == 0])
def test_linear_w4_matches_reference(isa, dtype, group, rows, k, n):
    g = generator(isa, str(dtype), group, rows, k, n)
    x = rand(g, rows, k).to(dtype)
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    got, want = ops.linear_w4(x, packed, scales, group), reference.linear_w4(x, packed, scales, group)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_input_quantization(got, want, x, dequantize_int4(packed, scales, group))
    for out_dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(ops.dequantize_int4(packed, scales, group, out_dtype),
                                   reference.dequantize_int4(packed, scales, group, out_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# AVX2: the lanes from 10 rows (13 padded to a chunk); 40 and 17 rows leave 8 and 1 to the row kernel, 25 pads
# its last 9 to a chunk of their own
@pytest.mark.parametrize("rows, k, n", SHAPES + [(40, 1536, 64), (2, 130, 9), (17, 37, 7), (16, 2049, 21),
                                                 (25, 576, 30)])
def test_linear_w8a8_matches_exact_integer_reference(isa, dtype, rows, k, n):
    g = generator(isa, str(dtype), rows, k, n)
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


@pytest.mark.parametrize("rows, k, n", [(7, 576, 12), (2, 130, 9), (9, 100, 64), (33, 576, 96), (16, 37, 7),
                                        (64, 1100, 35), (12, 576, 40), (25, 200, 17)])
def test_linear_w8a8_rows_are_the_bits_of_each_row_alone(isa, rows, k, n):
    """Several rows (two at a time against four weight rows, odd rows and a partial tile of
    weight rows on their own; more than 8 through oneDNN's int8 GEMM on the VNNI levels, 10 or
    more in the vector lanes on plain AVX2, up to 8 past whole chunks of 16 on their own) give
    each row the bits it gets alone: the dot products are exact integers, then the same float
    rescale."""
    g = generator(isa, rows, k, n, "alone")
    x = rand(g, rows, k, scale=4).to(torch.bfloat16)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    weight_sum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    bias = rand(g, n).to(torch.bfloat16)
    together = ops.linear_w8a8(x, q, s, weight_sum, bias)
    alone = torch.cat([ops.linear_w8a8(x[i:i + 1], q, s, weight_sum, bias) for i in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES[:5])
def test_linear_w8a8_with_a_static_input_scale(isa, dtype, rows, k, n):
    g = generator(isa, str(dtype), rows, k, n, "static")
    x = rand(g, rows, k, scale=4).to(dtype)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    weight_sum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    input_scale = float(x.float().abs().max()) / 127 * 0.6  # some activations saturate
    got = ops.linear_w8a8(x, q, s, weight_sum, None, input_scale)
    want = reference.linear_w8a8(x, q, s, input_scale=input_scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.07)


# rows of 15 and more take AVX2's lanes kernel (rows in the vector lanes, 16 a pass; 15 padded): 33 and 28
# leave 1 and 12 rows to the row kernel, 29 pads its last 13 to a pass of their own (kernels/lanes.h, lane_rows)
TILED_SHAPES = [(1, 576, 64), (3, 64, 48), (5, 1536, 96), (8, 200, 112), (2, 2112, 16), (4, 96, 320), (1, 40, 80),
                (16, 200, 112), (33, 576, 80), (64, 1536, 48), (28, 200, 80), (29, 576, 48), (15, 200, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 32, 64, 96, 128, 192])  # any multiple of 8; 96 and 192 not powers of two
@pytest.mark.parametrize("rows, k, n", TILED_SHAPES)
def test_linear_w4_tiled_matches_reference(isa, dtype, group, rows, k, n):
    """The tiled layout: packing equals the reshape-built reference; the GEMV and the
    dequantization on it equal those of the stored layout. Out features of 80, 112 and 320
    leave a last tile group narrower than four tiles; 200 / 40 inputs a padded last group."""
    g = generator(isa, str(dtype), group, rows, k, n, "tiled")
    x = rand(g, rows, k).to(dtype)
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    bias = rand(g, n).to(dtype)
    assert ops.int4_tiles_fit(n, k, group)
    tiled, tiled_scales = ops.pack_int4_tiled(packed, scales, group)
    want_tiled, want_scales = reference.pack_int4_tiled(packed, scales, group)
    assert torch.equal(tiled, want_tiled) and torch.equal(tiled_scales, want_scales)
    got = ops.linear_w4_tiled(x, tiled, tiled_scales, group, bias)
    want = reference.linear_w4(x, packed, scales, group, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_input_quantization(got, want, x, dequantize_int4(packed, scales, group))
    for out_dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(ops.dequantize_int4_tiled(tiled, tiled_scales, group, out_dtype),
                                   reference.dequantize_int4(packed, scales, group, out_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("w4a8", [False, True])
@pytest.mark.parametrize("rows", [1, 16])  # 16: AVX2's lanes (W4A8's int16 sums of 8 steps at their largest)
def test_tiled_int4_sums_of_one_long_group_do_not_overflow(isa, w4a8, rows):
    """The longest group the tiled layout holds (8,192 inputs) at the largest values: every nibble
    15 against the largest input bytes (int32 sums near 2^31)."""
    k, n = 8192, 16
    x = torch.ones(rows, k)
    packed, scales = quantize_int4(torch.full((n, k), 0.05), k)
    assert int(unpack_int4(packed).max()) == 7  # stored as nibble 15
    op = ops.linear_w4a8_tiled if w4a8 else ops.linear_w4_tiled
    got = op(x, *ops.pack_int4_tiled(packed, scales, k), k, None)
    want = (reference.linear_w4a8 if w4a8 else reference.linear_w4)(x, packed, scales, k, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_linear_w4_tiled_refuses_shapes_it_cannot_hold(plugin_isas):
    packed, scales = quantize_int4(torch.randn(24, 64), 32)  # 24 rows: not whole tiles of 16
    assert not ops.int4_tiles_fit(24, 64, 32)
    with pytest.raises(RuntimeError, match="tiled int4 layout needs"):
        ops.pack_int4_tiled(packed, scales, 32)
    packed, scales = quantize_int4(torch.randn(16, 64), 12)
    assert not ops.int4_tiles_fit(16, 64, 12)
    with pytest.raises(RuntimeError, match="tiled int4 layout needs"):
        ops.linear_w4_tiled(torch.randn(1, 64), packed, scales, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", [(1, 576, 64), (3, 64, 48), (5, 1536, 96), (8, 200, 112), (2, 2112, 16),
                                        (4, 96, 320), (1, 36, 80), (2, 4100, 32)])
def test_linear_w8_tiled_matches_reference(isa, dtype, rows, k, n):
    """The tiled int8 layout: packing equals the reshape-built reference; the GEMV and the
    dequantization on it equal the stored layout's references. 80 / 112 / 320 outputs leave a
    narrower last tile group; 4,100 inputs cross the int32 flush (4,096)."""
    g = generator(isa, str(dtype), rows, k, n, "tiled8")
    x = rand(g, rows, k).to(dtype)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    bias = rand(g, n).to(dtype)
    assert ops.int8_tiles_fit(n, k)
    tiled = ops.pack_int8_tiled(q)
    assert torch.equal(tiled, reference.pack_int8_tiled(q))
    got, want = ops.linear_w8_tiled(x, tiled, s, bias), reference.linear_w8(x, q, s, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_input_quantization(got, want, x, q.float() * s[:, None])
    for out_dtype in (torch.float32, torch.bfloat16):  # one rounding, to the output dtype
        torch.testing.assert_close(ops.dequantize_int8_tiled(tiled, s, out_dtype), (q.float() * s[:, None]).to(out_dtype),
                                   rtol=0, atol=0)


def test_linear_w8_tiled_refuses_shapes_it_cannot_hold(plugin_isas):
    q, s = quantize_int8(torch.randn(24, 64))
    assert not ops.int8_tiles_fit(24, 64) and not ops.int8_tiles_fit(16, 66)
    with pytest.raises(RuntimeError, match="tiled int8 layout needs"):
        ops.pack_int8_tiled(q)


# the batch-invariance row counts, tile groups of four and fewer (48, 80, 112 outputs), inputs not a multiple
# of 64 (200, 100: the VNNI GEMV at every row count on AMX) and long rows (4,160)
W8A8_TILED_SHAPES = [(1, 576, 64), (2, 200, 48), (7, 576, 80), (8, 100, 112), (9, 1536, 64), (16, 576, 64),
                     (33, 200, 80), (64, 1536, 48), (17, 4160, 32), (40, 576, 112), (16, 100, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32: no output rounding to hide a last bit
@pytest.mark.parametrize("rows, k, n", W8A8_TILED_SHAPES)
def test_linear_w8a8_tiled_gives_the_bits_of_linear_w8a8(isa, dtype, rows, k, n):
    """W8A8 on the tiled int8 layout (AMX tiles from 16 rows, the VNNI GEMV below, plain loops on
    levels without AMX) gives linear_w8a8's outputs on the [out, in] weights bit for bit, with
    the per-row dynamic scale and a static one, bias or none, a zero row and an all-saturating one."""
    g = generator(isa, str(dtype), rows, k, n, "w8a8 tiled")
    x = rand(g, rows, k, scale=4).to(dtype)
    x[rows // 2] = 0
    if rows > 2:
        x[1] *= 100  # saturates at the static scale
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    weight_sum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    bias = rand(g, n).to(dtype)
    assert ops.w8a8_tiles_fit(n, k)
    tiled = ops.pack_int8_tiled(q)
    assert torch.equal(reference.unpack_int8_tiled(tiled), q)
    input_scale = float(x.float().abs().max()) / 127 * 0.05
    for b in (None, bias):
        for static in (0.0, input_scale):
            got = ops.linear_w8a8_tiled(x, tiled, s, b, static)
            want = ops.linear_w8a8(x, q, s, weight_sum, b, static)
            assert got.dtype == dtype and got.shape == (rows, n)
            differ = (got != want).any(dim=1).nonzero().flatten().tolist()
            assert not differ, f"bias {b is not None}, static scale {static}: rows {differ} of {rows} differ"
    exact = reference.linear_w8a8(x, q, s, None, bias)
    close = dict(rtol=1e-2, atol=0.07) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear_w8a8_tiled(x, tiled, s, bias).float(), exact.float(), **close)


def test_linear_w8a8_tiled_refuses_what_it_cannot_sum(plugin_isas):
    q, s = quantize_int8(torch.randn(16, 64))
    tiled = ops.pack_int8_tiled(q)
    with pytest.raises(RuntimeError, match="input_scale must be 0"):
        ops.linear_w8a8_tiled(torch.randn(2, 64), tiled, s, None, -1.0)
    with pytest.raises(RuntimeError, match="qweight must be a contiguous 2-d Byte"):
        ops.linear_w8a8_tiled(torch.randn(2, 64), q, s)
    limit = ops.library_info()["w8a8_tiled_max_in"]
    assert ops.w8a8_tiles_fit(16, limit) and not ops.w8a8_tiles_fit(16, limit + 4)
    wide = torch.zeros(16, limit + 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="at most 65536 inputs"):
        ops.linear_w8a8_tiled(torch.randn(1, limit + 4), wide, torch.ones(16))


def test_to_hugepages_copies_exactly(plugin_isas):
    for t in (torch.randn(300, 7000), torch.randint(-128, 127, (5, 3), dtype=torch.int8),
              torch.randn(64, 32).bfloat16().T, torch.empty(0, 4)):  # a large, a small, a transposed, an empty
        copy = ops.to_hugepages(t)
        assert copy.is_contiguous() and copy.dtype == t.dtype and copy.shape == t.shape
        assert torch.equal(copy, t) and (t.numel() == 0 or copy.data_ptr() != t.data_ptr())
        assert copy.data_ptr() % (2 << 20) == 0  # aligned to a 2 MB page


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
    with pytest.raises(RuntimeError, match="Float8_e4m3fn"):
        ops.linear_fp8(torch.randn(2, 16), q, s)
    with pytest.raises(RuntimeError, match="inv_scale"):
        ops.quantize_fp8(torch.randn(2, 16), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 32, 64, 96, 128, 192])  # any multiple of 8; 96 and 192 not powers of two
@pytest.mark.parametrize("rows, k, n", TILED_SHAPES + [(40, 576, 48)])
def test_linear_w4a8_tiled_matches_exact_integer_reference(isa, dtype, group, rows, k, n):
    g = generator(isa, str(dtype), group, rows, k, n, "w4a8 tiled")
    x = rand(g, rows, k, scale=3).to(dtype)
    x[0, : min(k, 40)] = 0  # an all-zero group must not divide by zero
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    bias = rand(g, n).to(dtype)
    got = ops.linear_w4a8_tiled(x, *ops.pack_int4_tiled(packed, scales, group), group, bias)
    want = reference.linear_w4a8(x, packed, scales, group, bias)
    if dtype == torch.float32:  # the same integers; float sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.07)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 96, 128])
@pytest.mark.parametrize("rows, k, n", [s for s in SHAPES if s[1] % 2 == 0] + [(40, 576, 24)])
def test_linear_w4a8_matches_exact_integer_reference(isa, dtype, group, rows, k, n):
    g = generator(isa, str(dtype), group, rows, k, n)
    x = rand(g, rows, k, scale=3).to(dtype)
    x[0, : min(k, 40)] = 0  # an all-zero group must not divide by zero
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    got, want = ops.linear_w4a8(x, packed, scales, group), reference.linear_w4a8(x, packed, scales, group)
    if dtype == torch.float32:  # the same integers; float sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0.07)


def fp8_probe_values(g, count):
    """Random magnitudes over E4M3's whole range plus its edge cases: ties between neighbours,
    subnormals, zero, saturation."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway: ties to even
    wide = torch.exp2(torch.rand(count, generator=g) * 24 - 14) * torch.sign(torch.randn(count, generator=g))
    return torch.cat([wide, grid, ties, -ties, torch.tensor([0.0, 447.9, 448.0, 460.0, 1e6, -1e6, 2.0**-10])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_matches_torch_float8(isa, dtype):
    g = generator(isa, str(dtype), "fp8")
    x = fp8_probe_values(g, 20000).to(dtype)
    for inv_scale in (1.0, 0.37, 1 / 3e-3):
        got, want = ops.quantize_fp8(x, inv_scale), reference.quantize_fp8(x, inv_scale)
        assert got.dtype == dtype
        assert torch.equal(got, want), (x[got != want][:5], got[got != want][:5], want[got != want][:5])
    assert torch.equal(ops.quantize_fp8(x.reshape(2, -1)[:, ::2], 1.0), reference.quantize_fp8(x.reshape(2, -1)[:, ::2], 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_linear_fp8_matches_reference(isa, dtype, rows, k, n, per_tensor):
    g = generator(isa, str(dtype), rows, k, n, per_tensor)
    x = rand(g, rows, k).to(dtype)
    w = rand(g, n, k, scale=0.05)
    w[0, : min(k, 5)] = 1e-6  # subnormal E4M3 weights
    q, s = quantize_fp8(w, per_tensor)
    bias = rand(g, n).to(dtype)
    got, want = ops.linear_fp8(x, q, s, bias), reference.linear_fp8(x, q, s, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_is_exact(isa, dtype):
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # all E4M3 values but NaN
    g = generator(isa, str(dtype), "deq8")
    q = every[torch.randint(0, every.numel(), (37, 70), generator=g)].view(torch.float8_e4m3fn)
    assert torch.equal(ops.dequantize_fp8(q, dtype), q.to(dtype))
    assert torch.equal(ops.dequantize_fp8(every.view(torch.float8_e4m3fn), dtype), every.view(torch.float8_e4m3fn).to(dtype))


def test_fp8_weights_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(2)
    w = rand(g, 16, 96)
    for per_tensor in (False, True):
        q, s = quantize_fp8(w, per_tensor)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (16,)
        back = q.float() * s[:, None]
        assert ((back - w).abs() <= w.abs() / 16 + s[:, None] * 2.0**-10).all()  # 3 mantissa bits
        assert torch.allclose(back.abs().amax(dim=1 if not per_tensor else None),
                              w.abs().amax(dim=1 if not per_tensor else None))


def on_levels(levels, run):
    """{level: run()} with each kernel level selected in turn (then KILN_ISA's, or auto, again)."""
    out = {}
    try:
        for level in levels:
            ops.select_isa(level)
            out[level] = run()
    finally:
        ops.select_isa(os.environ.get("KILN_ISA", "auto"))
    return out


@pytest.mark.parametrize("kernel", ["linear_w4_tiled", "linear_w4a8_tiled", "linear_w8", "linear_w8a8"])
@pytest.mark.parametrize("rows, k, n", [(1, 576, 64), (3, 1536, 48), (2, 200, 112), (5, 2112, 16)])
def test_avx_vnni_sums_the_same_integers_as_avx2(plugin_isas, kernel, rows, k, n):
    """AVX-VNNI's vpdpbusd replaces AVX2's vpmaddubsw + vpmaddwd + add on the same
    integers, so every integer kernel gives the same bits on both levels."""
    if "avx2vnni" not in plugin_isas:
        pytest.skip("this CPU lacks AVX-VNNI (avx2vnni)")
    g = generator("vnni", kernel, rows, k, n)
    x = rand(g, rows, k, scale=3).to(torch.bfloat16)
    w = rand(g, n, k, scale=0.05)
    if kernel in ("linear_w4_tiled", "linear_w4a8_tiled"):
        packed, scales = quantize_int4(w, 32)
        args = (x, *ops.pack_int4_tiled(packed, scales, 32), 32, None)
    else:
        q, s = quantize_int8(w)
        args = (x, q, s, None) if kernel == "linear_w8" else (x, q, s, q.to(torch.int32).sum(dim=1, dtype=torch.int32))
    out = on_levels(("avx2", "avx2vnni"), lambda: getattr(ops, kernel)(*args))
    assert torch.equal(out["avx2"], out["avx2vnni"]), f"{kernel} differs: {(out['avx2'] - out['avx2vnni']).abs().max()}"


@pytest.mark.parametrize("kernel", ["linear_w4_tiled", "linear_w4a8_tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n, group", [(16, 576, 64, 64), (17, 1536, 48, 64), (64, 576, 80, 128),
                                               (33, 576, 16, 192), (100, 128, 112, 64), (20, 64, 32, 64),
                                               (16, 256, 32, 64)])
def test_amx_int4_gives_the_bits_of_avx512_vnni(plugin_isas, kernel, dtype, rows, k, n, group):
    """int4 (W4A16, W4A8) on AMX tiles (tdpbssd, from 16 rows) sums the row kernel's integers and
    turns them to float in its order, so avx512amx and avx512bf16 give the same bits: whole and
    padded chunks of 16 rows, a last group shorter than the others (576 by 128), groups of three
    tiles (192), one to 24 groups (fewer than, as many as and more than W4A8's four in flight), a
    zero row, bias; and both match the reference."""
    if "avx512amx" not in plugin_isas:
        pytest.skip("this CPU lacks AMX (avx512amx), or the kernel does not grant it")
    g = generator("amx int4", kernel, str(dtype), rows, k, n, group)
    x = rand(g, rows, k, scale=3).to(dtype)
    x[rows // 3] = 0
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), group)
    bias = rand(g, n).to(dtype)
    args = (x, *ops.pack_int4_tiled(packed, scales, group), group, bias)
    out = on_levels(("avx512bf16", "avx512amx"), lambda: getattr(ops, kernel)(*args))
    differ = (out["avx512bf16"] != out["avx512amx"]).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"{kernel}: rows {differ} of {rows} differ between avx512bf16 and avx512amx"
    if kernel == "linear_w4_tiled":  # 15-bit inputs
        assert_within_input_quantization(out["avx512amx"], reference.linear_w4(x, packed, scales, group, bias), x,
                                         dequantize_int4(packed, scales, group))
    else:
        close = dict(rtol=1e-2, atol=0.07) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["avx512amx"].float(),
                                   reference.linear_w4a8(x, packed, scales, group, bias).float(), **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", [(16, 576, 64), (17, 1536, 48), (64, 576, 80), (40, 4160, 32), (100, 128, 112)])
def test_amx_int8_tiled_gives_the_bits_of_avx512_vnni(plugin_isas, dtype, rows, k, n):
    """W8A16 on AMX tiles (tdpbsud on the tiled layout's vectors as they lie, from 16 rows) sums
    the row kernel's integers per flush chunk (4,160 inputs: two chunks) and turns them to float in
    its order, so avx512amx and avx512bf16 give the same bits; whole and padded chunks of 16 rows,
    a zero row, bias; and both are within the inputs' 15-bit quantization of the reference."""
    if "avx512amx" not in plugin_isas:
        pytest.skip("this CPU lacks AMX (avx512amx), or the kernel does not grant it")
    g = generator("amx int8 tiled", str(dtype), rows, k, n)
    x = rand(g, rows, k, scale=3).to(dtype)
    x[rows // 3] = 0
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    bias = rand(g, n).to(dtype)
    tiled = ops.pack_int8_tiled(q)
    out = on_levels(("avx512bf16", "avx512amx"), lambda: ops.linear_w8_tiled(x, tiled, s, bias))
    differ = (out["avx512bf16"] != out["avx512amx"]).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ} of {rows} differ between avx512bf16 and avx512amx"
    assert_within_input_quantization(out["avx512amx"], reference.linear_w8(x, q, s, bias), x,
                                     q.float() * s[:, None])


def test_set_prefetch_returns_the_previous_distance_and_refuses_bad_ones(plugin_isas):
    before = ops.set_prefetch(0)
    try:
        assert ops.set_prefetch(2048) == 0
        assert ops.set_prefetch(before) == 2048
        for bad in (-1, 1 << 21):
            with pytest.raises(RuntimeError, match="set_prefetch: bytes must be in"):
                ops.set_prefetch(bad)
        assert ops.set_prefetch(before) == before  # a refused value leaves the distance alone
    finally:
        ops.set_prefetch(before)


def decode_kernels(isa, tag, rows, k, n):
    """Every decode GEMV kind, and SwiGLU, on one fresh input and weight: {name: a call that runs it}."""
    g = generator(isa, tag, rows, k, n)
    x = rand(g, rows, k).to(torch.bfloat16)
    w = rand(g, n, k, scale=0.05)
    q8, s8 = quantize_int8(w)
    q4, s4 = quantize_int4(w, 32) if k % 32 == 0 else quantize_int4(w[:, : k // 32 * 32], 32)
    x4 = x if k % 32 == 0 else x[:, : k // 32 * 32].contiguous()
    t4, ts4 = ops.pack_int4_tiled(q4, s4, 32)
    f8, fs8 = quantize_fp8(w, False)
    runs = {"linear": lambda: ops.linear(x, w.to(torch.bfloat16)),
            "linear_w8": lambda: ops.linear_w8(x, q8, s8),
            "linear_w8a8": lambda: ops.linear_w8a8(x, q8, s8, q8.to(torch.int32).sum(dim=1, dtype=torch.int32)),
            "linear_w4": lambda: ops.linear_w4(x4, q4, s4, 32),
            "linear_w4_tiled": lambda: ops.linear_w4_tiled(x4, t4, ts4, 32),
            "linear_w4a8_tiled": lambda: ops.linear_w4a8_tiled(x4, t4, ts4, 32),
            "linear_fp8": lambda: ops.linear_fp8(x, f8, fs8),
            "silu_mul": lambda: ops.silu_mul(torch.cat([x, x.flip(1)], dim=1))}
    if ops.int8_tiles_fit(n, k):
        t8 = ops.pack_int8_tiled(q8)
        runs["linear_w8_tiled"] = lambda: ops.linear_w8_tiled(x, t8, s8)
        runs["linear_w8a8_tiled"] = lambda: ops.linear_w8a8_tiled(x, t8, s8)
    if ops.bf16_tiles_fit(n, k):
        tb = ops.pack_bf16_tiled(w.to(torch.bfloat16))
        runs["linear_bf16_tiled"] = lambda: ops.linear_bf16_tiled(x, tb)
    return runs


@pytest.mark.parametrize("rows, k, n", [(1, 576, 64), (3, 200, 48), (1, 1536, 96)])
def test_software_prefetch_changes_no_result(isa, rows, k, n):
    """Every decode GEMV gives the same bits with its weight prefetch off, at the default
    distance and at one past the end of the weights (a prefetch never reads a value)."""
    runs = decode_kernels(isa, "prefetch", rows, k, n)
    before = ops.set_prefetch(0)
    try:
        plain = {name: run() for name, run in runs.items()}
        for distance in (4096, n * k * 2 + 4096):
            ops.set_prefetch(distance)
            for name, run in runs.items():
                assert torch.equal(run(), plain[name]), f"{name} with prefetch {distance} differs"
    finally:
        ops.set_prefetch(before)


# 36 tiles of 16 outputs (two threads split a group of 4 tiles at tile 18), 7 tiles, 5 tiles
@pytest.mark.parametrize("rows, k, n", [(1, 576, 576), (1, 256, 112), (3, 200, 80), (2, 1536, 112)])
def test_results_do_not_depend_on_the_thread_count(isa, rows, k, n):
    """Each output is computed alike whichever thread runs it (a thread's share of a tiled GEMV
    may start inside a group of tiles): 1, 2 and 3 threads give the same bits."""
    runs = decode_kernels(isa, "threads", rows, k, n)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {name: run() for name, run in runs.items()}
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for name, run in runs.items():
                assert torch.equal(run(), one[name]), f"{name} on {threads} threads differs from one thread"
    finally:
        torch.set_num_threads(before)


def gptq_inputs(g, out, B):
    """A block as GPTQ hands it over: weights, and the upper Cholesky factor of a damped inverse
    Gram matrix of correlated inputs (positive diagonal, the later columns coupled)."""
    x = torch.randn(4 * B, B, generator=g) @ (torch.randn(B, B, generator=g) / B ** 0.5 + torch.eye(B))
    h = (x.T @ x).double() + 0.01 * torch.eye(B, dtype=torch.float64)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    return torch.randn(out, B, generator=g) * 0.05, hinv.contiguous()


# (grid, out rows, block columns, group, the block's first column, AWQ clipping): odd row
# counts, a block of whole groups, one whose last group is short, a block that starts at a later
# group, with and without clipping (int4 only)
GPTQ_CASES = [("int4", 37, 96, 32, 0, True), ("int4", 16, 80, 32, 64, False), ("int4", 5, 64, 64, 128, True),
              ("int4", 23, 64, 64, 0, False), ("int8", 33, 50, 0, 7, False), ("fp8", 19, 41, 0, 0, False)]


@pytest.mark.parametrize("grid,out,B,group,column,clipped", GPTQ_CASES)
def test_gptq_block_matches_reference_bit_for_bit(isa, grid, out, B, group, column, clipped):
    g = generator("gptq_block", grid, out, B, group, column, clipped)
    w, hinv = gptq_inputs(g, out, B)
    if grid == "int4":
        groups = -(-(column + B) // group)
        scales = torch.zeros(out, groups)
        clip = torch.rand(out, groups, generator=g) * 0.5 + 0.5 if clipped else None
    else:
        w[3, 5] = 0  # a weight exactly on the grid's zero
        scales = w.abs().amax(dim=1) / (127 if grid == "int8" else 448)
        clip = None
    pending, want_pending, want_scales = w.clone(), w.clone(), scales.clone()
    q, errors = ops.gptq_block(pending, hinv, scales, clip, column, group, grid)
    want_q, want_errors = reference.gptq_block(want_pending, hinv, want_scales, clip, column, group, grid)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(errors, want_errors, rtol=0, atol=0)
    torch.testing.assert_close(pending, want_pending, rtol=0, atol=0)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    assert (errors != 0).any() and not torch.equal(pending, w)  # the block did round and update


@pytest.mark.parametrize("bad,message", [
    (dict(grid="int3"), "grid must be int4, int8 or fp8"),
    (dict(column=16), "starts a group"),
    (dict(hinv=torch.eye(7)), "hinv must be contiguous float32"),
    (dict(scales=torch.zeros(3, 2)), "int4 scales must be"),
    (dict(column=32, scales=torch.zeros(4, 1)), "int4 scales must be"),
    (dict(grid="int8"), "int8 scales must be"),
])
def test_gptq_block_rejects_bad_arguments(plugin_isas, bad, message):
    args = dict(pending=torch.zeros(4, 8), hinv=torch.eye(8), scales=torch.zeros(4, 2), clip=None, column=0,
                group_size=32, grid="int4")
    args.update(bad)
    with pytest.raises(RuntimeError, match=message):
        ops.gptq_block(**args)


# (rows, columns, group, column scales, clipping ratio): a short last group, odd row counts
FAKE_QUANT_CASES = [(37, 160, 48, True, 1.0), (16, 576, 64, True, 1.0), (9, 200, 64, False, 0.85),
                    (3, 64, 32, False, 0.5)]


@pytest.mark.parametrize("rows,k,group,scaled,ratio", FAKE_QUANT_CASES)
def test_fake_quant_int4_matches_reference_bit_for_bit(isa, rows, k, group, scaled, ratio):
    g = generator("fake_quant_int4", rows, k, group, scaled, ratio)
    w = torch.randn(rows, k, generator=g) * 0.05
    w[2, :group] = 0  # a group of zeros: the scale's floor
    s = torch.rand(k, generator=g) * 3 + 0.1 if scaled else None
    got = ops.fake_quant_int4(w, s, group, ratio)
    torch.testing.assert_close(got, reference.fake_quant_int4(w, s, group, ratio), rtol=0, atol=0)
    assert not torch.equal(got, w)


def linear_kernels(g, dtype, k, n):
    """Every linear kernel (dense and each quantized kind, row and tiled layouts) on one fresh
    weight: {name: a call on input rows x}."""
    w = rand(g, n, k, scale=0.05)
    q8, s8 = quantize_int8(w)
    q4, s4 = quantize_int4(w, 32)
    t4, ts4 = ops.pack_int4_tiled(q4, s4, 32)
    f8, fs8 = quantize_fp8(w, False)
    bias = rand(g, n).to(dtype)
    runs = {"linear": lambda x: ops.linear(x, w.to(dtype), bias),
            "linear_w8": lambda x: ops.linear_w8(x, q8, s8, bias),
            "linear_w8a8": lambda x: ops.linear_w8a8(x, q8, s8, q8.to(torch.int32).sum(dim=1, dtype=torch.int32), bias),
            "linear_w4": lambda x: ops.linear_w4(x, q4, s4, 32, bias),
            "linear_w4_tiled": lambda x: ops.linear_w4_tiled(x, t4, ts4, 32, bias),
            "linear_w4a8": lambda x: ops.linear_w4a8(x, q4, s4, 32, bias),
            "linear_w4a8_tiled": lambda x: ops.linear_w4a8_tiled(x, t4, ts4, 32, bias),
            "linear_fp8": lambda x: ops.linear_fp8(x, f8, fs8, bias)}
    if ops.int8_tiles_fit(n, k):
        t8 = ops.pack_int8_tiled(q8)
        runs["linear_w8_tiled"] = lambda x: ops.linear_w8_tiled(x, t8, s8, bias)
        runs["linear_w8a8_tiled"] = lambda x: ops.linear_w8a8_tiled(x, t8, s8, bias)
    return runs


@pytest.mark.parametrize("kernel", ["linear_w4_tiled", "linear_w4a8_tiled"])
@pytest.mark.parametrize("rows", [14, 16, 29, 30, 48])  # AVX2's lanes from 14 (W4A8) or 15 rows; 29, 30 split
def test_int4_lanes_without_bias_give_a_row_the_bits_it_gets_alone(isa, kernel, rows):
    """The tiled int4 kernels with no bias, groups of 64 (the engines'), float32 out: each row's
    outputs are the bits it gets alone (the row kernel), a zero row's included."""
    g = generator(isa, kernel, rows, "lanes without bias")
    k, n = 576, 80
    x = rand(g, rows, k, scale=4)
    x[rows // 2] = 0
    packed, scales = quantize_int4(rand(g, n, k, scale=0.05), 64)
    tiled = ops.pack_int4_tiled(packed, scales, 64)
    run = getattr(ops, kernel)
    together = run(x, *tiled, 64)
    alone = torch.cat([run(x[i:i + 1], *tiled, 64) for i in range(rows)])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"{kernel}: rows {differ} of {rows} differ from the row alone"
    assert not together[rows // 2].any()


@pytest.mark.parametrize("kernel", ["linear_w8", "linear_w8a8"])
@pytest.mark.parametrize("rows", [15, 16, 29, 33])  # AVX2's lanes from 15 (W8A8 10) rows; 29 split
def test_int8_lanes_without_bias_give_a_row_the_bits_it_gets_alone(isa, kernel, rows):
    """The int8 kernels with no bias and 37 outputs (a lanes tile's last outputs past whole eights,
    stored one by one), float32 out: each row's outputs are the bits it gets alone."""
    g = generator(isa, kernel, rows, "int8 lanes without bias")
    k, n = 200, 37
    x = rand(g, rows, k, scale=4)
    q, s = quantize_int8(rand(g, n, k, scale=0.05))
    args = (q, s) if kernel == "linear_w8" else (q, s, q.to(torch.int32).sum(dim=1, dtype=torch.int32))
    run = getattr(ops, kernel)
    together = run(x, *args)
    alone = torch.cat([run(x[i:i + 1], *args) for i in range(rows)])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"{kernel}: rows {differ} of {rows} differ from the row alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32: no output rounding to hide a sum's last bits
@pytest.mark.parametrize("rows", [2, 7, 8, 9, 15, 16, 28, 33, 45, 64])  # AVX2 lanes: 15 and 45 padded, 28, 33 split
@pytest.mark.parametrize("k, n", [(576, 96), (160, 48)])
def test_every_linear_kernel_gives_a_row_the_bits_it_gets_alone(isa, dtype, rows, k, n):
    """Batch invariance, kernel by kernel: among any number of rows (grouped by four, in pairs,
    leftovers one by one, tiles split between threads), each row's outputs are the bits it gets
    alone (runtime's batch_invariant relies on it)."""
    g = generator(isa, str(dtype), rows, k, n, "batch invariance")
    x = rand(g, rows, k, scale=4).to(dtype)
    for name, run in linear_kernels(g, dtype, k, n).items():
        together = run(x)
        alone = torch.cat([run(x[i:i + 1]) for i in range(rows)])
        differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
        assert not differ, f"{name}: rows {differ} of {rows} differ from the row alone"
