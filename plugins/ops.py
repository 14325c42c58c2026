"""The plugin library's ops from Python: loading the library, each op's fake (meta)
implementation, and the decode plan's layout.

The ops are C++ `TORCH_LIBRARY(kiln, ...)` ops (csrc/op_table.h declares each one's name and
schema) so a fresh process (tritonserver's Python stub, an AOTInductor package) finds them after
`load_library`. Each op is declared here once, by its fake: a function with the op's name and
signature that gives the output's shape and strides without computing (for tracing and export).
`@op` registers it as the fake and returns the function callers use, which runs the C++ op.
Loading the library checks that its ops and the fakes here are the same set (library_info)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

_loaded: dict[str, str] = {}  # sha256 of the library file -> path it was loaded from
_FAKES: dict[str, Callable] = {}  # op name -> its fake implementation
_HOST_OPS: set[str] = set()  # ops on the library itself (strings only, no fake)
_INFO: dict = {}  # the loaded library's library_info()


def op(fake: Callable) -> Callable:
    """Declare the kiln op named like `fake`, with `fake` as its meta implementation; returns the
    function that runs the op (the same arguments, defaults from the C++ schema)."""
    name = fake.__name__
    _FAKES[name] = fake

    def call(*args, **kwargs):
        return getattr(torch.ops.kiln, name)(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = name, name, fake.__doc__
    return call


def host_op(function: Callable) -> Callable:
    """Declare a kiln op on the library itself (strings and ints in and out, nothing to fake)."""
    name = function.__name__
    _HOST_OPS.add(name)

    def call(*args):
        return getattr(torch.ops.kiln, name)(*args)

    call.__name__, call.__qualname__, call.__doc__ = name, name, function.__doc__
    return call


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
    if not hasattr(torch.ops.kiln, "library_info"):
        raise RuntimeError(f"the plugin library {path} was built by another version of kiln")
    info = json.loads(torch.ops.kiln.library_info())
    if set(info["ops"]) != set(_FAKES) or set(info["host_ops"]) != _HOST_OPS:
        raise RuntimeError(
            f"the plugin library {path} was built by another version of kiln: its ops "
            f"{sorted(set(info['ops']) ^ set(_FAKES) | set(info['host_ops']) ^ _HOST_OPS)} differ from this "
            f"kiln's")
    _INFO.update(info)
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"kiln::{name}")(fake)


def library_info() -> dict:
    """What the loaded library declares (csrc/library.cpp): ops, host_ops, decode_plan,
    tile_rows, tiled_max_group, w8a8_tiled_max_in."""
    if not _INFO:
        raise RuntimeError("no kiln plugin library is loaded (ops.load_library)")
    return _INFO


# --- ops on the library itself ------------------------------------------------------------
@host_op
def select_isa(isa: str) -> str:
    """Switch every kernel to one instruction set ('auto', 'avx512amx', 'avx512bf16', 'avx512',
    'avx2vnni', 'avx2', 'scalar'); returns the one chosen."""


@host_op
def active_isa() -> str:
    """The instruction set the kernels run now (select_isa / KILN_ISA)."""


@host_op
def tiled_layouts() -> str:
    """The weight layouts to make at load for the active instruction set, comma-separated
    ('int4,int8,bf16,w8a8': all four tiled; csrc/kernels/select.h decides)."""


@host_op
def set_prefetch(nbytes: int) -> int:
    """Set how many bytes ahead of their reads the GEMVs prefetch their weights (0: no software
    prefetch; KILN_PREFETCH_BYTES sets it at load, default 4096); returns the previous value."""


@host_op
def step_clock(on: bool) -> str:
    """What decode_layers' phases (linears, attention, norms, activation, experts, and the whole
    step) took since the previous call, as JSON {"calls": steps, "seconds": {phase: total}}; clears
    the totals and turns the clock on or off (off by default; benchmarks/ablations/decode_profile.py)."""


@host_op
def set_decode_team(on: bool) -> bool:
    """Whether decode_layers keeps a step's threads in one OpenMP region for the whole step (on by
    default; KILN_DECODE_TEAM=0 turns it off at load) or forks and joins them for every kernel as
    outside it; the results are the same bits. Returns the previous setting."""


_HOST_OPS.add("library_info")  # read once at load: library_info() below


def tiled(weight: str) -> bool:
    """Whether `weight` ('int4', 'int8', 'bf16' or 'w8a8': W8A8's int8 weights) takes the tiled
    layout on the active ISA."""
    return weight in tiled_layouts().split(",")


# --- norms, activations, dense ------------------------------------------------------------
@op
def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (rounded as Hugging Face's RMSNorm)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@op
def add_rms_norm(residual, x, weight, eps):
    """residual += x (in place), then rms_norm(residual)."""
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@op
def silu_mul(gate_up):
    """silu(gate) * up over the fused [.., 2n] gate/up projection."""
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@op
def gelu_tanh_mul(gate_up):
    """gelu(gate, approximate="tanh") * up over the fused [.., 2n] gate/up projection (GeGLU)."""
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@op
def linear(x, weight, bias=None):
    """x @ weight.T (+ bias) for a few rows (decode steps): streams each weight row once."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@op
def linear_bf16_tiled(x, weight, bias=None):
    """x @ weight.T (+ bias) for bf16 rows, any number of them, on a weight from pack_bf16_tiled
    (vdpbf16ps on the avx512bf16 level, AMX tiles on avx512amx: each row's bits do not depend on
    the other rows)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# --- attention ----------------------------------------------------------------------------
@op
def paged_attention(qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads, scale,
                    kv_scales=None, key_hadamard=0, window=0):
    """Rotary embedding, the KV write into the pool, and causal GQA attention over each
    sequence's blocks, from the fused QKV projection; [tokens, heads * head_dim]
    (csrc/kernels/attention.h has the layout). An int8 or float8_e4m3fn pool stores
    k / kv_scales[0] and v / kv_scales[1] (per channel, [2, kv_heads * head_dim]). key_hadamard:
    0, or the block size of the Walsh-Hadamard transform applied to q and k after rotary
    embedding (formats.hadamard_transform): the pool then holds transformed keys. window: 0, or
    a sliding window W: a token at position p attends to positions (p - W, p] only."""
    return qkv.new_empty((qkv.shape[0], heads * k_pool.shape[3]))


@op
def decode_layers(h, x, tensors, ints, floats, kv, kv_layers, block_tables, query_start, context_lens, cos, sin,
                  heads, scale, eps, key_hadamard=0):
    """Every decoder layer of a step of a few rows in one call (LlamaModel.forward's loop with
    the same kernels in the same order): h, the residual stream, is updated in place; returns
    the last layer's output after the next norm. (tensors, ints, floats): the plan, from
    decode_plan. kv: the KV pool's storage [slots, 2, blocks, kv_heads, block_size, head_dim];
    kv_layers: int64 [layers, 2], each layer's slot of kv and its group of block_tables
    [groups, sequences, blocks] (layers with different sliding windows keep blocks of their own);
    key_hadamard as for paged_attention."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@op
def moe_mlp(x, router, tensors, ints, floats, top_k, normalize, round_weights, activation, shared_gate=None):
    """A Mixture-of-Experts MLP for a few rows: softmax of x @ router.T in float32, each row's
    top_k experts (their weights rescaled to sum to 1 if normalize, rounded to x's dtype if
    round_weights), each chosen expert once over its rows (activation: a code of the library's
    activations), weighted and added in expert order. (tensors, ints, floats): expert_plan's, of
    the router's experts and, where the plan has one more, a shared expert run on every row, its
    output (times sigmoid(x @ shared_gate.T) where given) added last."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- quantized linears --------------------------------------------------------------------
@op
def linear_w8(x, qweight, scales, bias=None):
    """x @ (qweight * scales[:, None]).T (+ bias): int8 weights, one scale per output channel."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def linear_w8_tiled(x, qweight, scales, bias=None):
    """linear_w8 on weights from pack_int8_tiled."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def dequantize_int8_tiled(qweight, scales, dtype=torch.float32):
    """[out, in] = qweight * scales[:, None] (rounded once to dtype) from weights from pack_int8_tiled."""
    return qweight.new_empty(qweight.shape, dtype=dtype)


@op
def linear_w4(x, qweight, scales, group_size, bias=None):
    """x @ dequantize_int4(qweight, scales, group_size).T (+ bias), streaming the packed weights."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def dequantize_int4(qweight, scales, group_size, dtype=torch.float32):
    """[out, in] from int4 packed two per byte along `in` (low nibble first, offset by 8)."""
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] * 2), dtype=dtype)


