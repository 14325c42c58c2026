"""The op table: every op the library declares has a fake (checked at load) and passes
torch.library.opcheck here (schema, fake vs real shapes and strides, autograd registration), so
ops trace and export. A new op without a sample below fails test_every_op_has_a_sample."""
import pytest
import torch

from kiln.plugins import ops
from kiln.plugins.formats import pack_int4
from kiln.quantize.formats import quantize_fp8, quantize_int4, quantize_int8

SEED = 20261201
OPS = ["rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "linear", "linear_bf16_tiled", "paged_attention",
       "decode_layers", "moe_mlp", "linear_w8", "linear_w8_tiled", "dequantize_int8_tiled", "linear_w4",
       "dequantize_int4", "linear_w4_tiled", "dequantize_int4_tiled", "linear_w8a8", "linear_w8a8_tiled", "linear_w4a8",
       "linear_w4a8_tiled", "linear_fp8", "quantize_fp8", "dequantize_fp8", "gptq_block", "fake_quant_int4",
       "pack_int4_tiled", "pack_int8_tiled", "pack_bf16_tiled", "to_hugepages"]
NO_SCHEMA_TEST = ("test_faketensor", "test_autograd_registration")  # torch lacks float8 ops the schema test needs


def decode_layers_sample(g):
    """Two dense float32 layers of hidden 32 (2 heads, 1 KV head of 16) over a 2-token prefill, in two
    groups of the KV pool."""
    hidden, heads, kv_heads, head_dim, inter, block = 32, 2, 1, 16, 48, 4

    def w(out, inp):
        return torch.randn(out, inp, generator=g) * 0.1

    layers = []
    for _ in range(2):
        linears = {"qkv": w((heads + 2 * kv_heads) * head_dim, hidden), "out": w(hidden, heads * head_dim),
                   "gate_up": w(2 * inter, hidden), "down": w(hidden, inter)}
        layers.append({**{name: {"kind": "dense", "weight": weight} for name, weight in linears.items()},
                       "post_attention_norm": torch.rand(hidden, generator=g) + 0.5,
                       "next_norm": torch.rand(hidden, generator=g) + 0.5})
    tensors, ints, floats = ops.decode_plan(layers)
    angles = torch.rand(16, head_dim, generator=g) * 6.3
    h = torch.randn(2, hidden, generator=g)
    # the two layers share one slot of the pool, each with a block table of its own (two groups)
    return (h, h.clone(), tensors, ints, floats, torch.zeros(1, 2, 4, kv_heads, block, head_dim),
            torch.tensor([[0, 0], [0, 1]]), torch.tensor([[[2, 0, 1, 3]], [[1, 3, 0, 2]]], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), angles.cos(), angles.sin(), heads, 0.25, 1e-5)


def moe_mlp_sample(g, shared: bool = False):
    """Four dense float32 experts of width 24 over hidden 16, two a row, for 3 rows (shared: and a
    fifth every row runs, behind a sigmoid gate)."""
    def w(out, inp):
        return torch.randn(out, inp, generator=g) * 0.3

    experts = [({"kind": "dense", "weight": w(48, 16)}, {"kind": "dense", "weight": w(16, 24)})
               for _ in range(5 if shared else 4)]
    return (torch.randn(3, 16, generator=g), w(4, 16), *ops.expert_plan(experts), 2, True, False, 0,
            w(1, 16) if shared else None)


def paged_attention_sample(g, pool_dtype):
    kv_heads, head_dim, block = 2, 16, 4
    qkv = torch.randn(5, (4 + 2 * kv_heads) * head_dim, generator=g)
    pools = [torch.randn(6, kv_heads, block, head_dim, generator=g) for _ in range(2)]
    scales = None
    if pool_dtype == torch.int8:
        pools = [p.mul(10).round().clamp(-127, 127).to(torch.int8) for p in pools]
        scales = torch.rand(2, kv_heads * head_dim, generator=g) * 0.1 + 0.01
    angles = torch.rand(16, head_dim, generator=g) * 6.3
    return (qkv, *pools, torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32),
            torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32), angles.cos(),
            angles.sin(), 4, 0.25, scales)


