import pytest
import torch
import torch.nn.functional as F

from kiln.plugins import ops, reference
from tests.helpers import generator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 129), (2, 1), (0, 32), (33, 1000)])
def test_rms_norm_matches_reference(isa, dtype, shape):
    g = generator(isa, str(dtype), shape)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got = ops.rms_norm(x, w, 1e-5)
    want = reference.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16: at most one rounding step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_non_contiguous_input(plugin_isas):
    x = torch.randn(16, 8).t()
    w = torch.randn(16)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_rms_norm_rejects_mismatched_weight(plugin_isas):
    with pytest.raises(RuntimeError, match="weight shape"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 2, 129)])
def test_add_rms_norm_matches_reference(isa, dtype, shape):
    g = generator(isa, str(dtype), shape)
    residual = torch.randn(shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    expected_residual = residual.clone()
    want = reference.add_rms_norm(expected_residual, x, w, 1e-6)
    got = ops.add_rms_norm(residual, x, w, 1e-6)
    assert torch.equal(residual, expected_residual)  # the in-place residual add, bit for bit
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (7, 10), (2, 3, 34)])
def test_silu_mul_matches_reference(isa, dtype, shape):
    g = generator(isa, str(dtype), shape)
    gate_up = (torch.randn(shape, generator=g) * 4).to(dtype)
    got = ops.silu_mul(gate_up)
    want = reference.silu_mul(gate_up)
    assert got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_silu_mul_float32_is_as_exact_as_float32_allows(isa):
    """SwiGLU through the vectorized exp (AVX2, AVX-512) or std::exp: within 4e-7 relative of float64
    from -90 to 90, which also bounds the exp the attention plugin shares."""
    g = torch.linspace(-90, 90, 200_001)
    got = ops.silu_mul(torch.cat([g[None], torch.ones_like(g)[None]], dim=1))[0].double()
    want = g.double() / (1 + torch.exp(-g.double()))
    assert float(((got - want).abs() / want.abs().clamp(min=1e-30)).max()) < 4e-7


@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_bf16_rounds_as_hugging_face(isa, width):
    """In bf16 the normalized value is rounded to bf16, times the weight, and the product rounded
    to bf16, bit for bit (vector lanes and the scalar rest of a row alike): the normalized value
    itself is what the same op gives in float32 with a weight of ones (the same statistics)."""
    g = generator(isa, "rms_norm", width)
    x, w = (torch.randn(3, width, generator=g) * 3).bfloat16(), torch.randn(width, generator=g).bfloat16()
    w[1:20:3] = 1e-39  # products below float32's normal range: rounded to bf16 subnormals, not flushed to 0
    got = ops.rms_norm(x, w, 1e-6)
    normalized = ops.rms_norm(x.float(), torch.ones(width), 1e-6)
    want = (w.float() * normalized.bfloat16().float()).bfloat16()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"width {width}, {isa}"


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("width", [3072, 37])
def test_gated_bf16_rounds_as_pytorch_ops_would(isa, op, width):
    """In bf16 the activation is rounded to bf16, times up, and the product rounded to bf16, bit for
    bit (vector lanes and the scalar rest of a row alike): the activation itself is what the same
    op gives in float32 with up = 1."""
    g = generator(isa, op, width)
    gate, up = ((torch.randn(3, width, generator=g) * 4).bfloat16() for _ in range(2))
    gate[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    gate[1, 5:30:4], up[1, 5:30:4] = 1e-20, 1e-20  # products below float32's normal range: bf16 subnormals
    got = getattr(ops, op)(torch.cat([gate, up], dim=1))
    act = getattr(ops, op)(torch.cat([gate.float(), torch.ones(gate.shape)], dim=1))
    want = (act.bfloat16().float() * up.float()).bfloat16()
    assert torch.equal(got.isnan(), want.isnan()), f"{op}, width {width}, {isa}"
    # NaN's bits differ between PyTorch's conversions (0xffff here, 0x7fc0 for one bf16): compare the rest
    got, want = (torch.where(t.isnan(), 0, t).view(torch.int16) for t in (got, want))
    assert torch.equal(got, want), f"{op}, width {width}, {isa}"


def test_silu_mul_rejects_odd_width(plugin_isas):
    with pytest.raises(RuntimeError, match="must be even"):
        ops.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (7, 10), (2, 3, 34), (5, 98)])
def test_gelu_tanh_mul_matches_reference(isa, dtype, shape):
    g = generator(isa, str(dtype), shape)
    gate_up = (torch.randn(shape, generator=g) * 4).to(dtype)
    got = ops.gelu_tanh_mul(gate_up)
    want = reference.gelu_tanh_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16: the activation rounded to bf16 as F.gelu rounds it, at most one step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_gelu_tanh_float32_is_as_exact_as_float32_allows(isa):
    """GeGLU's tanh through the vectorized exp (tanh(u) = 1 - 2 / (e^2u + 1)) or std::tanh, from -90
    to 90: within 2e-7 x max(|x|, 1) of float64's tanh-GELU, as PyTorch's own float32 GELU is
    (1e-7; the sum 1 + tanh cancels for negative x, so the error is relative to x, not to the
    result), and finite everywhere."""
    g = torch.linspace(-90, 90, 200_001)
    got = ops.gelu_tanh_mul(torch.cat([g[None], torch.ones_like(g)[None]], dim=1))[0].double()
    x = g.double()
    want = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    assert bool(torch.isfinite(got).all())
    assert float(((got - want).abs() / x.abs().clamp(min=1)).max()) < 2e-7