@op
def linear_w4_tiled(x, qweight, scales, group_size, bias=None):
    """linear_w4 on weights and scales from pack_int4_tiled."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def dequantize_int4_tiled(qweight, scales, group_size, dtype=torch.float32):
    """[out, in] from weights and scales from pack_int4_tiled."""
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] * 2), dtype=dtype)


@op
def linear_w8a8(x, qweight, scales, weight_sum, bias=None, input_scale=0.0):
    """SmoothQuant W8A8: x quantized per row to int8 (absmax / 127; or with one static
    input_scale), int8 x int8 -> int32, rescaled."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def linear_w8a8_tiled(x, qweight, scales, bias=None, input_scale=0.0):
    """linear_w8a8 on weights from pack_int8_tiled (the same outputs; no weight_sum)."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def linear_w4a8(x, qweight, scales, group_size, bias=None):
    """int4 weights x int8 activations quantized per row and group at run time (W4A8)."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def linear_w4a8_tiled(x, qweight, scales, group_size, bias=None):
    """linear_w4a8 on weights and scales from pack_int4_tiled."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def linear_fp8(x, qweight, scales, bias=None):
    """x @ (qweight.float() * scales[:, None]).T (+ bias): FP8 E4M3 weights, one scale per output channel."""
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@op
def quantize_fp8(x, inv_scale):
    """x * inv_scale rounded to the nearest FP8 E4M3 value (saturating at +-448), in x's dtype."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@op
