"""Loading the plugin library and the fake (meta) implementations of its ops.

The ops are C++ `TORCH_LIBRARY(kiln, ...)` ops so a fresh process (tritonserver's Python
stub, an AOTInductor package) finds them after `load_library`. Fake implementations give
shapes and strides without computing, for tracing and export."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

OPS = ("rms_norm", "add_rms_norm", "silu_mul", "linear", "paged_attention", "select_isa", "active_isa", "linear_w8",
       "linear_w4", "dequantize_int4", "linear_w8a8", "linear_w4a8", "linear_fp8", "quantize_fp8", "dequantize_fp8",
       "pack_int4_tiled", "linear_w4_tiled", "linear_w4a8_tiled", "dequantize_int4_tiled", "pack_int8_tiled",
       "linear_w8_tiled", "dequantize_int8_tiled", "to_hugepages", "decode_layers")
_loaded: dict[str, str] = {}  # sha256 of the library file -> path it was loaded from


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_library(path: str | Path) -> None:
    """Load a compiled plugin library once per process.

    The `kiln` op namespace can be registered only once, so a second, different library in the
    same process is an error rather than a silent mix of kernels."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"plugin library {path} is missing")
    digest = _sha256(path)
    if digest in _loaded:
        return
    if _loaded:
        raise RuntimeError(
            f"a different kiln plugin library is already loaded in this process "
            f"({next(iter(_loaded.values()))}); serve engines built by one kiln version per process"
        )
    torch.ops.load_library(str(path))
    _loaded[digest] = str(path)
    missing = [op for op in OPS if not hasattr(torch.ops.kiln, op)]
    if missing:
        raise RuntimeError(f"the plugin library {path} lacks the ops {missing}: it was built by another "
                           f"version of kiln")
    _register_fakes()


