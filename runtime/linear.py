"""Linear layers of an engine, dense or quantized, built from the engine's tensors.

    DenseLinear     weight [out, in] in the engine dtype
    Int8Linear      int8 weight, one scale per output channel; activations stay float (W8A16)
    Int4Linear      int4 weight, one scale per group of `group_size` inputs (W4A16), tiled at load
    W4A8Linear      int4 weight and int8 activations quantized per row and group at run time
    W8A8Linear      int8 weight and int8 activations quantized per token at run time (SmoothQuant),
                    or with a static per-tensor scale (an imported Model Optimizer checkpoint)
    Fp8Linear       FP8 E4M3 weight, one scale per output channel; activations E4M3 (static scale)
    W4A8Fp8Linear   int4 weight, activations E4M3 (static scale): TensorRT-LLM's W4A8_AWQ

Each may carry a `pre_scale` [in] that multiplies the input first (AWQ / SmoothQuant scales
that could not be folded into a norm), and an `input_scale` (static per-tensor FP8
activations): x / input_scale is rounded to E4M3, which bf16 holds exactly, and input_scale
is folded into the weight scales once at load.

Each linear runs either kiln's kernel on the packed weights (`gemv`, which reads them once a
step for all its rows) or the dense route (the weights dequantized, then PyTorch's GEMM: gemm(),
in float32 for bf16 where PyTorch has no fast bf16 GEMM). Which one, at each row count, is the
linear's Tactic: timed on the build host (builder/tactics.py, engine.json "tactics") and set at
load by LlamaModel.apply_tactics; without one, the kind's default (`kernel_rows`: up to how many
rows the kernel runs, from measurements on an AVX2 CPU, docs/benchmarks.md "Linears at many rows").
kiln's kernels give each row the same bits whatever the other rows; PyTorch's GEMM does not promise
that, so only a linear that takes the kernel at every row count is batch invariant.

Engines store weights in the row layouts (plugins/formats.py); int4 and int8 weights are
re-laid out at load into the tiled layouts of the kernels the host runs (ops.tiled: which ones
depends on the instruction set), so one engine file serves every x86-64 CPU.

plan() describes a linear to ops.decode_layers as one record by name (ops.decode_plan)."""
from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.plugins import ops

FP8_ACTIVATION_KINDS = (names.LINEAR_FP8, names.LINEAR_W4A8_FP8)
SKINNY_ROWS = 8  # without a tactic: how many rows a kind's kernel takes where it sets no other bound
WIDEN_BLOCK = 1 << 18  # weights gemm() widens to float32 at a time (1 MB, within the caches, never a whole copy)


def native_bf16_gemm() -> bool:
    """Whether PyTorch's bf16 GEMM runs at full speed: on CPUs with AVX-512 BF16 (kiln's kernels at
    that level; KILN_ISA below it takes the float32 route, so tests exercise that on any host).
    Elsewhere it widens in a slow path: on an AVX2 CPU (AMD EPYC, Zen 3) a 128-token prefill
    took 3.7-5.5x as long through it as through gemm()'s float32 route (docs/benchmarks.md,
    "An AVX2-only CPU")."""
    return ops.active_isa() in ("avx512bf16", "avx512amx")


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for many rows, by PyTorch's GEMM. bf16 without a native bf16 GEMM:
    in float32, a block of weight rows widened at a time (exact), each output rounded once to
    bf16 as the bf16 GEMM rounds its float32 sums; only the order of the sums differs."""
    if x.dtype != torch.bfloat16 or native_bf16_gemm():
        return F.linear(x, weight, bias)
    xf = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    step = max(16, WIDEN_BLOCK // weight.shape[1])
    for i in range(0, weight.shape[0], step):
        part = None if bias is None else bias[i:i + step].float()
        out[:, i:i + step] = F.linear(xf, weight[i:i + step].float(), part)
    return out


class Tactic:
    """Which implementation one linear shape runs at each row count: `choices[i]` (TACTIC_KILN or
    TACTIC_TORCH) for rows up to `buckets[i]` (ascending) and above the one before; rows beyond the
    last bucket take the last choice."""

    def __init__(self, buckets: list[int], choices: list[str]):
        if not buckets or len(buckets) != len(choices) or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"a tactic needs ascending row buckets from 1 and one choice each, got {buckets} / "
                             f"{choices}")
        unknown = set(choices) - {names.TACTIC_KILN, names.TACTIC_TORCH}
        if unknown:
            raise ValueError(f"unknown tactic choice {sorted(unknown)}; expected {names.TACTIC_KILN} or "
                             f"{names.TACTIC_TORCH}")
        self.buckets, self.choices = list(buckets), list(choices)

    def choice(self, rows: int) -> str:
        return self.choices[min(bisect_left(self.buckets, rows), len(self.buckets) - 1)]

    def kernel_through(self) -> float:
        """The most rows r such that every row count from 1 to r takes kiln's kernel (inf: every
        count, as rows beyond the last bucket take its choice; 0: not even one row)."""
        through = 0
        for bucket, choice in zip(self.buckets, self.choices):
            if choice != names.TACTIC_KILN:
                return through
            through = bucket
        return float("inf")


def tactics_from_json(section: dict) -> dict[str, Tactic]:
    """engine.json's tactics (builder/tactics.py) as tactic_key -> Tactic."""
    return {key: Tactic(entry["buckets"], entry["choices"]) for key, entry in section["linears"].items()}


