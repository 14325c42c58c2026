"""Plain PyTorch references for every plugin op; the kernels are tested against these."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def attention(q, k, v, k_cache, v_cache, start_pos: int, scale: float) -> torch.Tensor:
    """Causal GQA attention of new tokens over a contiguous cache; writes k/v into the cache."""
    tokens, heads, _ = q.shape
    kv_heads = k.shape[1]
    k_cache[start_pos : start_pos + tokens] = k
    v_cache[start_pos : start_pos + tokens] = v
    context = start_pos + tokens
    keys = k_cache[:context].float().repeat_interleave(heads // kv_heads, dim=1)  # [S, H, D]
    values = v_cache[:context].float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * scale
    positions = torch.arange(context)
    causal = positions[None, :] <= (start_pos + torch.arange(tokens))[:, None]
    scores = scores.masked_fill(~causal[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
    return out.to(q.dtype)