def dequantize_fp8(qweight, dtype=torch.float32):
    """float8_e4m3fn -> float32 / bfloat16, exactly (the scales are not applied)."""
    return qweight.new_empty(qweight.shape, dtype=dtype)


# --- the build's weight rounding -------------------------------------------------------------
@op
def gptq_block(pending, hinv, scales, clip, column, group_size, grid):
    """GPTQ's column loop over one block of columns: pending [out, B] float32 (the block's
    columns as they stand; updated in place), hinv [B, B] (the block's part of the upper
    Cholesky factor of the inverse Gram matrix). Column by column: q = the column on its grid,
    error = (column - q) / hinv[i, i], the block's later columns -= error * hinv[i, :]. grid
    "int4": each group's scale (absmax x clip[:, g] / 7 as its columns stand at its first column,
    `column` being the block's first column overall) written into scales [out, groups]; "int8" /
    "fp8": fixed per-row scales [out]. -> (q [out, B], errors [out, B]); the same bits as
    reference.gptq_block."""
    return torch.empty_like(pending), torch.empty_like(pending)


@op
def fake_quant_int4(w, column_scales, group_size, ratio=1.0):
    """w [n, k] float32, times column_scales [k] where given, rounded to its int4 groups' grid
    and back (each group's scale max(absmax x ratio / 7, 1e-10)), then divided by the column
    scales again: an AWQ search's candidate weights in one pass; the same bits as
    reference.fake_quant_int4."""
    return torch.empty_like(w, memory_format=torch.contiguous_format)


# --- weight layouts made at load ------------------------------------------------------------
@op
def pack_int4_tiled(qweight, scales, group_size):
    """The stored int4 weight [out, in / 2] and scales [out, groups] reordered for
    linear_w4_tiled (same shapes): rows in tiles of 16, four tiles' bytes interleaved per block
    of 8 inputs (csrc/formats.h explains the layout)."""
    return torch.empty_like(qweight), torch.empty_like(scales)


@op
def pack_int8_tiled(qweight):
    """int8 [out, in] -> the tiled layout linear_w8_tiled streams: uint8 (value + 128), rows in
    tiles of 16, four tiles interleaved per block of 4 inputs; the scales stay as they are."""
    return torch.empty_like(qweight, dtype=torch.uint8)


@op
def pack_bf16_tiled(weight):
    """bf16 [out, in] -> the layout of AMX's B tiles linear_bf16_tiled streams (same shape):
    outputs in groups of 16, each group's inputs in pairs, a pair's two values side by side per
    output (csrc/formats.h explains the layout)."""
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


@op
def to_hugepages(t):
    """A contiguous copy of t in memory advised for 2 MB transparent huge pages: streamed weights
    take far fewer TLB misses (csrc/ops/layout_ops.h has the measurements)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def int4_tiles_fit(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an int4 weight of this shape can take the tiled layout (linear_w4_tiled)."""
    info = library_info()
    return (out_features % info["tile_rows"] == 0 and in_features % 8 == 0 and group_size % 8 == 0
            and 0 < group_size <= info["tiled_max_group"])


def int8_tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether an int8 weight of this shape can take the tiled layout (linear_w8_tiled)."""
    return out_features % library_info()["tile_rows"] == 0 and in_features % 4 == 0 and in_features > 0


def w8a8_tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether a W8A8 weight of this shape can take the tiled int8 layout (linear_w8a8_tiled)."""
    return int8_tiles_fit(out_features, in_features) and in_features <= library_info()["w8a8_tiled_max_in"]


