"""Tactics at run time (runtime/linear.py): a linear's Tactic picks kiln's kernel or the dense route
per row count, a forced tactic changes which implementation runs and not the result beyond its
bound, and a model fuses steps only as far as every linear takes its kernel."""
import pytest
import torch

from kiln import constants as names
from kiln.plugins import ops
from kiln.quantize.formats import quantize_int4, quantize_int8
from kiln.runtime import linear
from kiln.runtime.linear import DenseLinear, Int4Linear, Int8Linear, Tactic, tactics_from_json
from tests.helpers import AVX512_BF16_LEVELS, generator

KILN, TORCH = names.TACTIC_KILN, names.TACTIC_TORCH


def test_a_tactic_takes_the_first_bucket_at_or_above_the_rows():
    tactic = Tactic([1, 2, 4, 8], [KILN, KILN, TORCH, KILN])
    assert [tactic.choice(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 1000)] == [KILN, KILN, TORCH, TORCH, KILN, KILN,
                                                                             KILN, KILN]


@pytest.mark.parametrize("buckets, choices, message", [
    ([], [], "ascending row buckets"),
    ([1, 4, 2], [KILN] * 3, "ascending row buckets"),
    ([0, 1], [KILN] * 2, "ascending row buckets"),
    ([1, 2], [KILN], "one choice each"),
    ([1, 2], [KILN, "onednn"], "unknown tactic choice"),
])
def test_a_malformed_tactic_is_refused(buckets, choices, message):
    with pytest.raises(ValueError, match=message):
        Tactic(buckets, choices)


def test_tactics_from_json_keys_by_linear():
    section = {"linears": {"dense bfloat16 8x4": {"buckets": [1, 16], "choices": [KILN, TORCH],
                                                 "kiln_us": [1.0, 9.0], "torch_us": [5.0, 8.0]}}}
    tactic = tactics_from_json(section)["dense bfloat16 8x4"]
    assert (tactic.choice(1), tactic.choice(2)) == (KILN, TORCH)


def quantized(kind: str, g: torch.Generator, n: int = 96, k: int = 256, group: int = 64):
    """A quantized linear of random weights, as the engine stores them."""
    w = torch.randn(n, k, generator=g) / 16
    if kind == "int8":
        return Int8Linear(*quantize_int8(w), None, None, torch.bfloat16)
    return Int4Linear(*quantize_int4(w, group), None, None, torch.bfloat16, group)


def dense(g: torch.Generator, n: int = 96, k: int = 256):
    return DenseLinear((torch.randn(n, k, generator=g) / 16).bfloat16(), torch.randn(n, generator=g).bfloat16())


@pytest.mark.parametrize("make", ("int8", "int4", "dense"))
@pytest.mark.parametrize("rows", (1, 9, 33))
def test_a_forced_tactic_changes_which_implementation_runs_not_the_result(plugin_isas, monkeypatch, make, rows):
    g = generator("forced tactic", make, rows)
    layer = dense(g) if make == "dense" else quantized(make, g)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    ran = []
    for name in ("gemv", "dense") if make != "dense" else ():
        real = getattr(layer, name)
        monkeypatch.setattr(layer, name, lambda x, real=real, name=name: ran.append(name) or real(x))
    if make == "dense":
        for name, fn in (("gemv", ops.linear), ("dense", linear.gemm)):
            monkeypatch.setattr(linear.ops if name == "gemv" else linear, "linear" if name == "gemv" else "gemm",
                                lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    if make == "dense" and layer.tiled:  # bf16 on the tiled layout: one route whatever the tactic
        monkeypatch.setattr(linear.ops, "linear_bf16_tiled",
                            lambda *a, fn=ops.linear_bf16_tiled: ran.append("tiled") or fn(*a))
        outs = []
        for choice in (KILN, TORCH):
            layer.tactic = Tactic([1, 64], [choice, choice])
            ran.clear()
            outs.append(layer(x))
            assert ran == ["tiled"], (rows, choice, ran)
        assert torch.equal(outs[0], outs[1])
        return
    outs = {}
    for choice, expected in ((KILN, "gemv"), (TORCH, "dense")):
        layer.tactic = Tactic([1, 64], [choice, choice])
        ran.clear()
        outs[choice] = layer(x)
        assert ran == [expected], (make, rows, choice, ran)
    # both round one float32 sum per output to bf16: within two bf16 steps of each other (the
    # kernels' activations are quantized to 15 bits, 3e-5 of a row's largest value)
    torch.testing.assert_close(outs[KILN].float(), outs[TORCH].float(), rtol=2 ** -6, atol=2e-2)


def test_without_a_tactic_each_kind_takes_its_default(plugin_isas):
    g = generator("defaults")
    int4, int8, bf16 = quantized("int4", g), quantized("int8", g), dense(g)
    assert int4.uses_kernel(2048) and int8.uses_kernel(2048)  # measured faster at every row count on AVX2
    assert bf16.tiled == (ops.active_isa() in AVX512_BF16_LEVELS)
    if bf16.tiled:  # the tiled layout: the kernel at every row count, nothing to choose
        assert bf16.uses_kernel(2048) and bf16.candidates() == ()
    else:
        assert bf16.uses_kernel(DenseLinear.kernel_rows) and not bf16.uses_kernel(DenseLinear.kernel_rows + 1)
    assert DenseLinear(torch.randn(8, 8)).candidates() == ()  # float32: PyTorch's GEMM only
    # float32 activations: the W4A16 / W8A16 kernels hold rows in 15 bits, so many rows stay exact
    w = torch.randn(96, 256, generator=g) / 16
    f32 = Int4Linear(*quantize_int4(w, 64), None, None, torch.float32, 64)
    assert f32.uses_kernel(linear.SKINNY_ROWS) and not f32.uses_kernel(linear.SKINNY_ROWS + 1)
    assert f32.candidates() == ()


def test_a_model_fuses_steps_only_where_every_linear_takes_its_kernel(tiny_engines):
    from kiln.runtime.engine import Engine

    engine = Engine(tiny_engines("llama", "bfloat16"))
    model = engine.model
    if model.layers[1].gate_up.tiled:  # bf16 on AMX tiles: the kernel at every row count, whatever the tactic
        key = model.layers[1].gate_up.tactic_key()
        assert key.startswith("dense_tiled ") and model.fused_rows == float("inf")
        model.apply_tactics({key: Tactic([1, 16], [TORCH, KILN])})
        assert model.fused_rows == float("inf")
        return
    assert model.fused_rows == DenseLinear.kernel_rows  # bf16 dense: the kernel's default bound, no tactics
    key = model.layers[1].gate_up.tactic_key()
    taken = model.apply_tactics({key: Tactic([1, 2, 4, 8], [KILN, KILN, TORCH, KILN])})
    assert taken == sum(lin.tactic_key() == key for lin in model.linears()) > 0
    assert model.fused_rows == 2  # 3 and 4 rows take PyTorch's GEMM in one linear: the Python loop
    model.apply_tactics({lin.tactic_key(): Tactic([1, 16], [KILN, KILN]) for lin in model.linears()})
    assert model.fused_rows == float("inf")  # the kernel at every row count: every step fuses
    model.apply_tactics({key: Tactic([1, 16], [TORCH, KILN])})
    assert model.fused_rows == 0  # one linear's one row takes PyTorch's GEMM: no step fuses
