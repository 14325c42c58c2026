"""The data formats kiln's kernels define, in plain PyTorch: how the engine stores int4 weights,
and the key transform of a quantized KV cache. The builder writes these formats and the
kernels read them; everything above plugins/ imports them from here.

int4 rows: [out, in] values in [-8, 7] stored + 8, two per byte along the input dimension (the
even input in the low nibble): uint8 [out, in / 2], with float32 scales [out, groups] for groups
of `group_size` inputs (the last group may be shorter). The tiled layouts the kernels make from
them at load are described in csrc/formats.h, with references in reference.py.

Key rotation: q . k = (H q) . (H k) for any orthonormal H, so attention is unchanged by
multiplying queries and keys by one after rotary embedding; what changes is what the cache
stores. After RoPE a few key channels are far larger than the rest and carry most of each score;
FP8 E4M3 rounds every value to 3 mantissa bits, an error relative to the value, so those
channels' errors dominate the scores' error. H spreads each channel over all of its block, and
the scores' error becomes an average over many channels' errors instead. H is the Sylvester-order
Hadamard matrix of the largest power of two dividing head_dim, repeated along the diagonal;
kiln::paged_attention applies it in O(head_dim log block) (csrc/kernels/hadamard.h)."""
from __future__ import annotations

import math

import torch


# --- int4 rows ---------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> uint8 [out, in / 2]."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> int8 [out, in] in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=2).reshape(packed.shape[0], -1).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [out, in / 2] and scales [out, groups] -> float32 [out, in]."""
    q = unpack_int4(packed).float()
    index = torch.arange(q.shape[1]) // group_size
    return q * scales[:, index]


# --- the key transform ---------------------------------------------------------------------------
def hadamard_block(head_dim: int) -> int:
    """The block size of the transform: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """x @ hadamard_matrix(x.shape[-1], block) in float32, by the butterflies kiln::paged_attention
    runs (the same additions in the same order, so the same bits)."""
    x = x.float()
    h = 1
    while h < block:
        pairs = x.reshape(*x.shape[:-1], -1, 2, h)
        x = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        x = x.reshape(*x.shape[:-3], -1)
        h *= 2
    return x * (1 / torch.tensor(float(block)).sqrt())


def hadamard_matrix(head_dim: int, block: int | None = None) -> torch.Tensor:
    """[head_dim, head_dim] float32: H, block-diagonal with `block` x `block` orthonormal
    Hadamard blocks (symmetric: H = H.T = H^-1)."""
    block = block or hadamard_block(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(block)] * (head_dim // block))