class Routed:
    """What every linear shares: the route a row count takes (its Tactic, else `kernel_rows`)."""

    kernel_rows: float = SKINNY_ROWS  # without a tactic: up to this many rows take the kernel
    tactic: Tactic | None = None

    def candidates(self) -> tuple[str, ...]:
        """The implementations a tactic chooses among: kiln's kernel and the dense route where
        they give the same accuracy (bf16 activations); none where a linear has one route (float32
        dense: PyTorch's GEMM only; float32 quantized: the routes differ in accuracy, the default
        route stands)."""
        return (names.TACTIC_KILN, names.TACTIC_TORCH) if self.dtype == torch.bfloat16 else ()

    def uses_kernel(self, rows: int) -> bool:
        if self.tactic is not None:
            return self.tactic.choice(rows) == names.TACTIC_KILN
        return rows <= self.kernel_rows

    def fused_through(self) -> float:
        """Up to how many rows (every count from 1) decode_layers computes it as __call__ does:
        where it runs the kernel (its Tactic's bound, else `kernel_rows`)."""
        return self.kernel_rows if self.tactic is None else self.tactic.kernel_through()

    def run(self, x: torch.Tensor, choice: str) -> torch.Tensor:
        """x through one implementation (a tactic's candidate), as __call__ runs it."""
        raise NotImplementedError