def samples():
    """op name -> [(args, opcheck's test_utils or None for all)]"""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(3, 64, generator=g)
    q, s = quantize_int8(torch.randn(8, 64, generator=g))
    q16, s16 = quantize_int8(torch.randn(16, 64, generator=g))
    packed, scales = quantize_int4(torch.randn(8, 64, generator=g), 32)
    tiled_in = (torch.cat([packed, packed]), torch.cat([scales, scales]), 32)  # 16 rows: one tile
    tiled = ops.pack_int4_tiled(*tiled_in)
    tiled8 = ops.pack_int8_tiled(q16)
    q8, s8 = quantize_fp8(torch.randn(8, 64, generator=g))
    w = torch.randn(8, 64, generator=g)
    w16 = torch.randn(16, 64, generator=g).bfloat16()  # one group of 16 outputs, two tiles of inputs
    return {
        "rms_norm": [((x, torch.randn(64, generator=g), 1e-5), None)],
        "add_rms_norm": [((x.clone(), torch.randn(3, 64, generator=g), torch.randn(64, generator=g), 1e-5), None)],
        "silu_mul": [((torch.randn(3, 40, generator=g),), None)],
        "gelu_tanh_mul": [((torch.randn(3, 40, generator=g),), None)],
        "linear": [((x, w, torch.randn(8, generator=g)), None), ((x.bfloat16(), w.bfloat16(), None), None)],
        "linear_bf16_tiled": [((x.bfloat16(), ops.pack_bf16_tiled(w16), torch.randn(16, generator=g).bfloat16()),
                               None)],
        "paged_attention": [(paged_attention_sample(g, torch.float32), None),
                            (paged_attention_sample(g, torch.int8), None)],
        "decode_layers": [(decode_layers_sample(g), None)],
        "moe_mlp": [(moe_mlp_sample(g), None), (moe_mlp_sample(g, shared=True), None)],
        "linear_w8": [((x, q, s, None), None)],
        "linear_w8_tiled": [((x, tiled8, s16, None), None)],
        "dequantize_int8_tiled": [((tiled8, s16, torch.bfloat16), None)],
        "linear_w4": [((x, packed, scales, 32, None), None)],
        "dequantize_int4": [((packed, scales, 32, torch.bfloat16), None)],
        "linear_w4_tiled": [((x, *tiled, 32, None), None)],
        "dequantize_int4_tiled": [((*tiled, 32, torch.float32), None)],
        "linear_w8a8": [((x, q, s, q.to(torch.int32).sum(1, dtype=torch.int32), None), None)],
        "linear_w8a8_tiled": [((x, tiled8, s16, None), None), ((x.bfloat16(), tiled8, s16, None, 0.02), None)],
        "linear_w4a8": [((x, packed, scales, 32, None), None),
                        ((torch.randn(2, 128, generator=g).bfloat16(),
                          pack_int4(torch.randint(-8, 8, (4, 128), generator=g, dtype=torch.int8)),
                          torch.rand(4, 2, generator=g), 64, None), None)],
        "linear_w4a8_tiled": [((x, *tiled, 32, None), None)],
        "linear_fp8": [((x, q8, s8, None), NO_SCHEMA_TEST)],
        "quantize_fp8": [((x, 2.0), None)],
        "dequantize_fp8": [((q8, torch.bfloat16), NO_SCHEMA_TEST)],
        "gptq_block": [((w.clone(), torch.eye(64) + torch.randn(64, 64, generator=g).triu(1) * 0.01,
                         torch.zeros(8, 2), torch.rand(8, 2, generator=g) + 0.5, 0, 32, "int4"), None),
                       ((w.clone(), torch.eye(64), s.clone(), None, 0, 0, "int8"), None)],
        "fake_quant_int4": [((w, torch.rand(64, generator=g) + 0.5, 32, 0.9), None), ((w, None, 24), None)],
        "pack_int4_tiled": [(tiled_in, None)],
        "pack_int8_tiled": [((q16,), None)],
        "pack_bf16_tiled": [((w16,), None)],
        "to_hugepages": [((x,), None)],
    }


def test_every_op_has_a_sample(plugin_isas):
    assert set(samples()) == set(OPS) == set(ops.library_info()["ops"])


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, plugin_isas):
    for args, test_utils in samples()[name]:
        kwargs = {} if test_utils is None else {"test_utils": test_utils}
        torch.library.opcheck(getattr(torch.ops.kiln, name).default, args, **kwargs)
