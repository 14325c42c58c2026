"""`kiln export`: a kiln engine out as a TensorRT-LLM checkpoint (one rank: kiln exports no
tensor parallelism), so weights move to NVIDIA's tools; builder/checkpoint/trtllm.py reads
such checkpoints back and describes the format.

kiln's other formats have no TensorRT-LLM checkpoint form it can write faithfully (int8
weight-only and SmoothQuant tensors are laid out for TensorRT-LLM's GPU kernels; kiln's W4A8 uses
int8 activations; per-channel FP8 weights are TensorRT-LLM's per-token recipe), and are refused
by name. kiln's per-channel KV-cache scales become one scale per layer (the largest), so an
exported KV cache is a little coarser than kiln's own; TensorRT-LLM stores keys unrotated, so an
FP8 cache loses what kiln's key rotation gains (docs/quantization.md)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln import constants as names
from kiln.builder.checkpoint.trtllm import NORMS, linear_modules, long_rope_attention_factor, module_tensor, swap_halves
from kiln.errors import KilnError
from kiln.plugins.formats import dequantize_int4, hadamard_block, unpack_int4
from kiln.runtime.spec import ModelSpec

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
QUANT_ALGOS = {names.LINEAR_FP8: names.TRTLLM_FP8, names.LINEAR_INT4: names.TRTLLM_W4A16_AWQ}
KV_ALGOS = {names.KV_CACHE_INT8: names.TRTLLM_KV_INT8, names.KV_CACHE_FP8: names.TRTLLM_KV_FP8}


class ExportError(KilnError):
    """The engine cannot be written as a TensorRT-LLM checkpoint."""


def pack_int4_along_out(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> int8 [out / 2, in]: row 2k in the low nibble."""
    if q.shape[0] % 2:
        raise ExportError(f"TensorRT-LLM's int4 packing needs an even out_features, got {q.shape[0]}")
    u = q.to(torch.int16) & 0x0F
    return (u[0::2] | (u[1::2] << 4)).to(torch.uint8).view(torch.int8).contiguous()


