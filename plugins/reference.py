"""Plain PyTorch references for every plugin op; the kernels are tested against these."""
from __future__ import annotations

import torch

from kiln.plugins.formats import dequantize_int4 as dequantize_int4_rows
from kiln.plugins.formats import hadamard_transform, unpack_int4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def linear(x, weight, bias=None):
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def add_rms_norm(residual, x, weight, eps):
    residual.copy_(residual + x)
    return rms_norm(residual, weight, eps)


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rope(x, cos, sin):
    """x: [tokens, heads, dim]; cos/sin: [tokens, rotary] (rotate-half, as Hugging Face's Llama; the
    first `rotary` values of each head rotate, the rest pass, as its Phi-3 with partial rotary)."""
    rotary = cos.shape[-1]
    part, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    return torch.cat((part * cos[:, None, :] + rotated * sin[:, None, :], rest), dim=-1)


def store_kv(values, pool_dtype, scales):
    """What a pool of `pool_dtype` holds for `values` [tokens, kv_heads, head_dim] (scales [kv_size]
    per channel for int8 / float8_e4m3fn pools)."""
    if scales is None:
        return values.to(pool_dtype)
    x = values.float() * (1 / scales).reshape(values.shape[1:])
    if pool_dtype == torch.int8:
        return torch.round(x).clamp(-127, 127).to(torch.int8)
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def paged_attention(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads, scale,
                    kv_scales=None, key_hadamard=0, window=0):
    """Reference for kiln::paged_attention: split the fused projection, apply rotary embedding
    (then, with key_hadamard, multiply q and k by the dense block-Hadamard matrix), write the new
    k/v into the pool (quantized per channel for an int8 / fp8 pool), gather each sequence's
    context densely, then plain causal softmax attention in fp32."""
    kv_heads, block_size, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    tokens = qkv.shape[0]
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))
    out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    for s in range(context_lens.shape[0]):
        first, last = int(query_start[s]), int(query_start[s + 1])
        start, count = int(context_lens[s]), last - first
        positions = torch.arange(start, start + count)
        qs = rope(q[first:last], cos[positions], sin[positions])
        ks = rope(k[first:last], cos[positions], sin[positions])
        if key_hadamard:  # x @ hadamard_matrix(head_dim, key_hadamard), with the kernel's roundings
            qs, ks = hadamard_transform(qs, key_hadamard), hadamard_transform(ks, key_hadamard)
        blocks = block_tables[s, positions // block_size].long()
        k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
        k_pool[blocks, :, positions % block_size] = store_kv(ks, k_pool.dtype, k_scale)
        v_pool[blocks, :, positions % block_size] = store_kv(v[first:last], v_pool.dtype, v_scale)
        context = torch.arange(start + count)
        ctx_blocks = block_tables[s, context // block_size].long()
        keys = k_pool[ctx_blocks, :, context % block_size].float()  # [positions, kv_heads, head_dim]
        values = v_pool[ctx_blocks, :, context % block_size].float()
        if kv_scales is not None:
            keys = keys * k_scale.reshape(kv_heads, head_dim)
            values = values * v_scale.reshape(kv_heads, head_dim)
        keys = keys.repeat_interleave(heads // kv_heads, 1)
        values = values.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("thd,shd->hts", qs.float(), keys) * scale
        hidden = context[None, :] > positions[:, None]  # [new token, context position]: causal
        if window:  # and a sliding window: only the last `window` positions, the token's own included
            hidden |= context[None, :] <= positions[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[first:last] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(qkv.dtype)
    return out.reshape(tokens, heads * head_dim)


def linear_w8(x, qweight, scales, bias=None):
    return linear(x.float(), qweight.float() * scales[:, None], None if bias is None else bias.float()).to(x.dtype)


def dequantize_int4(qweight, scales, group_size, dtype=torch.float32):
    return dequantize_int4_rows(qweight, scales, group_size).to(dtype)


def linear_w4(x, qweight, scales, group_size, bias=None):
    w = dequantize_int4(qweight, scales, group_size)
    return linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def quantize_rows_int8(x):
    """Per-row dynamic int8: (q [rows, k] int64, scale [rows]) with scale = absmax / 127."""
    x = x.float().reshape(-1, x.shape[-1])
    amax = x.abs().amax(dim=1)
    # 127 / amax as one division (a Python scalar over a tensor is reciprocal() * 127 in torch,
    # which can round differently and move a value across a rounding boundary)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int64)
    return q, amax / 127


def quantize_static_int8(x, scale):
    """One static scale for every row, the full int8 range [-128, 127] (as Model Optimizer's
    static quantizers): (q [rows, k] int64, scale [rows])."""
    x = x.float().reshape(-1, x.shape[-1])
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    q = torch.round(x * inv).clamp(-128, 127).to(torch.int64)
    return q, torch.full((x.shape[0],), scale, dtype=torch.float32)


def linear_w8a8(x, qweight, scales, weight_sum=None, bias=None, input_scale=0.0):
    """Exact int64 products of the int8 operands, then the float rescale."""
    q, xs = quantize_static_int8(x, input_scale) if input_scale > 0 else quantize_rows_int8(x)
    acc = (q @ qweight.to(torch.int64).T).float()
    out = acc * xs[:, None] * scales[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def quantize_groups_int8(x, group_size):
    """Per row and group of inputs: int8 values (float tensor) and scales absmax / 127."""
    x = x.float().reshape(-1, x.shape[-1])
    rows, k = x.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x, (0, groups * group_size - k)).reshape(rows, groups, group_size)
    amax = padded.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(padded * inv[:, :, None]).clamp(-127, 127)
    return q, amax / 127


def linear_w4a8(x, qweight, scales, group_size, bias=None):
    """Exact integer products per group, then both groups' scales."""
    q, xs = quantize_groups_int8(x, group_size)  # [rows, groups, g]
    w = unpack_int4(qweight).double()
    rows, groups, g = q.shape
    wg = torch.nn.functional.pad(w, (0, groups * g - w.shape[1])).reshape(w.shape[0], groups, g)
    acc = torch.einsum("rgk,ngk->rng", q.double(), wg)  # exact in float64
    out = (acc.float() * scales[None, :, :] * xs[:, None, :]).sum(dim=2)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def quantize_fp8(x, inv_scale):
    """torch's own float8_e4m3fn conversion (round to nearest even), after saturating at +-448."""
    return (x.float() * inv_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float().to(x.dtype)


def linear_fp8(x, qweight, scales, bias=None):
    w = qweight.float() * scales[:, None]
    return linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def pack_int8_tiled(qweight):
    """The tiled int8 layout by reshapes: per group of up to four tiles of 16 rows, per block of
    4 inputs, each tile's 16 rows x 4 bytes, stored + 128."""
    n, k = qweight.shape
    q = (qweight.to(torch.int16) + 128).to(torch.uint8)
    parts = []
    for t0 in range(0, n // 16, 4):
        u = min(4, n // 16 - t0)
        parts.append(q[t0 * 16:(t0 + u) * 16].reshape(u, 16, k // 4, 4).permute(2, 0, 1, 3).reshape(-1))
    return torch.cat(parts).reshape(n, k)


def unpack_int8_tiled(packed):
    """pack_int8_tiled's inverse: int8 [out, in]."""
    n, k = packed.shape
    q = packed.to(torch.int16) - 128
    parts, flat = [], q.reshape(-1)
    for t0 in range(0, n // 16, 4):
        u = min(4, n // 16 - t0)
        size = u * 16 * k
        group = flat[t0 * 16 * k:t0 * 16 * k + size].reshape(k // 4, u, 16, 4)
        parts.append(group.permute(1, 2, 0, 3).reshape(u * 16, k))
    return torch.cat(parts).to(torch.int8)


def linear_w8a8_tiled(x, qweight, scales, bias=None, input_scale=0.0):
    return linear_w8a8(x, unpack_int8_tiled(qweight), scales, None, bias, input_scale)


def pack_bf16_tiled(weight):
    """The tiled bf16 layout by reshapes: outputs in groups of 16, per pair of inputs each
    output's two values."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n, k).contiguous()


def unpack_bf16_tiled(packed):
    """pack_bf16_tiled's inverse."""
    n, k = packed.shape
    return packed.reshape(n // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(n, k).contiguous()


def linear_bf16_tiled(x, weight, bias=None):
    return linear(x, unpack_bf16_tiled(weight), bias)


def pack_int4_tiled(qweight, scales, group_size):
    """The tiled int4 layout by reshapes: rows in tiles of 16, tiles in groups of up to four; per
    block of 8 inputs, each tile's 16 rows x 4 bytes (byte j = q[8b + j] | q[8b + 4 + j] << 4)."""
    q = (unpack_int4(qweight) + 8).to(torch.uint8)  # stored nibbles [n, k]
    n, k = q.shape
    words, scale_parts = [], []
    for t0 in range(0, n // 16, 4):
        u = min(4, n // 16 - t0)
        rows = q[t0 * 16:(t0 + u) * 16].reshape(u, 16, k // 8, 8)
        packed = rows[..., :4] | (rows[..., 4:] << 4)  # [u, 16, blocks, 4]
        words.append(packed.permute(2, 0, 1, 3).reshape(-1))
        s = scales[t0 * 16:(t0 + u) * 16].reshape(u, 16, -1)
        scale_parts.append(s.permute(2, 0, 1).reshape(-1))
    return torch.cat(words).reshape(qweight.shape), torch.cat(scale_parts).reshape(scales.shape)


def gptq_block(pending, hinv, scales, clip, column, group_size, grid):
    """GPTQ's column loop over one block, column by column in PyTorch ops (pending and, for int4,
    scales updated in place, as the op does)."""
    q, errors = torch.zeros_like(pending), torch.zeros_like(pending)
    for i in range(pending.shape[1]):
        col = column + i
        if grid == "int4":
            g = col // group_size
            if col % group_size == 0:
                amax = pending[:, i:i + group_size].abs().amax(dim=1)
                if clip is not None:
                    amax = amax * clip[:, g]
                scales[:, g] = (amax / 7).clamp(min=1e-10)
            s = scales[:, g]
            q[:, i] = torch.round(pending[:, i] / s).clamp(-8, 7) * s
        elif grid == "int8":
            q[:, i] = torch.round(pending[:, i] / scales).clamp(-127, 127) * scales
        else:
            q[:, i] = (pending[:, i] / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales
        errors[:, i] = (pending[:, i] - q[:, i]) / hinv[i, i]
        pending[:, i:] -= errors[:, i:i + 1] * hinv[i:i + 1, i:]
    return q, errors


def fake_quant_int4(w, column_scales, group_size, ratio=1.0):
    """In PyTorch ops, as quantize/formats.py's int4 grid: (w x s) grouped, scale = absmax x
    ratio / 7, round, clamp, times the scale, / s."""
    v = w if column_scales is None else w * column_scales
    n, k = v.shape
    groups = -(-k // group_size)
    grouped = torch.nn.functional.pad(v, (0, groups * group_size - k)).reshape(n, groups, group_size)
    scale = (grouped.abs().amax(dim=2) * ratio / 7).clamp(min=1e-10)
    q = (torch.round(grouped / scale[:, :, None]).clamp(-8, 7) * scale[:, :, None]).reshape(n, -1)[:, :k]
    return q if column_scales is None else q / column_scales
