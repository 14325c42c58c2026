"""The key rotation of a quantized KV cache: an orthonormal Walsh-Hadamard transform of the
queries and keys after rotary embedding, inside paged attention.

q . k = (H q) . (H k) for any orthonormal H, so attention is unchanged; what changes is what
the cache stores. After RoPE a few key channels are far larger than the rest, and they carry
most of each score. FP8 E4M3 rounds every value to 3 mantissa bits, an error relative to the
value, so those channels' errors dominate the scores' error. H spreads each channel over all of
its block, and the scores' error becomes an average over many channels' errors instead.
Measured on SmolLM2 (4,096 held-out tokens, float32 model, FP8 cache, per-channel scales as
kiln calibrates them; benchmarks/ablations/kv_rotation.py): KL to the unquantized model 0.0130
without the rotation, 0.0056 with it; the keys' error dominates (0.0129 with K alone quantized,
0.0007 with V alone).

H is the Sylvester-order Hadamard matrix of the largest power of two dividing head_dim,
repeated along the diagonal (one block for head_dim 64 or 128); kiln::paged_attention applies
it in O(head_dim log block) (attention.h, hadamard_inplace)."""
from __future__ import annotations

import math

import torch

from kiln import constants as names

KEY_ROTATIONS = (names.KEY_ROTATION_NONE, names.KEY_ROTATION_HADAMARD)


def hadamard_block(head_dim: int) -> int:
    """The block size of the transform: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def key_hadamard(key_rotation: str, head_dim: int) -> int:
    """paged_attention's key_hadamard argument for engine.json's quantization.key_rotation."""
    if key_rotation not in KEY_ROTATIONS:
        raise KeyError(f"unknown key_rotation {key_rotation!r}; expected {', '.join(KEY_ROTATIONS)}")
    return hadamard_block(head_dim) if key_rotation == names.KEY_ROTATION_HADAMARD else 0


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
