"""What the key rotation (key_hadamard) costs kiln::paged_attention, one thread, SmolLM2's shapes
(9 heads / 3 KV heads / 64): a 512-token prefill and one decode token over 190 and 1,000
cached ones, with a bf16 pool and an FP8 one, each timed without and with the rotation,
alternating (medians of the calls; the best of two alternations).

    PYTHONPATH=. python benchmarks/ablations/attention_key_rotation.py"""
import statistics
import time

import torch

from kiln.plugins import ops
from kiln.plugins.build import build_plugins

ops.load_library(build_plugins())
torch.set_num_threads(1)
heads, kv_heads, head_dim, block = 9, 3, 64, 32


def timed(tokens: int, context: int, pool_dtype: torch.dtype) -> dict[int, float]:
    g = torch.Generator().manual_seed(0)
    blocks = -(-(tokens + context) // block)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    pools = [(torch.randn(blocks, kv_heads, block, head_dim, generator=g) * 10).to(pool_dtype) for _ in range(2)]
    angles = torch.rand(tokens + context + 1, head_dim, generator=g) * 6.3
    quantized = pool_dtype == torch.float8_e4m3fn
    args = dict(block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                query_start=torch.tensor([0, tokens], dtype=torch.int32),
                context_lens=torch.tensor([context], dtype=torch.int32), cos=angles.cos().bfloat16(),
                sin=angles.sin().bfloat16(), heads=heads, scale=head_dim ** -0.5,
                kv_scales=torch.full((2, kv_heads * head_dim), 0.01) if quantized else None)
    best: dict[int, float] = {}
    for key_hadamard in (0, head_dim, 0, head_dim):
        times = []
        for _ in range(30 if tokens > 1 else 300):
            start = time.perf_counter()
            ops.paged_attention(qkv, *pools, key_hadamard=key_hadamard, **args)
            times.append(time.perf_counter() - start)
        best[key_hadamard] = min(best.get(key_hadamard, float("inf")), statistics.median(times))
    return best


print(f"{'pool':>14} {'tokens':>6} {'cached':>6} {'unrotated':>11} {'rotated':>11} {'ratio':>6}")
for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn):
    for tokens, context in ((512, 0), (1, 190), (1, 1000)):
        t = timed(tokens, context, pool_dtype)
        print(f"{str(pool_dtype)[6:]:>14} {tokens:>6} {context:>6} {t[0] * 1e6:>8.1f} us {t[head_dim] * 1e6:>8.1f} us "
              f"{t[head_dim] / t[0]:>5.3f}x", flush=True)