class DenseLinear(Routed):
    """Where the host multiplies bf16 pairs (AVX512-BF16's vdpbf16ps or AMX tiles: ops.tiled("bf16")),
    a bf16 weight whose shape allows it is reordered once, at load, into the tiled layout
    (ops.pack_bf16_tiled; the engine file keeps [out, in]; a tied output projection gets its own
    copy beside the embedding table), and every row count takes linear_bf16_tiled: one route, so
    no tactic applies."""

    streamed_attr = "weight"  # the tensor a GEMV streams (runtime/weight_arena.py)
    # bf16, AVX2 (AMD EPYC, Zen 3, one thread): the kernel 1.11-1.29x PyTorch's at 64 rows (the output
    # projection 0.93x), 0.96-1.06x at 128, 0.87-0.94x at 256 (docs/benchmarks.md, the bf16 lanes)
    kernel_rows = 64

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        out_features, in_features = weight.shape
        self.tiled = (weight.dtype == torch.bfloat16 and ops.tiled("bf16")
                      and ops.bf16_tiles_fit(out_features, in_features))
        if self.tiled:
            self.weight, self.kernel_rows = ops.pack_bf16_tiled(weight), float("inf")

    @property
    def features(self) -> tuple[int, int]:
        """(in, out)"""
        return self.weight.shape[1], self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def tactic_key(self) -> str:
        """What tactics are chosen by (builder/tactics.py): the implementation, dtype and shape."""
        in_features, out_features = self.features
        kind = "dense_tiled" if self.tiled else "dense"
        return f"{kind} {str(self.dtype).removeprefix('torch.')} {in_features}x{out_features}"

    def candidates(self) -> tuple[str, ...]:
        return () if self.tiled else super().candidates()

    def fused_through(self) -> float:
        """float32: decode_layers takes PyTorch's GEMM too, at every row count."""
        return float("inf") if self.dtype != torch.bfloat16 else super().fused_through()

    def plan(self) -> dict:
        """This linear as a record of ops.decode_plan."""
        return {"kind": "dense_tiled" if self.tiled else "dense", "weight": self.weight, "bias": self.bias}

    def run(self, x: torch.Tensor, choice: str) -> torch.Tensor:
        if self.tiled:  # the one route (the weight is not [out, in] for PyTorch's GEMM)
            return ops.linear_bf16_tiled(x, self.weight, self.bias)
        if choice == names.TACTIC_KILN and x.dtype == torch.bfloat16:
            return ops.linear(x, self.weight, self.bias)
        return gemm(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 rows go to kiln's GEMV (which streams the weights once at memory bandwidth: 2-3x
        PyTorch's at one row) where the route says; float32 always uses PyTorch's GEMM."""
        kernel = x.dtype == torch.bfloat16 and self.uses_kernel(x.shape[0])
        return self.run(x, names.TACTIC_KILN if kernel else names.TACTIC_TORCH)


class QuantLinear(Routed):
    """Rows the route sends to the kernel go to `gemv`; others are computed by dequantizing the
    weight once and PyTorch's GEMM (`dense`)."""

    kind = ""  # engine.json's quantization.linear
    streamed_attr = "qweight"  # as DenseLinear's
    plan_kind = ""  # how decode_layers runs it (ops.decode_plan's linear kinds)
    values_per_byte = 1  # of qweight's stored [out, in / values_per_byte]
    # float32 activations: the W4A16 / W8A16 / FP8 kernels hold a row in 15 bits (less than float32
    # keeps; more than bf16 does), so many rows take the exact dense route unless a tactic says otherwise
    float32_kernel_rows: float = SKINNY_ROWS

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 pre_scale: torch.Tensor | None, dtype: torch.dtype, group_size: int = 0,
                 weight_sum: torch.Tensor | None = None, input_scale: torch.Tensor | None = None):
        self.qweight, self.scales, self.bias, self.dtype = qweight, scales, bias, dtype
        self.pre_scale = None if pre_scale is None else pre_scale.to(dtype)  # activations are in dtype
        self.group_size, self.weight_sum = group_size, weight_sum
        self.features = (qweight.shape[1] * self.values_per_byte, qweight.shape[0])  # (in, out), before any tiling
        if dtype == torch.float32:
            self.kernel_rows = self.float32_kernel_rows
        self.input_scale = self.inv_input_scale = None
        if input_scale is not None:
            self.input_scale = float(input_scale.reshape(-1)[0])
            if not self.input_scale > 0:
                raise ValueError(f"input_scale must be positive, got {self.input_scale}")
        if self.kind in FP8_ACTIVATION_KINDS and self.input_scale is not None:
            self.inv_input_scale = 1 / self.input_scale
            self.scales = (scales * self.input_scale).contiguous()

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tactic_key(self) -> str:
        """As DenseLinear.tactic_key (int4: the packed width, even)."""
        group = f" g{self.group_size}" if self.group_size else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.plan_kind} {dtype} {self.features[0]}x{self.features[1]}{group}"

    def plan(self) -> dict:
        """As DenseLinear.plan; decode_layers does what __call__ does for a few rows."""
        return {"kind": self.plan_kind, "weight": self.qweight, "scales": self.scales, "bias": self.bias,
                "pre_scale": self.pre_scale, "weight_sum": self.weight_sum, "group_size": self.group_size,
                "input_scale": self.input_scale or 0.0, "inv_input_scale": self.inv_input_scale or 0.0}

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return gemm(x, self.dequantize(), self.bias)

    def run(self, x: torch.Tensor, choice: str) -> torch.Tensor:
        if self.pre_scale is not None:
            x = x * self.pre_scale
        if self.inv_input_scale is not None:
            x = ops.quantize_fp8(x, self.inv_input_scale)
        return self.gemv(x) if choice == names.TACTIC_KILN else self.dense(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, names.TACTIC_KILN if self.uses_kernel(x.shape[0]) else names.TACTIC_TORCH)