# (rows, in, out). Below 32 rows a weight row against four input rows (dense.h); AVX2 takes the
# rows in its lanes from 32 rows (kernels/dense_lanes.h): there input tails of 5, 8 and 12 past
# the steps of 16, fewer than 8 inputs in all, three passes over the widened weights (1544),
# output groups of 6 left part empty, a second block of 4 chunks (80 rows); up to 12 rows past
# the last whole 16 (33, 40) go to the four-row kernel, 13 (45) are padded to a lane chunk
# below 32 rows (AVX2) by fours: 2-3 rows left over go as the last four (6, 14, 15), one alone (9, 13)
DENSE_SHAPES = [(1, 576, 96), (9, 40, 13), (16, 37, 13), (32, 37, 13), (33, 1100, 37), (64, 24, 7), (33, 5, 11),
                (40, 1544, 20), (80, 576, 160), (45, 576, 20), (6, 576, 9), (13, 37, 7), (14, 1536, 13),
                (15, 576, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", DENSE_SHAPES)
def test_linear_matches_reference(isa, dtype, rows, k, n):
    g = generator(isa, str(dtype), rows, k, n, "linear")
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    got = ops.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    # float32 sums of k + 1 terms in any order: off by at most (k + 1) 2^-24 of the sum of their
    # magnitudes; bf16 outputs then rounded once (half a step: 2^-8 of the value at most)
    bound = (k + 1) * 2**-24 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    if dtype == torch.bfloat16:
        bound += 2**-8 * (exact.abs() + bound)
    err = (got.double() - exact).abs()
    over = err - bound
    assert (over <= 0).all(), f"error {float(over.max()):.3g} over the bound at {int(over.argmax())}"


# The tiled bf16 layout (vdpbf16ps on avx512bf16, AMX tiles on avx512amx; the reference loops on
# every other level): one group of 16 outputs and one tile of 32 inputs; 3 and 5 groups (the last
# alone); 6 groups, 18 and 48 tiles of inputs. Rows: one, blocks of six with 1-5 left over (7, 8,
# 9, 16, 17), a chunk of 16 and one more, chunks in pairs and one left, 64.
TILED_BF16_SHAPES = [(1, 32, 16), (2, 64, 48), (7, 576, 96), (8, 1536, 80), (9, 96, 16), (16, 576, 48),
                     (17, 64, 80), (33, 576, 96), (64, 160, 48)]


@pytest.mark.parametrize("rows, k, n", TILED_BF16_SHAPES)
def test_linear_bf16_tiled_matches_reference(isa, rows, k, n):
    """Packing equals the reshape-built reference and unpacks to the weight; the product is
    within float32 summation and one bf16 rounding of the exact one, + bias."""
    g = generator(isa, rows, k, n, "linear bf16 tiled")
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    assert ops.bf16_tiles_fit(n, k)
    packed = ops.pack_bf16_tiled(w)
    assert torch.equal(packed, reference.pack_bf16_tiled(w)) and torch.equal(reference.unpack_bf16_tiled(packed), w)
    got = ops.linear_bf16_tiled(x, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    exact = F.linear(x.double(), w.double(), b.double())
    bound = (k + 1) * 2**-24 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    bound += 2**-8 * (exact.abs() + bound)
    over = (got.double() - exact).abs() - bound
    assert (over <= 0).all(), f"error {float(over.max()):.3g} over the bound at {int(over.argmax())}"


@pytest.mark.parametrize("rows, k, n", [shape for shape in TILED_BF16_SHAPES if shape[0] > 1])
def test_linear_bf16_tiled_rows_are_the_bits_of_each_row_alone(isa, rows, k, n):
    """A row among many, in a chunk of 16 or a pair of chunks, gets the bits it gets alone."""
    g = generator(isa, rows, k, n, "linear bf16 tiled alone")
    x = (torch.randn(rows, k, generator=g) * 4).bfloat16()
    packed = ops.pack_bf16_tiled((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16())
    b = torch.randn(n, generator=g).bfloat16()
    together = ops.linear_bf16_tiled(x, packed, b)
    alone = torch.cat([ops.linear_bf16_tiled(x[i:i + 1], packed, b) for i in range(rows)])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ} of {rows} differ from the row alone"


def test_linear_bf16_tiled_refuses_shapes_it_cannot_hold(plugin_isas):
    assert not ops.bf16_tiles_fit(24, 64) and not ops.bf16_tiles_fit(16, 48) and ops.bf16_tiles_fit(16, 64)
    with pytest.raises(RuntimeError, match="tiled bf16 layout needs"):
        ops.pack_bf16_tiled(torch.randn(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="must be a contiguous 2-d bfloat16"):
        ops.pack_bf16_tiled(torch.randn(16, 64))
    packed = ops.pack_bf16_tiled(torch.randn(16, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.linear_bf16_tiled(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="differs from in_features"):
        ops.linear_bf16_tiled(torch.randn(2, 32).bfloat16(), packed)


# float32: no output rounding to hide a sum's last bits
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", [shape for shape in DENSE_SHAPES if shape[0] > 1])
def test_linear_rows_are_the_bits_of_each_row_alone(isa, dtype, rows, k, n):
    """A row among many (AVX2: in the lanes from 32 rows, by fours below) gets the bits it gets
    alone: every sum in one order whatever the row count."""
    g = generator(isa, str(dtype), rows, k, n, "linear alone")
    x = (torch.randn(rows, k, generator=g) * 4).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    together = ops.linear(x, w, b)
    alone = torch.cat([ops.linear(x[i:i + 1], w, b) for i in range(rows)])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ} of {rows} differ from the row alone"
