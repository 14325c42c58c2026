"""The quantization algorithms, on the builder's packed float32 weights.

Per layer the four linears are qkv (input: the attention norm's output), out (the attention
output), gate_up (the MLP norm's output) and down (silu(gate) * up); a Mixture-of-Experts
layer has qkv, out and a gate_up and down per expert, each expert calibrated on the tokens
routed to it. A per-input-channel scale s turns x @ W.T into (x / s) @ (W * s).T; x / s is
folded where that is free: into the norm before qkv and gate_up, into the `up` rows before
down; for `out` and an expert's gate_up it is a `pre_scale` the runtime multiplies in (with
grouped-query attention it cannot be folded into the value rows; the norm before the experts
feeds the router and every expert). Then:

    int8_wo    round-to-nearest int8 per output channel (no calibration)
    int4_wo    round-to-nearest int4 per group (no calibration)
    int4_awq   AWQ: s = mean|x|^a, a searched on a grid to minimise the layer's output error
               on calibration rows; then each group's clipping range searched the same way
    w4a8_awq   int4_awq's weights; activations int8 per row and group at run time (W4A8), or
               FP8 E4M3 with a static per-tensor scale from calibration (w4a8_activations: fp8)
    int8_sq    SmoothQuant: s = max|x|^alpha / max|w|^(1 - alpha); int8 weights per channel,
               int8 activations per token at run time (W8A8)
    fp8        FP8 E4M3 weights per output channel (or per tensor), activations FP8 E4M3 with a
               static per-tensor scale; both scales searched on a grid below max / 448 for the
               least error weighted by the calibration activations (weights: sum_j E[x_j^2]
               (w_ij - q_ij)^2; activations: the squared error on the sampled rows)

kv_cache int8 / fp8 (with any of them, or alone): the KV cache stores k / s and v / s with one
scale per channel from calibration (max |k| / 127 or / 448); attention folds them back. With
key_rotation hadamard (auto: for fp8) the keys are stored times a Hadamard matrix after RoPE
(runtime/key_rotation.py), and their scales bound them as stored."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln import constants as names
from kiln.plugins import ops
from kiln.quantize.calibrate import HEAD_STATS, KVStats, LinearStats
from kiln.runtime.linear import FP8_ACTIVATION_KINDS
from kiln.runtime.model import EXPERT_LINEARS, expert_key
from kiln.quantize.formats import (
    FP8_MAX, fake_quant_fp8, group_view, int4_scales, int8_scales, quantize_fp8, quantize_int4,
    quantize_int8)
from kiln.runtime.spec import ModelSpec

LINEAR_KIND = {"int8_wo": names.LINEAR_INT8, "int4_wo": names.LINEAR_INT4, "int4_awq": names.LINEAR_INT4,
               "w4a8_awq": names.LINEAR_W4A8, "int8_sq": names.LINEAR_W8A8, "fp8": names.LINEAR_FP8}
INT4_KINDS = (names.LINEAR_INT4, names.LINEAR_W4A8, names.LINEAR_W4A8_FP8)
# quantization.lm_head -> the head's linear kind; int4 and w4a8 share the int4 head's weights
# (quantize_head_int4), w4a8 quantizing its input at run time too; w8a8 has int8 weights
# smoothed as SmoothQuant's (quantize_head_w8a8) and its input in int8 per row at run time
HEAD_KINDS = {"int8": names.LINEAR_INT8, "int4": names.LINEAR_INT4, "w4a8": names.LINEAR_W4A8,
              "w8a8": names.LINEAR_W8A8}
# Layer field -> the packed tensor it is stored as (runtime.model.LINEARS, in that order)
LINEAR_WEIGHTS = {"qkv": names.ATTN_QKV, "out": names.ATTN_OUT, "gate_up": names.MLP_GATE_UP,
                  "down": names.MLP_DOWN}
NEEDS_CALIBRATION = ("int4_awq", "w4a8_awq", "int8_sq", "fp8")  # and every quantized KV cache
KV_CACHE_MAX = {names.KV_CACHE_INT8: 127.0, names.KV_CACHE_FP8: FP8_MAX}
AWQ_GRID = 20
CLIP_GRID = 10
CLIP_MAX_SHRINK = 0.5
CLIP_ROWS = 128
GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01  # of the Gram matrix's mean diagonal, added to its diagonal
GPTQ_ALGOS = ("int4_awq", "w4a8_awq", "int8_sq", "fp8")  # weight_rounding: gptq applies to these
FP8_WEIGHT_RATIOS = [1 - i * 0.02 for i in range(16)]  # scale = ratio * absmax / 448
FP8_INPUT_RATIOS = [1 - i * 0.05 for i in range(12)]


def pick_group_size(setting, spec: ModelSpec) -> int:
    """auto: 128 where it divides every in_features, else the largest of 64 / 32 that does."""
    if setting != "auto":
        return int(setting)
    in_features = (spec.hidden_size, spec.q_size,
                   spec.expert_intermediate_size if spec.num_experts else spec.intermediate_size,
                   spec.shared_expert_intermediate_size or spec.hidden_size)
    for size in (128, 64, 32):
        if all(k % size == 0 for k in in_features):
            return size
    return 32  # kiln's kernels also take a shorter last group


@dataclass(frozen=True)
class QuantOptions:
    """What to quantize how (builder.config's quantization section, resolved)."""

    algo: str
    kv_cache: str = "none"
    group_size: int = 64
    alpha: float = 0.5
    lm_head: str = "int8"
    fp8_per_tensor: bool = False  # fp8 weights: one scale per tensor instead of per output channel
    w4a8_activations: str = "int8"  # w4a8_awq: int8 (per row and group, dynamic) | fp8 (static per tensor)
    weight_rounding: str = "gptq"  # the calibrated algorithms: gptq (error feedback) | nearest
    key_rotation: str = "auto"  # a quantized KV cache's keys: auto | hadamard | none

    @property
    def keys_stored(self) -> str:
        """engine.json quantization.key_rotation: auto rotates the keys of an FP8 cache only (an
        int8 cache loses by it: its step widens under the rotated keys' bound)."""
        if self.kv_cache == "none":
            return names.KEY_ROTATION_NONE
        if self.key_rotation == "auto":
            return names.KEY_ROTATION_HADAMARD if self.kv_cache == names.KV_CACHE_FP8 else names.KEY_ROTATION_NONE
        return self.key_rotation

    @property
    def gptq(self) -> bool:
        """Round the weights with GPTQ (calibration then also sums each linear's x^T x)."""
        return self.weight_rounding == "gptq" and self.algo in GPTQ_ALGOS

    @property
    def kind(self) -> str:
        """engine.json quantization.linear"""
        if self.algo == "w4a8_awq" and self.w4a8_activations == "fp8":
            return names.LINEAR_W4A8_FP8
        return LINEAR_KIND[self.algo]

    @property
    def fp8_activations(self) -> bool:
        return self.algo != "none" and self.kind in FP8_ACTIVATION_KINDS

    @property
    def needs_calibration(self) -> bool:
        return self.algo in NEEDS_CALIBRATION or self.kv_cache != "none"


def kv_cache_scales(stats: KVStats, kv_cache: str, key_rotation: str = names.KEY_ROTATION_NONE) -> torch.Tensor:
    """[2, kv_size] float32: K's and V's per-channel scales (the calibrated range, of the keys as
    the cache stores them, maps to the format's largest value)."""
    keys = stats.k_hadamard_absmax if key_rotation == names.KEY_ROTATION_HADAMARD else stats.k_absmax
    amax = torch.stack([keys, stats.v_absmax]).float()
    return (amax / KV_CACHE_MAX[kv_cache]).clamp(min=1e-8).contiguous()


def linear_weights(spec: ModelSpec) -> dict[str, str]:
    """A layer's linears by key (runtime.model.Layer.linears) -> the packed tensor each is stored
    as: LINEAR_WEIGHTS, or on a Mixture-of-Experts model qkv, out, the shared expert's gate_up
    and down where it has one, and each expert's two."""
    if not spec.num_experts:
        return dict(LINEAR_WEIGHTS)
    experts = {expert_key(e, n): names.expert_tensor(e, f"{n}.weight") for e in range(spec.num_experts)
               for n in EXPERT_LINEARS}
    shared = {"gate_up": names.MLP_GATE_UP, "down": names.MLP_DOWN} if spec.shared_expert_intermediate_size else {}
    return {"qkv": names.ATTN_QKV, "out": names.ATTN_OUT, **shared, **experts}


@dataclass
class LayerWeights:
    """One layer's float32 tensors, as new tensors (the inputs are left untouched)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    linears: dict[str, torch.Tensor]  # by key, as linear_weights() names them
    routed: bool = False  # a Mixture-of-Experts layer: the norm before its MLP feeds the router too
    pre_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # inputs' scales not folded elsewhere

    @classmethod
    def take(cls, weights: dict[str, torch.Tensor], i: int, spec: ModelSpec) -> "LayerWeights":
        def get(name):
            return weights[names.layer_tensor(i, name)].float().clone()

        return cls(get(names.INPUT_NORM), get(names.POST_ATTENTION_NORM),
                   {key: get(weight) for key, weight in linear_weights(spec).items()}, spec.num_experts > 0)

    def apply_scales(self, s: dict[str, torch.Tensor]) -> None:
        """x / s, W * s for each linear with a scale; the float model's output is unchanged. x / s
        goes into the norm before qkv and a dense layer's gate_up, into the up rows before a down
        projection (an expert's: its own), and elsewhere into a pre-scale the runtime multiplies
        in: `out` (with grouped-query attention it cannot be folded into the value rows), and in a
        Mixture-of-Experts layer each expert's gate_up and the shared expert's (the norm before
        them feeds the router and every expert)."""
        for key, scale in s.items():
            self.linears[key] *= scale
            if key == "qkv":
                self.input_norm /= scale
            elif key == "gate_up" and not self.routed:
                self.post_attention_norm /= scale
            elif key.endswith("down"):
                gate_up = self.linears[key.removesuffix("down") + "gate_up"]
                gate_up[gate_up.shape[0] // 2:] /= scale[:, None]  # the up rows
            else:
                self.pre_scales[key] = 1 / scale


def fp8_weight_scales(w: torch.Tensor, x2: torch.Tensor, per_tensor: bool) -> torch.Tensor:
    """Per output channel (or one for the tensor, broadcast): the scale ratio * absmax / 448 with
    the least activation-weighted squared error sum_j E[x_j^2] (w_ij - q_ij)^2. Measured on
    SmolLM2 (4,096 held-out tokens): +2.47% -> +1.65% perplexity for the weights alone."""
    amax = (w.abs().amax() if per_tensor else w.abs().amax(dim=1)).expand(w.shape[0])
    best_error = torch.full((1,) if per_tensor else (w.shape[0],), float("inf"))
    best = amax / FP8_MAX
    for ratio in FP8_WEIGHT_RATIOS:
        s = (amax * ratio / FP8_MAX).clamp(min=1e-12)
        error = ((fake_quant_fp8(w, s[:, None]) - w).pow(2) * x2[None, :]).sum(dim=1)
        if per_tensor:
            error = error.sum(dim=0, keepdim=True)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better, s, best)
    return best


def fp8_input_scale(rows: torch.Tensor, absmax: torch.Tensor) -> float:
    """The static activation scale ratio * max|x| / 448 with the least squared error on the
    sampled rows (which always hold the attention-sink tokens, whose clipping would be costly)."""
    amax = float(absmax.max())
    best_error, best = float("inf"), max(amax, 1e-6) / FP8_MAX
    for ratio in FP8_INPUT_RATIOS:
        s = max(amax * ratio, 1e-6) / FP8_MAX
        error = (fake_quant_fp8(rows, s) - rows).pow(2).sum().item()
        if error < best_error:
            best_error, best = error, s
    return best


def smoothquant_scales(w: torch.Tensor, absmax_x: torch.Tensor, alpha: float) -> torch.Tensor:
    absmax_w = w.abs().amax(dim=0).clamp(min=1e-5)
    s = absmax_x.clamp(min=1e-5).pow(alpha) / absmax_w.pow(1 - alpha)
    return s.clamp(min=1e-5)


def awq_scales(w: torch.Tensor, x: torch.Tensor, absmean_x: torch.Tensor, group: int) -> torch.Tensor:
    """The grid point a in [0, 1) whose s = mean|x|^a gives the least output error."""
    reference = x @ w.T
    best_error, best = float("inf"), torch.ones_like(absmean_x)
    for i in range(AWQ_GRID):
        s = absmean_x.clamp(min=1e-4).pow(i / AWQ_GRID)
        s = s / (s.max() * s.min()).sqrt()
        error = (x @ ops.fake_quant_int4(w, s, group).T - reference).pow(2).mean().item()  # Q(w * s) / s
        if error < best_error:
            best_error, best = error, s
    return best


def awq_clip(w: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """Per (output channel, group): the clipping ratio in [0.5, 1] with the least error of that
    group's contribution to the outputs on the calibration rows."""
    wg, _ = group_view(w, group)  # [out, groups, g]
    xg, _ = group_view(x[:CLIP_ROWS], group)  # [rows, groups, g]
    xt = xg.permute(1, 0, 2)  # [groups, rows, g]
    reference = torch.bmm(xt, wg.permute(1, 2, 0))  # [groups, rows, out]
    best_error = torch.full(wg.shape[:2], float("inf"))  # [out, groups]
    best = torch.ones(wg.shape[:2])
    for i in range(CLIP_GRID):
        ratio = 1 - i * CLIP_MAX_SHRINK / CLIP_GRID
        q, _ = group_view(ops.fake_quant_int4(w, None, group, ratio), group)  # scales amax * ratio / 7
        error = (torch.bmm(xt, q.permute(1, 2, 0)) - reference).pow(2).mean(dim=1).T  # [out, groups]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better, torch.full_like(best, ratio), best)
    return best


def gptq(w: torch.Tensor, gram: torch.Tensor, grid: str, scales: torch.Tensor, group: int = 0,
         clip: torch.Tensor | None = None, block: int = GPTQ_BLOCK) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022): round the input columns in order, each one's rounding error
    spread over the columns not yet rounded through the inverse of the inputs' Gram matrix
    sum x^T x: the least-squares correction of the layer's output on the calibration tokens.
    grid "int4": groups of `group` columns, each group's scale its absmax (times `clip`) / 7 as
    the weights stand when its first column is reached, written into scales [out, groups];
    "int8" / "fp8": fixed per-row scales [out]. -> w on its grid. The column loop of each block
    runs in the plugin library (ops.gptq_block, rows in parallel); `block` only batches the
    updates of the later columns (the result does not depend on it) and holds whole groups."""
    w = w.float().clone()
    in_features = w.shape[1]
    if grid == "int4" and block % group:
        raise ValueError(f"GPTQ: a block of {block} columns does not hold whole groups of {group}")
    h = gram.double().clone()
    dead = h.diagonal() == 0  # inputs never seen non-zero: rounded to nearest (GPTQ zeroes them; a
    h[dead, dead] = 1           # prompt unlike the calibration text may use them)
    damp = GPTQ_DAMP * float(h.diagonal().mean())
    for _ in range(6):  # more damping where rounding errors leave x^T x short of positive definite
        factor, info = torch.linalg.cholesky_ex(h + damp * torch.eye(in_features, dtype=h.dtype))
        if int(info) == 0:
            break
        damp *= 10
    else:
        raise ValueError("GPTQ: the calibration inputs' x^T x is not positive definite even with damping "
                         "(calibrate on more text, or set quantization.weight_rounding: nearest)")
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).float()
    q = torch.zeros_like(w)
    clip = None if clip is None else clip.float().contiguous()
    for i1 in range(0, in_features, block):
        i2 = min(i1 + block, in_features)
        q[:, i1:i2], errors = ops.gptq_block(w[:, i1:i2].contiguous(), hinv[i1:i2, i1:i2].contiguous(), scales,
                                             clip, i1, group, grid)
        w[:, i2:] -= errors @ hinv[i1:i2, i2:]
    return q


def gptq_int4(w: torch.Tensor, gram: torch.Tensor, group: int,
              clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ on the int4 grid: each group's scale is its absmax (times `clip`) as the weights
    stand when its first column is reached. -> (w on its grid, scales [out, groups])."""
    scales = torch.zeros(w.shape[0], -(-w.shape[1] // group))
    return gptq(w, gram, "int4", scales, group, clip, group * max(1, GPTQ_BLOCK // group)), scales


def gptq_int8(w: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ on the int8 grid with the per-row scales absmax / 127. -> (w on its grid, scales)."""
    scales = int8_scales(w)
    return gptq(w, gram, "int8", scales), scales


def gptq_fp8(w: torch.Tensor, gram: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPTQ on the E4M3 grid with fixed per-row scales [out]."""
    return gptq(w, gram, "fp8", scales.float().contiguous())


def round_int4(w: torch.Tensor, gram: torch.Tensor | None, group: int,
               clip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 groups (scales absmax x clip / 7), GPTQ-rounded when x^T x is given, else to
    nearest -> (qweight, scales)."""
    w, scales = (w, int4_scales(w, group, clip)) if gram is None else gptq_int4(w, gram, group, clip)
    return quantize_int4(w, group, scales)


def quantize_head_int4(head: torch.Tensor, final_norm: torch.Tensor, stats: LinearStats | None,
                       options: QuantOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output projection in int4 groups -> (qweight, scales, the final norm's weight). With
    calibration statistics of its input (the final norm's output) it takes the layers' recipe:
    AWQ scales (for int4_awq / w4a8_awq; folded into the final norm, which feeds nothing else)
    and clipping, then GPTQ rounding when the build uses it; without, round to nearest."""
    group = options.group_size
    w = head.float()
    if stats is None:
        return (*quantize_int4(w, group), final_norm)
    clip = None
    s = torch.ones(w.shape[1])
    if options.algo in ("int4_awq", "w4a8_awq"):
        s = awq_scales(w, stats.rows, stats.absmean, group)
        w = w * s
        clip = awq_clip(w, stats.rows / s, group)
    gram = stats.gram / s[:, None] / s[None, :] if options.gptq and stats.gram is not None else None
    return (*round_int4(w, gram, group, clip), final_norm.float() / s)


def quantize_head_w8a8(head: torch.Tensor, final_norm: torch.Tensor, stats: LinearStats | None,
                       options: QuantOptions) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The output projection as W8A8 (int8 weights per channel, its input int8 per row at run
    time) -> (its tensors, the final norm's weight). With calibration statistics of its input
    (the final norm's output) it takes SmoothQuant's recipe: s = max|x|^alpha / max|w|^(1 -
    alpha) folded into the final norm (which feeds nothing else) and the weights, then GPTQ
    rounding when the build uses it; without, int8 to nearest."""
    w, s, gram = head.float(), torch.ones(head.shape[1]), None
    if stats is not None:
        s = smoothquant_scales(w, stats.absmax, options.alpha)
        w = w * s
        if options.gptq and stats.gram is not None:
            gram = stats.gram / s[:, None] / s[None, :]
    return quantize_linear(w, options, None, gram, None, kind=names.LINEAR_W8A8), final_norm.float() / s


def quantize_weights(weights: dict[str, torch.Tensor], spec: ModelSpec, options: QuantOptions, dtype: torch.dtype,
                     stats: dict[tuple[int, str], LinearStats] | None,
                     progress: Callable[[], None] = lambda: None,
                     grams: Callable[[int, str], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Packed float32 weights -> the engine's tensors (quantized linears, the rest in `dtype`).
    lm_head "int8" / "int4" / "w4a8" / "w8a8": the output projection gets int8 weights per
    channel (W8A16) or int4 weights per group (quantize_head_int4; run as W4A16, or W4A8 with int8
    activations per row and group) or smoothed int8 weights against int8 activations per row
    (quantize_head_w8a8) too; with tied embeddings the embedding table
    stays as it is for the input lookup. `grams(layer, linear)`:
    the x^T x sums GPTQ rounding needs (calibrate.Grams), asked for in layer order."""
    out: dict[str, torch.Tensor] = {}
    if options.kv_cache != "none":
        for i in range(spec.num_layers):
            out[names.layer_tensor(i, names.ATTN_KV_SCALES)] = kv_cache_scales(stats[i, "kv"], options.kv_cache,
                                                                               options.keys_stored)
    if options.algo == "none":  # a quantized KV cache only
        for name, tensor in weights.items():
            out[name] = tensor.to(dtype).contiguous()
        for _ in range(spec.num_layers):
            progress()
        return out
    for name, tensor in weights.items():
        if not name.startswith("layers.") or name.endswith((names.ATTN_QKV_BIAS, *names.HEAD_NORMS,
                                                            *names.OUTPUT_NORMS, names.MLP_ROUTER,
                                                            names.MLP_SHARED_GATE)):
            out[name] = tensor.to(dtype).contiguous()
    if options.lm_head in HEAD_KINDS:
        head = weights[names.EMBED if spec.tie_embeddings else names.LM_HEAD]
        head_stats = stats and stats.get(HEAD_STATS)
        if options.lm_head == "int8":
            parts = dict(zip((names.QWEIGHT, names.WEIGHT_SCALES), quantize_int8(head)))
        elif options.lm_head == "w8a8":
            parts, final_norm = quantize_head_w8a8(head, weights[names.FINAL_NORM], head_stats, options)
            out[names.FINAL_NORM] = final_norm.to(dtype).contiguous()
        else:
            qweight, scales, final_norm = quantize_head_int4(head, weights[names.FINAL_NORM], head_stats, options)
            parts = {names.QWEIGHT: qweight, names.WEIGHT_SCALES: scales}
            out[names.FINAL_NORM] = final_norm.to(dtype).contiguous()
        prefix = names.linear_prefix(names.LM_HEAD)
        out.pop(names.LM_HEAD, None)
        for part, tensor in parts.items():
            out[names.linear_tensor(prefix, part)] = tensor
    for i in range(spec.num_layers):
        out.update(quantize_layer(weights, i, spec, options, dtype, stats, grams))
        progress()
    return out


def quantize_layer(weights: dict[str, torch.Tensor], i: int, spec: ModelSpec, options: QuantOptions,
                   dtype: torch.dtype, stats: dict | None, grams: Callable[[int, str], torch.Tensor] | None
                   ) -> dict[str, torch.Tensor]:
    """Layer i's norms (with the scales folded in) and quantized linears: attention and the dense
    MLP, or attention and every expert of a Mixture-of-Experts layer, each expert with the
    statistics of the tokens routed to it (calibrate.settle_experts)."""
    layer = LayerWeights.take(weights, i, spec)
    keys = list(layer.linears)
    seen = {key: stats[i, key] for key in keys} if options.needs_calibration else {}
    clips: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    if options.algo == "int8_sq":
        scales = {k: smoothquant_scales(layer.linears[k], seen[k].absmax, options.alpha) for k in keys}
        layer.apply_scales(scales)
    elif options.algo in ("int4_awq", "w4a8_awq"):
        scales = {k: awq_scales(layer.linears[k], seen[k].rows, seen[k].absmean, options.group_size) for k in keys}
        layer.apply_scales(scales)
        clips = {k: awq_clip(layer.linears[k], seen[k].rows / scales[k], options.group_size) for k in keys}
        clips["qkv"][: spec.q_size + spec.kv_size] = 1.0
        # (as in AWQ, query and key rows are not clipped: attention scores amplify their error)
    out = {names.layer_tensor(i, names.INPUT_NORM): layer.input_norm.to(dtype).contiguous(),
           names.layer_tensor(i, names.POST_ATTENTION_NORM): layer.post_attention_norm.to(dtype).contiguous()}
    for key, weight_name in linear_weights(spec).items():
        prefix = names.linear_prefix(names.layer_tensor(i, weight_name))
        s = scales.get(key)
        gram = None
        if options.gptq and not seen[key].pooled:  # (an expert with too few tokens: no x^T x of its own)
            gram = grams(i, key) if s is None else grams(i, key) / s[:, None] / s[None, :]  # that of x / s
        inputs = None
        if key in seen:  # what the linear sees once x / s is folded in
            inputs = seen[key] if s is None else LinearStats(seen[key].absmax / s, seen[key].abssum / s,
                                                             seen[key].count, rows=seen[key].rows / s)
        parts = quantize_linear(layer.linears[key], options, inputs, gram, clips.get(key))
        if key in layer.pre_scales:
            parts[names.PRE_SCALE] = layer.pre_scales[key].float().contiguous()
        out.update({names.linear_tensor(prefix, part): tensor for part, tensor in parts.items()})
    return out


def quantize_linear(w: torch.Tensor, options: QuantOptions, inputs: LinearStats | None, gram: torch.Tensor | None,
                    clip: torch.Tensor | None, kind: str | None = None) -> dict[str, torch.Tensor]:
    """One linear's weights (scales already applied) on the grid of `kind` (the build's layers'
    by default), GPTQ-rounded when x^T x is given -> its stored parts (names.QWEIGHT, ...).
    inputs: statistics of what it sees."""
    kind = kind or options.kind
    if kind in INT4_KINDS:
        qweight, w_scales = round_int4(w, gram, options.group_size, clip)
    elif kind == names.LINEAR_FP8:
        w_scales = fp8_weight_scales(w, inputs.rows.pow(2).mean(dim=0), options.fp8_per_tensor)
        qweight, w_scales = quantize_fp8(w if gram is None else gptq_fp8(w, gram, w_scales), scales=w_scales)
    else:
        qweight, w_scales = quantize_int8(*((w,) if gram is None else gptq_int8(w, gram)))
        # (the grid's scales go with it: the rounded row's own absmax may be smaller)
    parts = {names.QWEIGHT: qweight, names.WEIGHT_SCALES: w_scales}
    if kind == names.LINEAR_W8A8:
        parts[names.WEIGHT_SUM] = qweight.to(torch.int32).sum(dim=1, dtype=torch.int32)
    if kind in FP8_ACTIVATION_KINDS:
        parts[names.INPUT_SCALE] = torch.tensor([fp8_input_scale(inputs.rows, inputs.absmax)], dtype=torch.float32)
    return parts


def quantization_meta(options: QuantOptions) -> dict:
    """engine.json's `quantization` entry (what the loader needs to read the tensors)."""
    meta = {"algo": options.algo, "kv_cache": options.kv_cache}
    if options.kv_cache != "none":
        meta["key_rotation"] = options.keys_stored
    if options.algo == "none":
        return meta
    meta["linear"] = options.kind
    if options.lm_head in HEAD_KINDS:
        meta["lm_head"] = HEAD_KINDS[options.lm_head]
        if options.lm_head in ("int4", "w4a8"):
            meta["lm_head_group_size"] = options.group_size
    if options.kind in INT4_KINDS:
        meta["group_size"] = options.group_size
    if options.algo == "int8_sq":
        meta["smoothquant_alpha"] = options.alpha
    if options.kind == names.LINEAR_FP8:
        meta["fp8_weight_scales"] = "per_tensor" if options.fp8_per_tensor else "per_channel"
    if options.fp8_activations:
        meta["activations"] = "fp8_per_tensor_static"
    if options.algo in GPTQ_ALGOS:
        meta["weight_rounding"] = options.weight_rounding
    return meta