class TiledInt8:
    """int8 weights [out, in] are reordered once, at load, into the tiled int8 layout
    (ops.pack_int8_tiled; the engine file keeps [out, in]) where the host's kernels for the kind
    take it (ops.tiled(tiled_layout)) and the shape allows it (tiles_fit)."""

    tiled_layout = tiled_plan_kind = ""
    tiles_fit = staticmethod(ops.int8_tiles_fit)

    def tile(self) -> None:
        out_features, in_features = self.qweight.shape
        self.tiled = ops.tiled(self.tiled_layout) and self.tiles_fit(out_features, in_features)
        if self.tiled:
            self.qweight, self.plan_kind = ops.pack_int8_tiled(self.qweight), self.tiled_plan_kind


class Int8Linear(TiledInt8, QuantLinear):
    """Where the host's kernels prefer it (ops.tiled("int8")), the weights run linear_w8_tiled on
    the tiled layout (TiledInt8)."""

    kind = names.LINEAR_INT8
    plan_kind = "int8"
    tiled_layout, tiled_plan_kind = "int8", "int8_tiled"
    kernel_rows = float("inf")  # bf16, AVX2 (Zen 3): the kernel 1.3-1.5x dequantize + GEMM at 256 rows, 3.4-4.3x at 16

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile()

    def gemv(self, x):
        if self.tiled:
            return ops.linear_w8_tiled(x, self.qweight, self.scales, self.bias)
        return ops.linear_w8(x, self.qweight, self.scales, self.bias)

    def dequantize(self) -> torch.Tensor:
        if self.tiled:
            return ops.dequantize_int8_tiled(self.qweight, self.scales, self.dtype)
        if self.dtype == torch.bfloat16:  # one bf16 pass (int8 is exact in bf16): 3x the float32 route
            return self.qweight.to(torch.bfloat16) * self.scales.to(torch.bfloat16)[:, None]
        return self.qweight.to(self.dtype) * self.scales[:, None].to(self.dtype)


class TiledInt4:
    """Int4 weights whose shape allows it are reordered once, at load, into the tiled layout
    kiln's int4 kernels stream (ops.pack_int4_tiled; the engine file keeps the stored layout)."""

    def tile(self) -> None:
        out_features, in_features = self.qweight.shape[0], self.qweight.shape[1] * 2
        self.tiled = ops.tiled("int4") and ops.int4_tiles_fit(out_features, in_features, self.group_size)
        if self.tiled:
            self.qweight, self.scales = ops.pack_int4_tiled(self.qweight, self.scales, self.group_size)
            self.plan_kind = self.tiled_plan_kind


class Int4Linear(TiledInt4, QuantLinear):
    kind = names.LINEAR_INT4
    plan_kind, tiled_plan_kind = "int4", "int4_tiled"
    values_per_byte = 2
    kernel_rows = float("inf")  # bf16, AVX2 (Zen 3): the kernel 1.8-2.3x dequantize + GEMM at 128 rows, 6-10x at 16

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile()

    def gemv(self, x):
        if self.tiled:
            return ops.linear_w4_tiled(x, self.qweight, self.scales, self.group_size, self.bias)
        return ops.linear_w4(x, self.qweight, self.scales, self.group_size, self.bias)

    def dequantize(self) -> torch.Tensor:
        if self.tiled:  # straight into the model dtype, one rounding
            return ops.dequantize_int4_tiled(self.qweight, self.scales, self.group_size, self.dtype)
        return ops.dequantize_int4(self.qweight, self.scales, self.group_size).to(self.dtype)