def _config(spec: ModelSpec, dtype: str, quant: dict | None) -> dict:
    rope = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        rope = {"type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    extra = {}
    if spec.architecture == "phi3":  # (TensorRT-LLM's Phi-3: one fused fc and a swiglu)
        extra = {"hidden_act": "swiglu", "rotary_pct": (spec.rotary_dim or spec.head_dim) / spec.head_dim}
        if spec.rope_longrope is not None:
            extra.update(position_embedding_type=names.TRTLLM_LONG_ROPE,
                         original_max_position_embeddings=spec.rope_longrope.original_max_position_embeddings,
                         longrope_scaling_short_factors=list(spec.rope_longrope.short_factor),
                         longrope_scaling_long_factors=list(spec.rope_longrope.long_factor))
    if spec.architecture in names.TRTLLM_QWEN_TYPES:
        extra.update(qwen_type=names.TRTLLM_QWEN_TYPES[spec.architecture], attn_bias=spec.qkv_bias, mlp_bias=False)
    moe = {}
    if spec.num_experts:
        normalization = {v: k for k, v in names.TRTLLM_MOE_NORMALIZATION.items()}[spec.normalize_expert_weights]
        moe = {names.TRTLLM_MOE: {"num_experts": spec.num_experts, "top_k": spec.experts_per_token,
                                  "normalization_mode": normalization}}
        if spec.architecture != "mixtral":  # (Qwen's MoE: the experts' width beside the dense one)
            moe.update(moe_intermediate_size=spec.expert_intermediate_size,
                       moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    return moe | {
        "architecture": names.TRTLLM_ARCHITECTURES[spec.architecture],
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_size": spec.head_dim,
        "hidden_act": "silu",
        "intermediate_size": spec.expert_intermediate_size if spec.architecture == "mixtral" else spec.intermediate_size,
        "norm_epsilon": spec.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": spec.rope_theta,
        "rotary_scaling": rope,
        "use_parallel_embedding": False,
        "share_embedding_table": False,
        "qkv_bias": spec.qkv_bias,
        "bos_token_id": spec.bos_id,
        "eos_token_id": list(spec.eos_ids),
        "pad_token_id": spec.pad_id,
        "quantization": quant or {"quant_algo": None, "kv_cache_quant_algo": None},
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
    } | extra


def _export_linear(out: dict, layer: int, modules: tuple[str, ...], kind: str | None,
                   w: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """One kiln linear (dense or quantized tensors `w`) -> TensorRT-LLM module(s), split by rows."""
    rows = w[names.QWEIGHT if kind else "weight"].shape[0] // len(modules)
    for index, module in enumerate(modules):
        part = slice(index * rows, (index + 1) * rows)
        if w.get("bias") is not None:
            out[module_tensor(layer, module, names.TRTLLM_BIAS)] = w["bias"][part].to(dtype).contiguous()
        if kind is None:
            out[module_tensor(layer, module, names.TRTLLM_WEIGHT)] = w["weight"][part].to(dtype).contiguous()
            continue
        scales = w[names.WEIGHT_SCALES][part]
        if kind == names.LINEAR_FP8:
            if not torch.all(scales == scales[0]):
                raise ExportError("TensorRT-LLM's FP8 checkpoint has one weight scale per tensor; build with "
                                  "quantization.fp8_weight_scales: per_tensor to export")
            out[module_tensor(layer, module, names.TRTLLM_WEIGHT)] = w[names.QWEIGHT][part].contiguous()
            out[module_tensor(layer, module, names.TRTLLM_WEIGHTS_SCALE)] = scales[0].clone().float()
            out[module_tensor(layer, module, names.TRTLLM_ACTIVATION_SCALE)] = w[names.INPUT_SCALE].reshape(()).float().clone()
        else:  # int4 group-wise
            q = unpack_int4(w[names.QWEIGHT][part])
            out[module_tensor(layer, module, names.TRTLLM_WEIGHT)] = pack_int4_along_out(q)
            # (scales in float32: TensorRT-LLM casts them to the model dtype when it builds, and
            # kiln reads them back exactly)
            out[module_tensor(layer, module, names.TRTLLM_WEIGHTS_SCALE)] = scales.float().contiguous()
            pre = w.get(names.PRE_SCALE)
            out[module_tensor(layer, module, names.TRTLLM_PREQUANT_SCALE)] = (
                torch.ones(q.shape[1]) if pre is None else pre.float()).contiguous()


def _export_experts(out: dict, weights: dict[str, torch.Tensor], spec: ModelSpec, layer: int, dtype: torch.dtype) -> None:
    """A Mixture-of-Experts layer as TensorRT-LLM's MOE module holds it (names.TRTLLM_MLP_ROUTER):
    the router in float32, the experts stacked, each expert's up rows before its gate rows."""
    def expert(e: int, name: str) -> torch.Tensor:
        return weights[names.layer_tensor(layer, names.expert_tensor(e, name))]

    out[module_tensor(layer, names.TRTLLM_MLP_ROUTER, names.TRTLLM_WEIGHT)] = (
        weights[names.layer_tensor(layer, names.MLP_ROUTER)].float().contiguous())
    out[module_tensor(layer, names.TRTLLM_MLP_FC, names.TRTLLM_WEIGHT)] = torch.stack(
        [swap_halves(expert(e, "gate_up.weight")) for e in range(spec.num_experts)]).to(dtype).contiguous()
    out[module_tensor(layer, names.TRTLLM_MLP_PROJ, names.TRTLLM_WEIGHT)] = torch.stack(
        [expert(e, "down.weight") for e in range(spec.num_experts)]).to(dtype).contiguous()
    if spec.shared_expert_intermediate_size:  # Qwen2-MoE: the layer's own gate_up / down, and its gate
        shared = {names.TRTLLM_SHARED_EXPERT_FC: swap_halves(weights[names.layer_tensor(layer, names.MLP_GATE_UP)]),
                  names.TRTLLM_SHARED_EXPERT_PROJ: weights[names.layer_tensor(layer, names.MLP_DOWN)],
                  names.TRTLLM_SHARED_EXPERT_GATE: weights[names.layer_tensor(layer, names.MLP_SHARED_GATE)]}
        for module, tensor in shared.items():
            out[module_tensor(layer, module, names.TRTLLM_WEIGHT)] = tensor.to(dtype).contiguous()


def _kv_scale(scales: torch.Tensor, quant: dict, spec: ModelSpec) -> torch.Tensor:
    """One layer's KV-cache scale for TensorRT-LLM: the largest of kiln's per-channel scales. Keys
    kiln stores rotated (quantization.key_rotation hadamard) are bounded as TensorRT-LLM stores
    them, unrotated: k = H (H k), so |k_i| <= sum_j |H_ij| |(H k)_j| <= sum over i's block of
    448 s_j / sqrt(block)."""
    keys = scales[0]
    if quant.get("key_rotation", names.KEY_ROTATION_NONE) == names.KEY_ROTATION_HADAMARD:
        block = hadamard_block(spec.head_dim)
        keys = keys.reshape(-1, block).sum(dim=1) / math.sqrt(block)
    return torch.maximum(keys.max(), scales[1].max())


def export_checkpoint(engine_dir: Path, output: Path) -> Path:
    """An engine directory -> a TensorRT-LLM checkpoint folder (config.json, rank0.safetensors,
    and the tokenizer files beside them)."""
    engine_dir = Path(engine_dir)
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())
    spec = ModelSpec.from_json(meta["model"])
    if spec.architecture not in names.TRTLLM_ARCHITECTURES:
        raise ExportError(f"kiln export does not write {spec.architecture} models yet (it writes "
                          f"{', '.join(sorted(names.TRTLLM_ARCHITECTURES))})")
    if spec.rope_freq_factors is not None:
        raise ExportError("this engine's rope frequencies come from a GGUF's rope_freqs.weight, which TensorRT-LLM's "
                          "checkpoint cannot state; build the engine from the Hugging Face folder to export it")
    longrope = spec.rope_longrope
    if longrope is not None and abs(longrope.attention_factor - long_rope_attention_factor(
            spec.max_position_embeddings, longrope.original_max_position_embeddings)) > 1e-6:
        raise ExportError(f"this engine's LongRoPE factor on cos and sin ({longrope.attention_factor}) is the "
                          "checkpoint's own; TensorRT-LLM's checkpoint cannot state it (it derives the factor from "
                          "max_position_embeddings), so the export would change the model")
    max_seq_len = int(meta.get("limits", {}).get("max_seq_len", 0))
    if spec.sliding_window is not None and max_seq_len > spec.sliding_window:
        raise ExportError(f"this engine attends within a sliding window of {spec.sliding_window} positions up to "
                          f"max_seq_len {max_seq_len}; TensorRT-LLM takes the window at run time "
                          "(max_attention_window_size), not from its checkpoint, so the export would lose it; "
                          f"build with max_seq_len <= {spec.sliding_window} to export")
    dtype_name = meta["dtype"]
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[dtype_name]
    quant = meta.get("quantization") or {}
    kind = quant.get("linear")
    if kind is not None and kind not in QUANT_ALGOS:
        raise ExportError(f"a {quant.get('algo')} engine ({kind} linears) has no TensorRT-LLM checkpoint form "
                          f"kiln writes faithfully; exportable: unquantized, fp8 with per_tensor weight "
                          f"scales, int4_awq / int4_wo (W4A16_AWQ), with or without an int8 / fp8 KV cache")
    moe = spec.num_experts > 0
    if moe and kind is not None:
        raise ExportError(f"a {quant.get('algo')} Mixture-of-Experts engine has no TensorRT-LLM checkpoint form kiln "
                          "writes faithfully (its experts' quantized layout is TensorRT-LLM's own); export an "
                          "unquantized build, with or without an int8 / fp8 KV cache")
    in_features = (spec.hidden_size, spec.q_size, spec.intermediate_size)
    if kind == names.LINEAR_INT4 and any(k % quant["group_size"] for k in in_features):
        raise ExportError(f"TensorRT-LLM needs the int4 group size ({quant['group_size']}) to divide every "
                          f"in_features {in_features}; build with a group_size that does")
    weights = load_file(engine_dir / names.WEIGHTS_FILE)
    out: dict[str, torch.Tensor] = {names.TRTLLM_EMBED: weights[names.EMBED].to(dtype).contiguous(),
                                    names.TRTLLM_FINAL_NORM: weights[names.FINAL_NORM].to(dtype).contiguous()}
    head_prefix = names.linear_prefix(names.LM_HEAD)
    # an int8 / int4 / w4a8 / w8a8 lm_head: dequantized (float32)
    if names.linear_tensor(head_prefix, names.QWEIGHT) in weights:
        q = weights[names.linear_tensor(head_prefix, names.QWEIGHT)]
        s = weights[names.linear_tensor(head_prefix, names.WEIGHT_SCALES)]
        if quant.get("lm_head") in (names.LINEAR_INT4, names.LINEAR_W4A8):
            out[names.TRTLLM_LM_HEAD] = dequantize_int4(q, s, quant["lm_head_group_size"])
        else:
            out[names.TRTLLM_LM_HEAD] = q.float() * s[:, None]
    else:
        # (a copy: with tied embeddings it would share the embedding's memory, which safetensors refuses)
        out[names.TRTLLM_LM_HEAD] = weights.get(names.LM_HEAD, weights[names.EMBED]).to(dtype).clone()
    norms = {**NORMS, **(dict(zip(names.HEAD_NORMS, (names.TRTLLM_Q_NORM, names.TRTLLM_K_NORM)))
                         if spec.head_norms else {})}
    for i in range(spec.num_layers):
        for kiln_name, trt_name in norms.items():
            out[names.TRTLLM_LAYER.format(i) + trt_name] = weights[names.layer_tensor(i, kiln_name)].to(dtype)
        for linear, modules in linear_modules(spec.architecture).items():
            if moe and linear in (names.MLP_GATE_UP, names.MLP_DOWN):  # the experts instead
                continue
            weight_name = names.layer_tensor(i, linear)
            prefix = names.linear_prefix(weight_name)
            if kind is None:
                w = {"weight": weights[weight_name]}
            else:
                w = {part: weights[names.linear_tensor(prefix, part)]
                     for part in (names.QWEIGHT, names.WEIGHT_SCALES, names.PRE_SCALE, names.INPUT_SCALE)
                     if names.linear_tensor(prefix, part) in weights}
            if linear == names.ATTN_QKV and spec.qkv_bias:
                w["bias"] = weights[names.layer_tensor(i, names.ATTN_QKV_BIAS)]
            if linear == names.MLP_GATE_UP and spec.architecture == "phi3":  # up rows first
                w = {part: swap_halves(t) if part in ("weight", names.QWEIGHT, names.WEIGHT_SCALES) else t
                     for part, t in w.items()}
            _export_linear(out, i, modules, kind, w, dtype)
        if moe:
            _export_experts(out, weights, spec, i, dtype)
        if quant.get("kv_cache", "none") != "none":
            scale = _kv_scale(weights[names.layer_tensor(i, names.ATTN_KV_SCALES)].float(), quant, spec)
            out[names.TRTLLM_LAYER.format(i) + names.TRTLLM_KV_SCALE] = scale.reshape(1)
    quant_config = {"quant_algo": QUANT_ALGOS.get(kind), "kv_cache_quant_algo": KV_ALGOS.get(quant.get("kv_cache")),
                    "exclude_modules": ["lm_head"] if kind else None}
    if kind == names.LINEAR_INT4:
        quant_config.update(group_size=quant["group_size"], has_zero_point=False, pre_quant_scale=True)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    save_file(out, output / names.TRTLLM_WEIGHTS)
    (output / names.TRTLLM_CONFIG).write_text(json.dumps(_config(spec, dtype_name, quant_config), indent=2) + "\n")
    for tokenizer_file in (engine_dir / names.TOKENIZER_DIR).iterdir():
        shutil.copy(tokenizer_file, output / tokenizer_file.name)
    return output