def bf16_tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether a bf16 weight of this shape can take the tiled layout (linear_bf16_tiled)."""
    return out_features % library_info()["tile_rows"] == 0 and in_features % 32 == 0 and in_features > 0


# --- the decode plan -----------------------------------------------------------------------
def decode_plan(layers: list[dict]) -> tuple[list, list[int], list[float]]:
    """decode_layers' (tensors, ints, floats) from one record per layer, by name: each layer maps
    every name of the library's layer_linears to its linear's record, any name of layer_tensors
    to a tensor (absent: None), any of layer_ints to an int (absent: 0; `activation`: a name of
    the library's activations, absent: silu) and, for a Mixture-of-Experts layer (`experts` > 0,
    its dense linears left out), `expert_linears` to each expert's (gate_up, down) records,
    which go after every layer's record; a linear's record maps
    `kind` (a name of linear_kinds) and any of linear_tensors / linear_ints / linear_floats to
    its values (absent: None / 0). The positions come from the library
    (csrc/ops/decode_plan.h), so they cannot drift apart."""
    layout = library_info()["decode_plan"]
    activations = activation_codes()
    tensors, ints, floats = [], [], []
    experts = []  # every Mixture-of-Experts layer's experts, appended after the layers
    for index, layer in enumerate(layers):
        unknown = set(layer) - {*layout["layer_linears"], *layout["layer_tensors"], *layout["layer_ints"],
                                "expert_linears"}
        if unknown:
            raise KeyError(f"decode plan layer {index}: unknown entries {sorted(unknown)}")
        layer_experts = layer.get("expert_linears", [])
        if len(layer_experts) != layer.get("experts", 0):
            raise KeyError(f"decode plan layer {index}: {len(layer_experts)} expert_linears for experts "
                           f"{layer.get('experts', 0)}")
        experts += [(f"decode plan layer {index} expert {e}", pair) for e, pair in enumerate(layer_experts)]
        for name in layout["layer_linears"]:
            _add_linear(layer.get(name, {"kind": "dense"}) if layer_experts else layer[name],
                        f"decode plan layer {index} {name}", tensors, ints, floats)
        tensors += [layer.get(name) for name in layout["layer_tensors"]]
        activation = layer.get("activation", layout["activations"][0])
        if activation not in activations:
            raise KeyError(f"decode plan layer {index}: unknown activation {activation!r}; the library has "
                           f"{sorted(activations)}")
        ints += [activations[activation] if name == "activation" else int(layer.get(name, 0))
                 for name in layout["layer_ints"]]
    for where, pair in experts:
        for name, record in zip(("gate_up", "down"), pair):
            _add_linear(record, f"{where} {name}", tensors, ints, floats)
    return tensors, ints, floats


def expert_plan(experts: list[tuple[dict, dict]]) -> tuple[list, list[int], list[float]]:
    """moe_mlp's (tensors, ints, floats) from each expert's (gate_up, down) linear records, laid
    out as decode_plan lays out a linear."""
    tensors, ints, floats = [], [], []
    for e, pair in enumerate(experts):
        for name, record in zip(("gate_up", "down"), pair):
            _add_linear(record, f"expert plan {e} {name}", tensors, ints, floats)
    return tensors, ints, floats


def activation_codes() -> dict[str, int]:
    """The library's gated activations by name -> their codes."""
    return {name: code for code, name in enumerate(library_info()["decode_plan"]["activations"])}


def _add_linear(record: dict, where: str, tensors: list, ints: list, floats: list) -> None:
    """One linear's record appended to a plan's three lists, by the library's field names."""
    layout = library_info()["decode_plan"]
    kinds = {name: code for code, name in enumerate(layout["linear_kinds"])}
    fields = {*layout["linear_tensors"], *layout["linear_ints"], *layout["linear_floats"]}
    if set(record) - fields:
        raise KeyError(f"{where}: unknown fields {sorted(set(record) - fields)}")
    if record.get("kind") not in kinds:
        raise KeyError(f"{where}: unknown linear kind {record.get('kind')!r}; the library has {sorted(kinds)}")
    tensors += [record.get(field) for field in layout["linear_tensors"]]
    ints += [kinds[record["kind"]] if field == "kind" else int(record.get(field, 0)) for field in layout["linear_ints"]]
    floats += [float(record.get(field, 0.0)) for field in layout["linear_floats"]]
