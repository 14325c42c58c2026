"""Rotary position embedding tables, computed exactly as Hugging Face's Llama rotary module."""
from __future__ import annotations

import math

import torch

from kiln.runtime.spec import ModelSpec


def inverse_frequencies(spec: ModelSpec, local: bool = False, max_positions: int = 0) -> torch.Tensor:
    """local: the sliding-window layers' frequencies (spec.local_rope_theta, unscaled, as Gemma 3
    has them); else every other layer's. max_positions: the engine's longest sequence (LongRoPE
    takes its long divisors beyond the original context)."""
    dim = spec.rotary_dim or spec.head_dim
    theta = spec.local_rope_theta if local else spec.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    longrope = spec.rope_longrope
    if longrope is not None and not local:  # as transformers' _compute_longrope_parameters
        long = max_positions > longrope.original_max_position_embeddings
        divisors = torch.tensor(longrope.long_factor if long else longrope.short_factor, dtype=torch.float32)
        return 1.0 / (divisors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if local:
        return inv_freq
    if spec.rope_linear_factor is not None:  # transformers' "linear" rope type
        inv_freq = inv_freq / spec.rope_linear_factor
    if spec.rope_freq_factors is not None:  # as llama.cpp applies a GGUF's rope_freqs.weight
        return inv_freq / torch.tensor(spec.rope_freq_factors, dtype=torch.float)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_tables(spec: ModelSpec, max_positions: int, dtype: torch.dtype, local: bool = False):
    """[max_positions, rotary dims] cos and sin (rotary dims: head_dim, or spec.rotary_dim), rounded
    to the model dtype as HF does (local: of the sliding-window layers, inverse_frequencies)."""
    inv_freq = inverse_frequencies(spec, local, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if spec.rope_longrope is not None and not local:  # LongRoPE's factor on cos and sin, in float32 first
        factor = spec.rope_longrope.attention_factor
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)
