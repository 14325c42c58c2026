"""Plain PyTorch references for every plugin op; the kernels are tested against these."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def paged_attention(q, k, v, k_pool, v_pool, block_tables, query_start, context_lens, scale):
    """Reference for kiln::paged_attention: gather each sequence's cache into a dense tensor,
    write the new k/v, then plain causal softmax attention in fp32."""
    heads, kv_heads = q.shape[1], k.shape[1]
    block_size = k_pool.shape[1]
    out = torch.empty_like(q)
    for s in range(context_lens.shape[0]):
        first, last = int(query_start[s]), int(query_start[s + 1])
        start, count = int(context_lens[s]), last - first
        positions = torch.arange(start, start + count)
        blocks = block_tables[s, positions // block_size].long()
        k_pool[blocks, positions % block_size] = k[first:last]
        v_pool[blocks, positions % block_size] = v[first:last]
        context = torch.arange(start + count)
        ctx_blocks = block_tables[s, context // block_size].long()
        keys = k_pool[ctx_blocks, context % block_size].float().repeat_interleave(heads // kv_heads, 1)
        values = v_pool[ctx_blocks, context % block_size].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("thd,shd->hts", q[first:last].float(), keys) * scale
        scores = scores.masked_fill(context[None, None, :] > positions[None, :, None], float("-inf"))
        out[first:last] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)
    return out
