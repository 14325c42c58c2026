"""TensorRT-LLM checkpoints: kiln engines out (`kiln export`), and back in as a checkpoint
(`model.format: trtllm`), so weights move between kiln and NVIDIA's tools.

A TensorRT-LLM checkpoint is a folder with `config.json` (the model and
`quantization.quant_algo` / `kv_cache_quant_algo`) and `rank0.safetensors` (one rank: kiln
exports no tensor parallelism) under TensorRT-LLM's names: transformer.vocab_embedding,
transformer.layers.N.{input_layernorm, attention.qkv, attention.dense, post_layernorm, mlp.fc
(the gate projection), mlp.gate (the up projection), mlp.proj}, transformer.ln_f, lm_head.
Scales are dequantization factors (w ~ q * scale):

    FP8        weight float8_e4m3fn [out, in], weights_scaling_factor and
               activation_scaling_factor (one per tensor)
    W4A16_AWQ  weight int4 packed two per byte along the OUTPUT dimension (rows 2k / 2k+1 in
               the low / high nibble, signed two's complement) [out / 2, in],
               weights_scaling_factor [out, in / group], prequant_scaling_factor [in]
    KV cache   attention.kv_cache_scaling_factor [1] per layer (INT8 or FP8)

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kiln import constants as names
from kiln.builder.checkpoint import Checkpoint, one_for_fused
from kiln.errors import CheckpointError, KilnError
from kiln.quantize.formats import dequantize_int4, pack_int4, unpack_int4
from kiln.runtime.key_rotation import hadamard_block
from kiln.runtime.spec import ModelSpec, RopeScaling

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# kiln layer linear -> TensorRT-LLM module(s); gate_up is split into fc (gate) and gate (up)
LINEAR_MODULES = {names.ATTN_QKV: (names.TRTLLM_QKV,), names.ATTN_OUT: (names.TRTLLM_DENSE,),
                  names.MLP_GATE_UP: (names.TRTLLM_MLP_FC, names.TRTLLM_MLP_GATE),
                  names.MLP_DOWN: (names.TRTLLM_MLP_PROJ,)}
NORMS = {names.INPUT_NORM: names.TRTLLM_INPUT_NORM, names.POST_ATTENTION_NORM: names.TRTLLM_POST_NORM}
QUANT_ALGOS = {names.LINEAR_FP8: names.TRTLLM_FP8, names.LINEAR_INT4: names.TRTLLM_W4A16_AWQ}
KV_ALGOS = {names.KV_CACHE_INT8: names.TRTLLM_KV_INT8, names.KV_CACHE_FP8: names.TRTLLM_KV_FP8}


class ExportError(KilnError):
    """The engine cannot be written as a TensorRT-LLM checkpoint."""


def _module(layer: int, module: str, tensor: str) -> str:
    return names.TRTLLM_LAYER.format(layer) + f"{module}.{tensor}"


# --- int4 packing: TensorRT-LLM's (along out, signed) <-> kiln's (along in, offset 8) ------
def pack_int4_along_out(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> int8 [out / 2, in]: row 2k in the low nibble."""
    if q.shape[0] % 2:
        raise ExportError(f"TensorRT-LLM's int4 packing needs an even out_features, got {q.shape[0]}")
    u = q.to(torch.int16) & 0x0F
    return (u[0::2] | (u[1::2] << 4)).to(torch.uint8).view(torch.int8).contiguous()


