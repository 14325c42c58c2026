import pytest
import torch

from kiln.plugins import ops, reference

CASES = [
    # tokens, heads, kv_heads, head_dim, start, cache_len
    (1, 4, 4, 64, 0, 8),       # first token, MHA
    (7, 9, 3, 64, 0, 32),      # SmolLM2 shape, prefill
    (1, 9, 3, 64, 37, 64),     # decode after an odd prefix
    (5, 8, 1, 32, 130, 200),   # GQA 8, spans several score tiles
    (13, 6, 2, 48, 11, 40),    # head_dim not a multiple of 16
    (3, 2, 2, 7, 4, 10),       # tiny odd head_dim (scalar tail only)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(isa, dtype, case):
    tokens, heads, kv_heads, head_dim, start, cache_len = case
    g = torch.Generator().manual_seed(hash((isa, str(dtype), case)) % 2**31)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rnd(tokens, heads, head_dim), rnd(tokens, kv_heads, head_dim), rnd(tokens, kv_heads, head_dim)
    k_cache, v_cache = rnd(cache_len, kv_heads, head_dim), rnd(cache_len, kv_heads, head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5
    got = ops.attention(q, k, v, k_cache, v_cache, start, scale)
    want = reference.attention(q, k, v, k_ref, v_ref, start, scale)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the fused KV write
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_attention_chunked_prefill_equals_one_pass(plugin_isas):
    """Prefill in three chunks then decode gives the same outputs as one pass."""
    torch.manual_seed(0)
    total, heads, kv_heads, dim = 23, 6, 3, 32
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    whole = ops.attention(q, k, v, torch.zeros(32, kv_heads, dim), torch.zeros(32, kv_heads, dim), 0, 0.2)
    kc, vc = torch.zeros(32, kv_heads, dim), torch.zeros(32, kv_heads, dim)
    parts = [ops.attention(q[a:b], k[a:b], v[a:b], kc, vc, a, 0.2) for a, b in ((0, 9), (9, 10), (10, 23))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)


def test_attention_rejects_overflowing_positions(plugin_isas):
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="exceed the cache length"):
        ops.attention(q, k, k, torch.zeros(6, 2, 8), torch.zeros(6, 2, 8), 3, 1.0)


def test_attention_opcheck(plugin_isas):
    args = (torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16),
            torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), 2, 0.25)
    torch.library.opcheck(torch.ops.kiln.attention.default, args)
