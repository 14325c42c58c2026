"""Quantizing weights into the formats the engine stores and the kernels read.

int8, per output channel: q = round(w / s), s = absmax(row) / 127, q in [-127, 127].
int4, per group of `group_size` inputs (the last group may be shorter): q = round(w / s),
s = absmax(group) / 7, q in [-8, 7], packed as plugins/formats.py's int4 rows.
fp8, FP8 E4M3 (torch.float8_e4m3fn, largest value 448) per output channel or per tensor:
q = w / s rounded to nearest even, s = absmax(row or tensor) / 448, scales stored per row either way."""
from __future__ import annotations

import torch

from kiln.plugins.formats import pack_int4


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 [out]: absmax(row) / 127."""
    return (w.float().abs().amax(dim=1) / 127).clamp(min=1e-10)


def quantize_int8(w: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> int8 [out, in], float32 scales [out] (by default int8_scales(w))."""
    w = w.float()
    scales = int8_scales(w) if scales is None else scales.float()
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, per_tensor: bool = False,
                 scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> float8_e4m3fn [out, in], float32 scales [out] (all equal when
    per_tensor); by default s = absmax / 448."""
    w = w.float()
    if scales is None:
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
        scales = amax / FP8_MAX
    scales = scales.float().clamp(min=1e-12).expand(w.shape[0]).contiguous()
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x rounded to the E4M3 grid scaled by `scale` (broadcast), saturating, and back."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def group_view(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """[out, in] -> [out, groups, group_size], zero-padded when group_size does not divide in."""
    out_features, in_features = w.shape
    groups = -(-in_features // group_size)
    pad = groups * group_size - in_features
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_features, groups, group_size), in_features


def int4_scales(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [out, groups]; `clip` [out, groups] (<= 1) shrinks each group's range (AWQ)."""
    grouped, _ = group_view(w.float(), group_size)
    amax = grouped.abs().amax(dim=2)
    if clip is not None:
        amax = amax * clip
    return (amax / 7).clamp(min=1e-10)


def fake_quant_int4(w: torch.Tensor, group_size: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """w rounded to its int4 grid and back (float32), as the engine will compute with it."""
    grouped, in_features = group_view(w.float(), group_size)
    s = int4_scales(w, group_size) if scales is None else scales
    q = torch.round(grouped / s[:, :, None]).clamp(-8, 7)
    return (q * s[:, :, None]).reshape(w.shape[0], -1)[:, :in_features]


def quantize_int4(w: torch.Tensor, group_size: int, scales: torch.Tensor | None = None):
    """[out, in] float (in even) -> packed uint8 [out, in / 2], float32 scales [out, groups]."""
    if w.shape[1] % 2:
        raise ValueError(f"int4 packing needs an even in_features, got {w.shape[1]}")
    grouped, in_features = group_view(w.float(), group_size)
    s = int4_scales(w, group_size) if scales is None else scales
    q = torch.round(grouped / s[:, :, None]).clamp(-8, 7).reshape(w.shape[0], -1)[:, :in_features]
    return pack_int4(q.to(torch.int8)), s.float().contiguous()