def unpack_int4_along_out(packed: torch.Tensor) -> torch.Tensor:
    """int8 [out / 2, in] (TensorRT-LLM) -> int8 values [out, in]."""
    u = packed.view(torch.uint8).to(torch.int16)
    low, high = u & 0x0F, u >> 4
    low, high = torch.where(low >= 8, low - 16, low), torch.where(high >= 8, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


# --- export ------------------------------------------------------------------------------
def _config(spec: ModelSpec, dtype: str, quant: dict | None) -> dict:
    rope = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        rope = {"type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
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
        "intermediate_size": spec.intermediate_size,
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
    }


def _export_linear(out: dict, layer: int, modules: tuple[str, ...], kind: str | None,
                   w: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """One kiln linear (dense or quantized tensors `w`) -> TensorRT-LLM module(s), split by rows."""
    rows = w[names.QWEIGHT if kind else "weight"].shape[0] // len(modules)
    for index, module in enumerate(modules):
        part = slice(index * rows, (index + 1) * rows)
        if kind is None:
            out[_module(layer, module, names.TRTLLM_WEIGHT)] = w["weight"][part].to(dtype).contiguous()
            continue
        scales = w[names.WEIGHT_SCALES][part]
        if kind == names.LINEAR_FP8:
            if not torch.all(scales == scales[0]):
                raise ExportError("TensorRT-LLM's FP8 checkpoint has one weight scale per tensor; build with "
                                  "quantization.fp8_weight_scales: per_tensor to export")
            out[_module(layer, module, names.TRTLLM_WEIGHT)] = w[names.QWEIGHT][part].contiguous()
            out[_module(layer, module, names.TRTLLM_WEIGHTS_SCALE)] = scales[0].clone().float()
            out[_module(layer, module, names.TRTLLM_ACTIVATION_SCALE)] = w[names.INPUT_SCALE].reshape(()).float().clone()
        else:  # int4 group-wise
            q = unpack_int4(w[names.QWEIGHT][part])
            out[_module(layer, module, names.TRTLLM_WEIGHT)] = pack_int4_along_out(q)
            # (scales in float32: TensorRT-LLM casts them to the model dtype when it builds, and
            # kiln reads them back exactly)
            out[_module(layer, module, names.TRTLLM_WEIGHTS_SCALE)] = scales.float().contiguous()
            pre = w.get(names.PRE_SCALE)
            out[_module(layer, module, names.TRTLLM_PREQUANT_SCALE)] = (
                torch.ones(q.shape[1]) if pre is None else pre.float()).contiguous()
        if w.get("bias") is not None:
            out[_module(layer, module, names.TRTLLM_BIAS)] = w["bias"][part].to(dtype).contiguous()


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
    dtype_name = meta["dtype"]
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[dtype_name]
    quant = meta.get("quantization") or {}
    kind = quant.get("linear")
    if kind is not None and kind not in QUANT_ALGOS:
        raise ExportError(f"a {quant.get('algo')} engine ({kind} linears) has no TensorRT-LLM checkpoint form "
                          f"kiln writes faithfully; exportable: unquantized, fp8 with per_tensor weight "
                          f"scales, int4_awq / int4_wo (W4A16_AWQ), with or without an int8 / fp8 KV cache")
    in_features = (spec.hidden_size, spec.q_size, spec.intermediate_size)
    if kind == names.LINEAR_INT4 and any(k % quant["group_size"] for k in in_features):
        raise ExportError(f"TensorRT-LLM needs the int4 group size ({quant['group_size']}) to divide every "
                          f"in_features {in_features}; build with a group_size that does")
    weights = load_file(engine_dir / names.WEIGHTS_FILE)
    out: dict[str, torch.Tensor] = {names.TRTLLM_EMBED: weights[names.EMBED].to(dtype).contiguous(),
                                    names.TRTLLM_FINAL_NORM: weights[names.FINAL_NORM].to(dtype).contiguous()}
    head_prefix = names.linear_prefix(names.LM_HEAD)
    if names.linear_tensor(head_prefix, names.QWEIGHT) in weights:  # int8 / int4 lm_head: dequantized (float32)
        q = weights[names.linear_tensor(head_prefix, names.QWEIGHT)]
        s = weights[names.linear_tensor(head_prefix, names.WEIGHT_SCALES)]
        if quant.get("lm_head") == names.LINEAR_INT4:
            out[names.TRTLLM_LM_HEAD] = dequantize_int4(q, s, quant["lm_head_group_size"])
        else:
            out[names.TRTLLM_LM_HEAD] = q.float() * s[:, None]
    else:
        out[names.TRTLLM_LM_HEAD] = weights.get(names.LM_HEAD, weights[names.EMBED]).to(dtype).contiguous()
    for i in range(spec.num_layers):
        for kiln_name, trt_name in NORMS.items():
            out[names.TRTLLM_LAYER.format(i) + trt_name] = weights[names.layer_tensor(i, kiln_name)].to(dtype)
        for linear, modules in LINEAR_MODULES.items():
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
            _export_linear(out, i, modules, kind, w, dtype)
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


# --- import ------------------------------------------------------------------------------
def is_trtllm_checkpoint(path: Path) -> bool:
    if not (path.is_dir() and (path / names.TRTLLM_CONFIG).is_file() and (path / names.TRTLLM_WEIGHTS).is_file()):
        return False
    try:
        return "architecture" in json.loads((path / names.TRTLLM_CONFIG).read_text())
    except (OSError, ValueError):
        return False


def _spec(config: dict, source: Path) -> ModelSpec:
    by_name = {v: k for k, v in names.TRTLLM_ARCHITECTURES.items()}
    arch = by_name.get(config["architecture"])
    if arch is None:
        raise CheckpointError(f"{source}: architecture {config['architecture']!r} is not one kiln reads "
                              f"({sorted(by_name)})")
    mapping = config.get("mapping") or {}
    if mapping.get("world_size", 1) != 1:
        raise CheckpointError(f"{source}: a checkpoint split over {mapping['world_size']} ranks; kiln reads "
                              f"single-rank (rank0.safetensors only) checkpoints")
    rope = config.get("rotary_scaling")
    scaling = None
    if rope:
        if rope.get("type", rope.get("rope_type")) != "llama3":
            raise CheckpointError(f"{source}: rotary_scaling {rope} is not supported (llama3 only)")
        scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
    heads = int(config["num_attention_heads"])
    eos = config.get("eos_token_id")
    return ModelSpec(
        architecture=arch, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_size") or int(config["hidden_size"]) // heads),
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        rope_theta=float(config.get("rotary_base", 10000.0)), rope_scaling=scaling,
        norm_eps=float(config.get("norm_epsilon", 1e-5)), tie_embeddings=False,
        qkv_bias=bool(config.get("qkv_bias", arch == "qwen2")), bos_id=config.get("bos_token_id"),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        pad_id=config.get("pad_token_id"))


def _import_linear(get, layer: int, modules: tuple[str, ...], algo: str, source: Path) -> dict[str, torch.Tensor]:
    """TensorRT-LLM module(s) -> kiln's quantized tensors for one fused linear (under part names)."""
    def part(module: str, tensor: str) -> torch.Tensor:
        return get(_module(layer, module, tensor))

    weights = [part(m, names.TRTLLM_WEIGHT) for m in modules]
    if algo == names.TRTLLM_FP8:
        scales = torch.cat([part(m, names.TRTLLM_WEIGHTS_SCALE).float().reshape(-1).expand(w.shape[0])
                            for m, w in zip(modules, weights)])
        act = one_for_fused([part(m, names.TRTLLM_ACTIVATION_SCALE).float().reshape(1) for m in modules],
                            "activation_scaling_factor", f"{source}: layer {layer} {'/'.join(modules)}")
        return {names.QWEIGHT: torch.cat(weights).to(torch.float8_e4m3fn).contiguous(),
                names.WEIGHT_SCALES: scales.contiguous(), names.INPUT_SCALE: act.contiguous()}
    q = torch.cat([unpack_int4_along_out(w) for w in weights])
    out = {names.QWEIGHT: pack_int4(q),
           names.WEIGHT_SCALES: torch.cat([part(m, names.TRTLLM_WEIGHTS_SCALE).float() for m in modules]).contiguous()}
    pre = one_for_fused([part(m, names.TRTLLM_PREQUANT_SCALE).float().reshape(-1) for m in modules],
                        "prequant_scaling_factor", f"{source}: layer {layer} {'/'.join(modules)}")
    if not torch.all(pre == 1):
        out[names.PRE_SCALE] = pre.contiguous()
    return out


def load_trtllm(folder: Path) -> Checkpoint:
    config = json.loads((folder / names.TRTLLM_CONFIG).read_text())
    try:
        spec = _spec(config, folder)
    except KeyError as exc:
        raise CheckpointError(f"{folder}/{names.TRTLLM_CONFIG} lacks the key {exc}") from None
    quant = config.get("quantization") or {}
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in (None, names.TRTLLM_FP8, names.TRTLLM_W4A16_AWQ):
        raise CheckpointError(f"{folder}: quant_algo {algo!r} is not one kiln reads (none, FP8, W4A16_AWQ)")
    if kv_algo not in (None, names.TRTLLM_KV_INT8, names.TRTLLM_KV_FP8):
        raise CheckpointError(f"{folder}: kv_cache_quant_algo {kv_algo!r} is not one kiln reads (none, INT8, FP8)")
    excluded = quant.get("exclude_modules") or []
    if algo and any(not m.startswith("lm_head") for m in excluded):
        raise CheckpointError(f"{folder}: layers excluded from quantization ({excluded}) are not supported")
    try:
        with safe_open(folder / names.TRTLLM_WEIGHTS, framework="pt") as f:
            raw = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {folder / names.TRTLLM_WEIGHTS}: {exc} (is it truncated or corrupt?)") from None

    def get(key: str) -> torch.Tensor:
        if key not in raw:
            raise CheckpointError(f"{folder}/{names.TRTLLM_WEIGHTS} lacks {key}")
        return raw[key]

    tensors = {names.CKPT_EMBED: get(names.TRTLLM_EMBED).float(), names.CKPT_FINAL_NORM: get(names.TRTLLM_FINAL_NORM).float(),
               names.CKPT_LM_HEAD: raw.get(names.TRTLLM_LM_HEAD, raw[names.TRTLLM_EMBED]).float()}
    prequantized: dict[str, torch.Tensor] = {}
    kv = {names.TRTLLM_KV_INT8: names.KV_CACHE_INT8, names.TRTLLM_KV_FP8: names.KV_CACHE_FP8}.get(kv_algo, "none")
    q, k = spec.q_size, spec.kv_size
    for i in range(spec.num_layers):
        tensors[names.layer_tensor(i, "input_norm.weight")] = get(names.TRTLLM_LAYER.format(i) + names.TRTLLM_INPUT_NORM).float()
        tensors[names.layer_tensor(i, "post_attention_norm.weight")] = get(
            names.TRTLLM_LAYER.format(i) + names.TRTLLM_POST_NORM).float()
        if spec.qkv_bias:
            bias = get(_module(i, names.TRTLLM_QKV, names.TRTLLM_BIAS)).float()
            for name, piece in zip(names.CKPT_QKV_BIASES, bias.split((q, k, k))):
                tensors[names.layer_tensor(i, name)] = piece
        if algo is None:
            qkv = get(_module(i, names.TRTLLM_QKV, names.TRTLLM_WEIGHT)).float()
            for name, piece in zip(("attention.q.weight", "attention.k.weight", "attention.v.weight"),
                                   qkv.split((q, k, k))):
                tensors[names.layer_tensor(i, name)] = piece
            for name, module in (("attention.o.weight", names.TRTLLM_DENSE), ("mlp.gate.weight", names.TRTLLM_MLP_FC),
                                 ("mlp.up.weight", names.TRTLLM_MLP_GATE), ("mlp.down.weight", names.TRTLLM_MLP_PROJ)):
                tensors[names.layer_tensor(i, name)] = get(_module(i, module, names.TRTLLM_WEIGHT)).float()
        else:
            for linear, modules in LINEAR_MODULES.items():
                prefix = names.linear_prefix(names.layer_tensor(i, linear))
                for part, tensor in _import_linear(get, i, modules, algo, folder).items():
                    prequantized[names.linear_tensor(prefix, part)] = tensor
        if kv != "none":
            scale = get(names.TRTLLM_LAYER.format(i) + names.TRTLLM_KV_SCALE).float().reshape(())
            prequantized[names.layer_tensor(i, names.ATTN_KV_SCALES)] = scale.expand(2, k).contiguous()
    quantization = None
    if algo or kv != "none":
        quantization = {"algo": {None: "none", names.TRTLLM_FP8: "fp8", names.TRTLLM_W4A16_AWQ: "int4_awq"}[algo],
                        "kv_cache": kv, "key_rotation": names.KEY_ROTATION_NONE,
                        "source": f"TensorRT-LLM checkpoint ({algo or 'unquantized'}, "
                                  f"KV cache {kv_algo or 'unquantized'})"}
        if algo:
            quantization["linear"] = names.LINEAR_FP8 if algo == names.TRTLLM_FP8 else names.LINEAR_INT4
        if algo == names.TRTLLM_W4A16_AWQ:
            quantization["group_size"] = int(quant["group_size"])
    tokenizer_files = {n: (folder / n).read_text() for n in (names.TOKENIZER_JSON, names.TOKENIZER_CONFIG_JSON)
                       if (folder / n).is_file()}
    if names.TOKENIZER_JSON not in tokenizer_files:
        raise CheckpointError(f"{folder} has no {names.TOKENIZER_JSON}: put the model's tokenizer files beside "
                              f"{names.TRTLLM_CONFIG} (kiln export writes them there)")
    return Checkpoint(spec, tensors, tokenizer_files, prequantized=prequantized, quantization=quantization)
