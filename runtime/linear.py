"""Linear layers of an engine, dense or quantized, built from the engine's tensors.

    DenseLinear     weight [out, in] in the engine dtype
    Int8Linear      int8 weight, one scale per output channel; activations stay float (W8A16)
    Int4Linear      int4 weight, one scale per group of `group_size` inputs (W4A16)
    W4A8Linear      int4 weight and int8 activations quantized per row and group at run time
    W8A8Linear      int8 weight and int8 activations quantized per token at run time (SmoothQuant)

Each may carry a `pre_scale` [in] that multiplies the input first (AWQ / SmoothQuant scales
that could not be folded into a norm). Few rows (decode steps) go to kiln's kernels, which
stream the packed weights once; many rows (prefill) dequantize once and use PyTorch's GEMM."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.plugins import ops

SKINNY_ROWS = 8  # up to this many rows take the GEMV plugins (measured: 1.2x at 4 streams for bf16)


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A few bf16 rows go to kiln's GEMV, which streams the weights once at memory bandwidth
        (2-3x PyTorch's at one row here); float32 always uses PyTorch's GEMM, whose results do
        not depend on the batch size."""
        if x.shape[0] <= SKINNY_ROWS and x.dtype == torch.bfloat16:
            return ops.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class QuantLinear:
    kind = ""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 pre_scale: torch.Tensor | None, dtype: torch.dtype):
        self.qweight, self.scales, self.bias, self.pre_scale, self.dtype = qweight, scales, bias, pre_scale, dtype

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.pre_scale is None else x * self.pre_scale.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._input(x), self.dequantize(), self.bias)


class Int8Linear(QuantLinear):
    kind = "int8_wo"

    def dequantize(self) -> torch.Tensor:
        if self.dtype == torch.bfloat16:  # one bf16 pass (int8 is exact in bf16): 3x the float32 route
            return self.qweight.to(torch.bfloat16) * self.scales.to(torch.bfloat16)[:, None]
        return self.qweight.to(self.dtype) * self.scales[:, None].to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input(x)
        if x.shape[0] <= SKINNY_ROWS:
            return ops.linear_w8(x, self.qweight, self.scales, self.bias)
        return F.linear(x, self.dequantize(), self.bias)


class Int4Linear(QuantLinear):
    kind = "int4"

    def __init__(self, qweight, scales, bias, pre_scale, dtype, group_size: int):
        super().__init__(qweight, scales, bias, pre_scale, dtype)
        self.group_size = group_size

    def dequantize(self) -> torch.Tensor:
        return ops.dequantize_int4(self.qweight, self.scales, self.group_size).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input(x)
        if x.shape[0] <= SKINNY_ROWS:
            return ops.linear_w4(x, self.qweight, self.scales, self.group_size, self.bias)
        return F.linear(x, self.dequantize(), self.bias)


class W4A8Linear(Int4Linear):
    """int4 weights, int8 activations per row and group (every row count: decode and prefill
    compute the same way)."""

    kind = "w4a8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_w4a8(self._input(x), self.qweight, self.scales, self.group_size, self.bias)


class W8A8Linear(QuantLinear):
    kind = "w8a8"

    def __init__(self, qweight, scales, bias, pre_scale, dtype, weight_sum: torch.Tensor):
        super().__init__(qweight, scales, bias, pre_scale, dtype)
        self.weight_sum = weight_sum

    def dequantize(self) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_w8a8(self._input(x), self.qweight, self.scales, self.weight_sum, self.bias)


def load_linear(weights: dict[str, torch.Tensor], weight_name: str, dtype: torch.dtype, quant: dict,
                bias: torch.Tensor | None = None):
    """The linear stored under `weight_name` (dense) or its prefix (quantized)."""
    if weight_name in weights:
        return DenseLinear(weights[weight_name], bias)
    prefix = names.linear_prefix(weight_name)

    def part(name: str) -> torch.Tensor | None:
        return weights.get(names.linear_tensor(prefix, name))

    qweight, scales, pre_scale = part(names.QWEIGHT), part(names.WEIGHT_SCALES), part(names.PRE_SCALE)
    if qweight is None or scales is None:
        raise KeyError(f"{weight_name}: neither a dense weight nor {names.QWEIGHT} + {names.WEIGHT_SCALES}")
    kind = quant.get("linear")
    if kind == "int8_wo":
        return Int8Linear(qweight, scales, bias, pre_scale, dtype)
    if kind == "int4":
        return Int4Linear(qweight, scales, bias, pre_scale, dtype, quant["group_size"])
    if kind == "w4a8":
        return W4A8Linear(qweight, scales, bias, pre_scale, dtype, quant["group_size"])
    if kind == "w8a8":
        return W8A8Linear(qweight, scales, bias, pre_scale, dtype, part(names.WEIGHT_SUM))
    raise KeyError(f"{weight_name}: unknown quantized linear kind {kind!r}")
