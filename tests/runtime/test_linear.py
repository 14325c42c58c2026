"""The runtime's linears at prefill sizes: gemm()'s float32 route for bf16 (taken below the
avx512bf16 kernel level) against a float64 reference, block boundaries and bias included."""
import pytest
import torch
import torch.nn.functional as F

from kiln.runtime import linear
from kiln.runtime.linear import DenseLinear, gemm

# (rows, in, out): out over several widening blocks with a ragged last one, and a single block
SHAPES = ((9, 64, 2 * (linear.WIDEN_BLOCK // 64) + 37), (33, 576, 960), (130, 1536, 77))


@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("bias", (False, True))
def test_gemm_bf16_matches_reference(isa, rows, k, n, bias):
    x = torch.randn(rows, k).bfloat16()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    out = gemm(x, w, b)
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # one bf16 rounding of a sum that float32 holds to ~1e-6: within one bf16 step of the exact value
    torch.testing.assert_close(out.double(), reference, rtol=2 ** -7, atol=1e-5)


def test_gemm_takes_float32_below_avx512bf16(isa, monkeypatch):
    seen = []
    real = F.linear

    def spy(x, w, b=None):
        seen.append((x.dtype, w.dtype))
        return real(x, w, b)

    monkeypatch.setattr(linear.F, "linear", spy)
    x, w = torch.randn(16, 128).bfloat16(), torch.randn(40, 128).bfloat16()
    out = gemm(x, w)
    expected = (torch.bfloat16, torch.bfloat16) if isa in ("avx512bf16", "avx512amx") else (torch.float32, torch.float32)
    assert seen and all(s == expected for s in seen), (isa, seen)
    assert out.dtype == torch.bfloat16


def test_float32_gemm_is_plain_linear(isa):
    x, w, b = torch.randn(12, 96), torch.randn(50, 96), torch.randn(50)
    assert torch.equal(gemm(x, w, b), F.linear(x, w, b))


def test_dense_linear_prefill_routes_agree(plugin_isas, monkeypatch):
    """The same bf16 prefill through PyTorch's bf16 GEMM and through the float32 route: outputs
    within one bf16 step of each other (only the order of the float32 sums differs)."""
    x = torch.randn(40, 576).bfloat16()
    layer = DenseLinear((torch.randn(960, 576) / 24).bfloat16(), torch.randn(960).bfloat16())
    monkeypatch.setattr(linear, "native_bf16_gemm", lambda: True)
    native = layer(x)
    monkeypatch.setattr(linear, "native_bf16_gemm", lambda: False)
    widened = layer(x)
    torch.testing.assert_close(widened.float(), native.float(), rtol=2 ** -7, atol=1e-5)