class W4A8Linear(TiledInt4, QuantLinear):
    """int4 weights, int8 activations per row and group: every row count takes the kernel, so
    decode and prefill compute the same way."""

    kind = names.LINEAR_W4A8
    plan_kind, tiled_plan_kind = "w4a8", "w4a8_tiled"
    values_per_byte = 2
    kernel_rows = float32_kernel_rows = float("inf")  # int8 activations are the algorithm: no other route

    def candidates(self) -> tuple[str, ...]:
        return ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile()

    def gemv(self, x):
        op = ops.linear_w4a8_tiled if self.tiled else ops.linear_w4a8
        return op(x, self.qweight, self.scales, self.group_size, self.bias)


class W8A8Linear(TiledInt8, QuantLinear):
    """Activations int8 per row at run time, or with one static input_scale when the engine has
    one (Model Optimizer's W8A8_SQ_PER_CHANNEL checkpoints). Where the host multiplies int8 with
    AVX-512 VNNI (ops.tiled("w8a8"); AMX tiles too where it has them), the weights take the tiled
    int8 layout (TiledInt8) and run linear_w8a8_tiled: the same outputs, bit for bit."""

    kind = names.LINEAR_W8A8
    plan_kind = "w8a8"
    tiled_layout, tiled_plan_kind = "w8a8", "w8a8_tiled"
    tiles_fit = staticmethod(ops.w8a8_tiles_fit)
    kernel_rows = float32_kernel_rows = float("inf")  # int8 activations are the algorithm: no other route

    def candidates(self) -> tuple[str, ...]:
        return ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile()

    def gemv(self, x):
        if self.tiled:
            return ops.linear_w8a8_tiled(x, self.qweight, self.scales, self.bias, self.input_scale or 0.0)
        return ops.linear_w8a8(x, self.qweight, self.scales, self.weight_sum, self.bias, self.input_scale or 0.0)


class Fp8Linear(QuantLinear):
    """Prefill multiplies the E4M3 values themselves (exact in bf16) and scales the outputs, so
    every product is exact as in the decode kernel."""

    kind = names.LINEAR_FP8
    plan_kind = "fp8"
    kernel_rows = 64  # bf16, AVX2 (Zen 3): the kernel 1.0-1.15x dequantize + GEMM at 64 rows, 0.5x at 256

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dense_scales = self.scales.to(self.dtype)  # once, not per prefill step

    def gemv(self, x):
        return ops.linear_fp8(x, self.qweight, self.scales, self.bias)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        out = gemm(x, ops.dequantize_fp8(self.qweight, x.dtype)) * self.dense_scales
        return out if self.bias is None else out + self.bias


class W4A8Fp8Linear(Int4Linear):
    kind = names.LINEAR_W4A8_FP8


QUANT_LINEARS = {cls.kind: cls for cls in (Int8Linear, Int4Linear, W4A8Linear, W8A8Linear, Fp8Linear,
                                           W4A8Fp8Linear)}


def load_linear(weights: dict[str, torch.Tensor], weight_name: str, dtype: torch.dtype, quant: dict,
                bias: torch.Tensor | None = None):
    """The linear stored under `weight_name` (dense) or its prefix (quantized)."""
    if weight_name in weights:
        return DenseLinear(weights[weight_name], bias)
    prefix = names.linear_prefix(weight_name)

    def part(name: str) -> torch.Tensor | None:
        return weights.get(names.linear_tensor(prefix, name))

    qweight, scales = part(names.QWEIGHT), part(names.WEIGHT_SCALES)
    if qweight is None or scales is None:
        raise KeyError(f"{weight_name}: neither a dense weight nor {names.QWEIGHT} + {names.WEIGHT_SCALES}")
    kind = quant.get("linear")
    if kind not in QUANT_LINEARS:
        raise KeyError(f"{weight_name}: unknown quantized linear kind {kind!r}")
    if kind in FP8_ACTIVATION_KINDS and part(names.INPUT_SCALE) is None:
        raise KeyError(f"{weight_name}: a {kind} linear needs {names.linear_tensor(prefix, names.INPUT_SCALE)}")
    return QUANT_LINEARS[kind](qweight, scales, bias, part(names.PRE_SCALE), dtype, quant.get("group_size", 0),
                               part(names.WEIGHT_SUM), part(names.INPUT_SCALE))