def _register_fakes() -> None:
    @torch.library.register_fake("kiln::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::add_rms_norm")
    def _add_rms_norm_fake(residual, x, weight, eps):
        return torch.empty_like(residual, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("kiln::linear")
    def _linear_fake(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("kiln::linear_w8")
    def _linear_w8_fake(x, qweight, scales, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::linear_w4")
    def _linear_w4_fake(x, qweight, scales, group_size, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::dequantize_int4")
    def _dequantize_int4_fake(qweight, scales, group_size, dtype):
        return qweight.new_empty((qweight.shape[0], qweight.shape[1] * 2), dtype=dtype)

    @torch.library.register_fake("kiln::pack_int4_tiled")
    def _pack_int4_tiled_fake(qweight, scales, group_size):
        return torch.empty_like(qweight), torch.empty_like(scales)

    @torch.library.register_fake("kiln::linear_w4_tiled")
    def _linear_w4_tiled_fake(x, qweight, scales, group_size, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::to_hugepages")
    def _to_hugepages_fake(t):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::pack_int8_tiled")
    def _pack_int8_tiled_fake(qweight):
        return torch.empty_like(qweight, dtype=torch.uint8)

    @torch.library.register_fake("kiln::linear_w8_tiled")
    def _linear_w8_tiled_fake(x, qweight, scales, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::dequantize_int8_tiled")
    def _dequantize_int8_tiled_fake(qweight, scales, dtype):
        return qweight.new_empty(qweight.shape, dtype=dtype)

    @torch.library.register_fake("kiln::linear_w4a8_tiled")
    def _linear_w4a8_tiled_fake(x, qweight, scales, group_size, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::decode_layers")
    def _decode_layers_fake(h, x, tensors, ints, floats, kv, block_tables, query_start, context_lens, cos, sin,
                            heads, scale, eps, key_hadamard=0):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::dequantize_int4_tiled")
    def _dequantize_int4_tiled_fake(qweight, scales, group_size, dtype):
        return qweight.new_empty((qweight.shape[0], qweight.shape[1] * 2), dtype=dtype)

    @torch.library.register_fake("kiln::linear_w8a8")
    def _linear_w8a8_fake(x, qweight, scales, weight_sum, bias, input_scale=0.0):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::linear_w4a8")
    def _linear_w4a8_fake(x, qweight, scales, group_size, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::linear_fp8")
    def _linear_fp8_fake(x, qweight, scales, bias):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::quantize_fp8")
    def _quantize_fp8_fake(x, inv_scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::dequantize_fp8")
    def _dequantize_fp8_fake(qweight, dtype):
        return qweight.new_empty(qweight.shape, dtype=dtype)

    @torch.library.register_fake("kiln::paged_attention")
    def _paged_attention_fake(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin,
                              heads, scale, kv_scales=None, key_hadamard=0):
        return qkv.new_empty((qkv.shape[0], heads * k_pool.shape[3]))


def select_isa(isa: str) -> str:
    """Switch every kernel to one instruction set ('auto', 'avx512', 'avx2', 'scalar')."""
    return torch.ops.kiln.select_isa(isa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.kiln.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then rms_norm(residual)."""
    return torch.ops.kiln.add_rms_norm(residual, x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the fused [.., 2n] gate/up projection."""
    return torch.ops.kiln.silu_mul(gate_up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a few rows (decode steps): streams each weight row once."""
    return torch.ops.kiln.linear(x, weight, bias)


def paged_attention(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads: int,
                    scale: float, kv_scales: torch.Tensor | None = None, key_hadamard: int = 0) -> torch.Tensor:
    """Rotary embedding, the KV write into the pool, and causal GQA attention over each
    sequence's blocks, from the fused QKV projection; [tokens, heads * head_dim]
    (see csrc/attention.h for the layout). An int8 or float8_e4m3fn pool stores k / kv_scales[0]
    and v / kv_scales[1] (per channel, [2, kv_heads * head_dim]). key_hadamard: 0, or the block
    size of the Walsh-Hadamard transform applied to q and k after rotary embedding
    (runtime/key_rotation.py): the pool then holds transformed keys."""
    return torch.ops.kiln.paged_attention(qkv, k_pool, v_pool, block_tables, query_start, context_lens,
                                          cos, sin, heads, scale, kv_scales, key_hadamard)


def linear_w8(x, qweight, scales, bias=None) -> torch.Tensor:
    """x @ (qweight * scales[:, None]).T (+ bias): int8 weights, one scale per output channel."""
    return torch.ops.kiln.linear_w8(x, qweight, scales, bias)


def linear_w4(x, qweight, scales, group_size: int, bias=None) -> torch.Tensor:
    """x @ dequantize_int4(qweight, scales, group_size).T (+ bias), streaming the packed weights."""
    return torch.ops.kiln.linear_w4(x, qweight, scales, group_size, bias)


def dequantize_int4(qweight, scales, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] from int4 packed two per byte along `in` (low nibble first, offset by 8)."""
    return torch.ops.kiln.dequantize_int4(qweight, scales, group_size, dtype)


TILE_ROWS, TILED_MAX_GROUP = 16, 8192  # quant.h: kTileRows, kTiledMaxGroup

# decode_layers' linear kinds (kiln_ops.cpp LinearKind) and the tensors each linear brings
(KIND_DENSE, KIND_INT8, KIND_INT4, KIND_INT4_TILED, KIND_W4A8, KIND_W4A8_TILED, KIND_W8A8,
 KIND_FP8, KIND_INT8_TILED) = range(9)
TILED_INT8_ISAS = ("avx512", "avx512bf16")  # where linear_w8_tiled beats the row layout (elsewhere: a plain loop)
LINEAR_SLOTS = 5  # weight or qweight, scales, bias, pre_scale, weight_sum (None where unused)
LAYER_SLOTS = 4 * LINEAR_SLOTS + 3  # qkv, out, gate_up, down; post-attention norm, next norm, kv_scales


def decode_layers(h, x, plan: tuple, kv, block_tables, query_start, context_lens, cos, sin, heads: int,
                  scale: float, eps: float, key_hadamard: int = 0) -> torch.Tensor:
    """Every decoder layer of a step of a few rows in one call (LlamaModel.forward's loop with
    the same kernels in the same order): h, the residual stream, is updated in place; returns
    the last layer's output after the next norm. plan: (tensors, ints, floats), LAYER_SLOTS
    tensors, 8 ints (kind, group_size per linear) and 8 floats (the W8A8 static input scale and
    the FP8 activations' 1 / input_scale per linear) per layer. kv: the KV pool's storage
    [layers, 2, blocks, block_size, kv_heads, head_dim]; key_hadamard as for paged_attention."""
    return torch.ops.kiln.decode_layers(h, x, *plan, kv, block_tables, query_start, context_lens, cos, sin,
                                        heads, scale, eps, key_hadamard)


def int4_tiles_fit(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an int4 weight of this shape can take the tiled layout (linear_w4_tiled)."""
    return (out_features % TILE_ROWS == 0 and in_features % 8 == 0 and group_size % 8 == 0
            and 0 < group_size <= TILED_MAX_GROUP)


def pack_int4_tiled(qweight, scales, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored int4 weight [out, in / 2] and scales [out, groups] reordered for
    linear_w4_tiled (same shapes): rows in tiles of 16, four tiles' bytes interleaved per block
    of 8 inputs (quant.h explains the layout)."""
    return torch.ops.kiln.pack_int4_tiled(qweight, scales, group_size)


def linear_w4_tiled(x, qweight, scales, group_size: int, bias=None) -> torch.Tensor:
    """linear_w4 on weights and scales from pack_int4_tiled."""
    return torch.ops.kiln.linear_w4_tiled(x, qweight, scales, group_size, bias)


def to_hugepages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t in memory advised for 2 MB transparent huge pages: streamed weights
    take far fewer TLB misses (kiln_ops.cpp has the measurements)."""
    return torch.ops.kiln.to_hugepages(t)


def active_isa() -> str:
    """The instruction set the kernels run now (select_isa / KILN_ISA)."""
    return torch.ops.kiln.active_isa()


def int8_tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether an int8 weight of this shape can take the tiled layout (linear_w8_tiled)."""
    return out_features % TILE_ROWS == 0 and in_features % 4 == 0 and in_features > 0


def pack_int8_tiled(qweight) -> torch.Tensor:
    """int8 [out, in] -> the tiled layout linear_w8_tiled streams: uint8 (value + 128), rows in
    tiles of 16, four tiles interleaved per block of 4 inputs; the scales stay as they are."""
    return torch.ops.kiln.pack_int8_tiled(qweight)


def linear_w8_tiled(x, qweight, scales, bias=None) -> torch.Tensor:
    """linear_w8 on weights from pack_int8_tiled."""
    return torch.ops.kiln.linear_w8_tiled(x, qweight, scales, bias)


def dequantize_int8_tiled(qweight, scales, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] = qweight * scales[:, None] (rounded once to dtype) from weights from pack_int8_tiled."""
    return torch.ops.kiln.dequantize_int8_tiled(qweight, scales, dtype)


def linear_w4a8_tiled(x, qweight, scales, group_size: int, bias=None) -> torch.Tensor:
    """linear_w4a8 on weights and scales from pack_int4_tiled."""
    return torch.ops.kiln.linear_w4a8_tiled(x, qweight, scales, group_size, bias)


def dequantize_int4_tiled(qweight, scales, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] from weights and scales from pack_int4_tiled."""
    return torch.ops.kiln.dequantize_int4_tiled(qweight, scales, group_size, dtype)


def linear_w8a8(x, qweight, scales, weight_sum, bias=None, input_scale: float = 0.0) -> torch.Tensor:
    """SmoothQuant W8A8: x quantized per row to int8 (absmax / 127; or with one static input_scale),
    int8 x int8 -> int32, rescaled."""
    return torch.ops.kiln.linear_w8a8(x, qweight, scales, weight_sum, bias, input_scale)


def linear_w4a8(x, qweight, scales, group_size: int, bias=None) -> torch.Tensor:
    """int4 weights x int8 activations quantized per row and group at run time (W4A8)."""
    return torch.ops.kiln.linear_w4a8(x, qweight, scales, group_size, bias)


def linear_fp8(x, qweight, scales, bias=None) -> torch.Tensor:
    """x @ (qweight.float() * scales[:, None]).T (+ bias): FP8 E4M3 weights, one scale per output channel."""
    return torch.ops.kiln.linear_fp8(x, qweight, scales, bias)


def quantize_fp8(x, inv_scale: float) -> torch.Tensor:
    """x * inv_scale rounded to the nearest FP8 E4M3 value (saturating at +-448), in x's dtype."""
    return torch.ops.kiln.quantize_fp8(x, inv_scale)


def dequantize_fp8(qweight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn -> float32 / bfloat16, exactly (the scales are not applied)."""
    return torch.ops.kiln.dequantize_fp8(qweight, dtype)
