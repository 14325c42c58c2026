"""One-thread kiln::paged_attention for one decode token (SmolLM2's 9 heads / 3 KV heads / 64,
bf16 pool) at several cached lengths: warm (called again and again) and cold (64 MB read
between calls, as the weights a decode step streams evict the KV cache). Median of the calls.

    PYTHONPATH=. python benchmarks/ablations/attention_context.py"""
import statistics
import time

import torch

from kiln.plugins import ops
from kiln.plugins.build import build_plugins

ops.load_library(build_plugins())
torch.set_num_threads(1)
heads, kv_heads, head_dim, block = 9, 3, 64, 32
junk = torch.randn(16 << 20)
cos, sin = torch.randn(8192, head_dim).bfloat16(), torch.randn(8192, head_dim).bfloat16()
for context in (1, 190, 1000, 4000):
    blocks = context // block + 2
    k_pool = torch.randn(blocks, block, kv_heads, head_dim).bfloat16()
    v_pool = torch.randn(blocks, block, kv_heads, head_dim).bfloat16()
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim).bfloat16()
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)

    def call():
        ops.paged_attention(qkv, k_pool, v_pool, tables, starts, lens, cos, sin, heads, head_dim ** -0.5, None)

    row = []
    for cold in (False, True):
        times = []
        for _ in range(60):
            if cold:
                junk.sum()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        row.append(f"{'cold' if cold else 'warm'} {statistics.median(times[10:]) * 1e6:7.1f} us")
    print(f"{context:5d} cached tokens  " + "  ".join(row), flush=True)
