"""TensorRT-LLM checkpoints as a checkpoint kiln builds from (`model.format: trtllm`).

A TensorRT-LLM checkpoint is a folder with `config.json` (the model and
`quantization.quant_algo` / `kv_cache_quant_algo`) and `rank0.safetensors` (one rank) under
TensorRT-LLM's names: transformer.vocab_embedding, transformer.layers.N.{input_layernorm,
attention.qkv, attention.dense, post_layernorm, mlp.fc (the gate projection), mlp.gate (the up
projection), mlp.proj}, transformer.ln_f, lm_head. Scales are dequantization factors
(w ~ q * scale):

    FP8        weight float8_e4m3fn [out, in], weights_scaling_factor and
               activation_scaling_factor (one per tensor)
    W4A16_AWQ  weight int4 packed two per byte along the OUTPUT dimension (rows 2k / 2k+1 in
               the low / high nibble, signed two's complement) [out / 2, in],
               weights_scaling_factor [out, in / group], prequant_scaling_factor [in]
    KV cache   attention.kv_cache_scaling_factor [1] per layer (INT8 or FP8)

Phi-3 (Phi3ForCausalLM): mlp.fc is the whole gate_up, its up rows first (no mlp.gate); config
rotary_pct and, for LongRoPE, position_embedding_type long_rope with original_max_position_embeddings
and longrope_scaling_short_factors / _long_factors (the factor on cos and sin follows from
max_position_embeddings, as TensorRT-LLM computes it).
Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM, unquantized): attention.q_layernorm /
k_layernorm (RMSNorms over each head); config qwen_type, attn_bias, and for Qwen3-MoE
moe_intermediate_size beside its moe section. Qwen2-MoE (Qwen2MoeForCausalLM, unquantized) adds its
shared expert (kiln/constants.py, TRTLLM_SHARED_EXPERT_FC) and moe_shared_expert_intermediate_size.
Mixtral (MixtralForCausalLM, unquantized): a "moe" config section and, instead of the dense MLP,
mlp.router / mlp.fc / mlp.proj with the experts stacked (kiln/constants.py, TRTLLM_MLP_ROUTER).

The names and packing here are shared with the exporter (builder/export.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kiln import constants as names
from kiln.builder.checkpoint import Checkpoint, one_for_fused
from kiln.errors import CheckpointError
from kiln.plugins.formats import pack_int4
from kiln.runtime.spec import LongRope, ModelSpec, RopeScaling

# kiln layer linear -> TensorRT-LLM module(s); gate_up is split into fc (gate) and gate (up)
LINEAR_MODULES = {names.ATTN_QKV: (names.TRTLLM_QKV,), names.ATTN_OUT: (names.TRTLLM_DENSE,),
                  names.MLP_GATE_UP: (names.TRTLLM_MLP_FC, names.TRTLLM_MLP_GATE),
                  names.MLP_DOWN: (names.TRTLLM_MLP_PROJ,)}
NORMS = {names.INPUT_NORM: names.TRTLLM_INPUT_NORM, names.POST_ATTENTION_NORM: names.TRTLLM_POST_NORM}
# Phi-3 keeps gate_up as one module, its halves swapped (swap_halves): up rows, then gate rows
PHI3_LINEAR_MODULES = {**LINEAR_MODULES, names.MLP_GATE_UP: (names.TRTLLM_MLP_FC,)}


def linear_modules(architecture: str) -> dict[str, tuple[str, ...]]:
    return PHI3_LINEAR_MODULES if architecture == "phi3" else LINEAR_MODULES


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [a; b] -> [b; a]: kiln's gate_up (gate, up) <-> TensorRT-LLM's one fused module of both
    (up, gate): Phi-3's mlp.fc, each expert's, a shared expert's."""
    first, second = t.chunk(2)
    return torch.cat([second, first]).contiguous()


def gate_and_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's fused (up, gate) rows (swap_halves) -> kiln's checkpoint gate, up (float32)."""
    up, gate = fused.float().chunk(2)
    return gate, up


def long_rope_attention_factor(max_positions: int, original: int) -> float:
    """LongRoPE's factor on cos and sin when the checkpoint states none (transformers' and TensorRT-LLM's)."""
    scale = max_positions / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def module_tensor(layer: int, module: str, tensor: str) -> str:
    return names.TRTLLM_LAYER.format(layer) + f"{module}.{tensor}"


def unpack_int4_along_out(packed: torch.Tensor) -> torch.Tensor:
    """int8 [out / 2, in] (TensorRT-LLM) -> int8 values [out, in]."""
    u = packed.view(torch.uint8).to(torch.int16)
    low, high = u & 0x0F, u >> 4
    low, high = torch.where(low >= 8, low - 16, low), torch.where(high >= 8, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


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
    head_dim = int(config.get("head_size") or int(config["hidden_size"]) // heads)
    eos = config.get("eos_token_id")
    phi3 = _phi3_options(config, head_dim, source) if arch == "phi3" else {}
    moe = {}
    if (config.get(names.TRTLLM_MOE) or {}).get("num_experts", 0) > 1:
        moe = _moe_options(config, arch, source)
        if arch == "llama":
            arch = "mixtral"  # (TensorRT-LLM's Llama with experts: what kiln calls Mixtral)
    elif arch in ("mixtral", "qwen3_moe", "qwen2_moe"):
        raise CheckpointError(f"{source}: a {config['architecture']} checkpoint without a \"moe\" section "
                              "(num_experts, top_k) in its config")
    return ModelSpec(**moe, **phi3,
        architecture=arch, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        rope_theta=float(config.get("rotary_base", 10000.0)), rope_scaling=scaling,
        norm_eps=float(config.get("norm_epsilon", 1e-5)), tie_embeddings=False,
        qkv_bias=bool(config.get("qkv_bias", config.get("attn_bias", True) if arch in ("qwen2", "qwen2_moe") else False)),
        head_norms=arch in ("qwen3", "qwen3_moe"), bos_id=config.get("bos_token_id"),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        pad_id=config.get("pad_token_id"))


def _phi3_options(config: dict, head_dim: int, source: Path) -> dict:
    """ModelSpec fields of a Phi-3 checkpoint: partial rotary (rotary_pct) and LongRoPE."""
    out = {}
    pct = float(config.get("rotary_pct", 1.0))
    if pct != 1.0:
        out["rotary_dim"] = int(head_dim * pct)
    kind = config.get("position_embedding_type", "rope_gpt_neox")
    if kind == names.TRTLLM_LONG_ROPE:
        original = int(config["original_max_position_embeddings"])
        out["rope_longrope"] = LongRope(
            short_factor=config["longrope_scaling_short_factors"], long_factor=config["longrope_scaling_long_factors"],
            original_max_position_embeddings=original,
            attention_factor=long_rope_attention_factor(int(config["max_position_embeddings"]), original))
    elif kind != "rope_gpt_neox":
        raise CheckpointError(f"{source}: position_embedding_type {kind!r} is not supported (rope_gpt_neox, long_rope)")
    return out


def _moe_options(config: dict, arch: str, source: Path) -> dict:
    """ModelSpec fields of a Mixture-of-Experts checkpoint (TensorRT-LLM's "moe" section)."""
    moe = config[names.TRTLLM_MOE]
    if arch not in ("llama", "mixtral", "qwen3_moe", "qwen2_moe"):
        raise CheckpointError(f"{source}: a {config['architecture']} checkpoint with experts; kiln reads "
                              "Mixture-of-Experts TensorRT-LLM checkpoints of Mixtral, Qwen3-MoE and Qwen2-MoE")
    mode = int(moe.get("normalization_mode", 1))
    if mode not in names.TRTLLM_MOE_NORMALIZATION:
        raise CheckpointError(f"{source}: moe normalization_mode {mode} is not supported (0: none, 1: renormalize)")
    shared = int(config.get("moe_shared_expert_intermediate_size") or moe.get("shared_expert_intermediate_size") or 0)
    if shared and arch != "qwen2_moe":
        raise CheckpointError(f"{source}: a shared expert of {shared} on {config['architecture']} is not supported "
                              "(Qwen2-MoE's is)")
    qwen = arch in ("qwen3_moe", "qwen2_moe")  # (kiln rounds their routing weights to the model dtype, as transformers)
    return dict(num_experts=int(moe["num_experts"]), experts_per_token=int(moe["top_k"]),
                expert_intermediate_size=int(config["moe_intermediate_size" if qwen else "intermediate_size"]),
                normalize_expert_weights=names.TRTLLM_MOE_NORMALIZATION[mode], round_expert_weights=qwen,
                shared_expert_intermediate_size=shared, shared_expert_gated=bool(shared))


def _import_experts(get, spec: ModelSpec, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    """TensorRT-LLM's MOE module (names.TRTLLM_MLP_ROUTER) -> kiln's router and per-expert gate, up,
    down."""
    width, experts = spec.expert_intermediate_size, spec.num_experts
    fc = get(module_tensor(layer, names.TRTLLM_MLP_FC, names.TRTLLM_WEIGHT))
    proj = get(module_tensor(layer, names.TRTLLM_MLP_PROJ, names.TRTLLM_WEIGHT))
    router = get(module_tensor(layer, names.TRTLLM_MLP_ROUTER, names.TRTLLM_WEIGHT))
    for what, tensor, shape in (("mlp.fc", fc, (experts, 2 * width, spec.hidden_size)),
                                ("mlp.proj", proj, (experts, spec.hidden_size, width)),
                                ("mlp.router", router, (experts, spec.hidden_size))):
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"layer {layer} {what} is {tuple(tensor.shape)}; the config says {shape}")
    tensors[names.layer_tensor(layer, names.CKPT_ROUTER)] = router.float()
    if spec.shared_expert_intermediate_size:  # Qwen2-MoE: the layer's dense MLP names, and its gate
        def shared(module: str) -> torch.Tensor:
            return get(module_tensor(layer, module, names.TRTLLM_WEIGHT))

        gate, up = gate_and_up(shared(names.TRTLLM_SHARED_EXPERT_FC))
        for name, tensor in zip(names.CKPT_DENSE_MLP + (names.CKPT_SHARED_GATE,),
                                (gate, up, shared(names.TRTLLM_SHARED_EXPERT_PROJ), shared(names.TRTLLM_SHARED_EXPERT_GATE))):
            tensors[names.layer_tensor(layer, name)] = tensor.float()
    for e in range(experts):
        for name, tensor in zip(names.CKPT_EXPERT, (*gate_and_up(fc[e]), proj[e].float())):
            tensors[names.layer_tensor(layer, names.expert_tensor(e, name))] = tensor


def _import_linear(get, layer: int, modules: tuple[str, ...], algo: str, source: Path) -> dict[str, torch.Tensor]:
    """TensorRT-LLM module(s) -> kiln's quantized tensors for one fused linear (under part names)."""
    def part(module: str, tensor: str) -> torch.Tensor:
        return get(module_tensor(layer, module, tensor))

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
    if algo and spec.num_experts:
        raise CheckpointError(f"{folder}: a {algo} Mixture-of-Experts checkpoint; kiln reads unquantized ones "
                              "(the experts' quantized layout is TensorRT-LLM's own)")
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
        if spec.head_norms:
            for name, trt_name in zip(names.CKPT_HEAD_NORMS, (names.TRTLLM_Q_NORM, names.TRTLLM_K_NORM)):
                tensors[names.layer_tensor(i, name)] = get(names.TRTLLM_LAYER.format(i) + trt_name).float()
        if spec.qkv_bias:
            bias = get(module_tensor(i, names.TRTLLM_QKV, names.TRTLLM_BIAS)).float()
            for name, piece in zip(names.CKPT_QKV_BIASES, bias.split((q, k, k))):
                tensors[names.layer_tensor(i, name)] = piece
        if algo is None:
            qkv = get(module_tensor(i, names.TRTLLM_QKV, names.TRTLLM_WEIGHT)).float()
            for name, piece in zip(("attention.q.weight", "attention.k.weight", "attention.v.weight"),
                                   qkv.split((q, k, k))):
                tensors[names.layer_tensor(i, name)] = piece
            modules = [("attention.o.weight", names.TRTLLM_DENSE)]  # (kiln checkpoint name, module)
            if spec.num_experts:
                _import_experts(get, spec, i, tensors)
            elif spec.architecture == "phi3":  # gate_up is one module, up rows first
                gate, up = gate_and_up(get(module_tensor(i, names.TRTLLM_MLP_FC, names.TRTLLM_WEIGHT)))
                tensors[names.layer_tensor(i, "mlp.gate.weight")], tensors[names.layer_tensor(i, "mlp.up.weight")] = gate, up
                modules.append(("mlp.down.weight", names.TRTLLM_MLP_PROJ))
            else:
                modules += [("mlp.gate.weight", names.TRTLLM_MLP_FC), ("mlp.up.weight", names.TRTLLM_MLP_GATE),
                            ("mlp.down.weight", names.TRTLLM_MLP_PROJ)]
            for name, module in modules:
                tensors[names.layer_tensor(i, name)] = get(module_tensor(i, module, names.TRTLLM_WEIGHT)).float()
        else:
            for linear, modules in linear_modules(spec.architecture).items():
                prefix = names.linear_prefix(names.layer_tensor(i, linear))
                swap = linear == names.MLP_GATE_UP and spec.architecture == "phi3"
                for part, tensor in _import_linear(get, i, modules, algo, folder).items():
                    if swap and part in (names.QWEIGHT, names.WEIGHT_SCALES):
                        tensor = swap_halves(tensor)
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
    tokenizer_files = {n: (folder / n).read_text() for n in (names.TOKENIZER_JSON, names.TOKENIZER_CONFIG_JSON,
                                                             names.CHAT_TEMPLATE_FILE) if (folder / n).is_file()}
    if names.TOKENIZER_JSON not in tokenizer_files:
        raise CheckpointError(f"{folder} has no {names.TOKENIZER_JSON}: put the model's tokenizer files beside "
                              f"{names.TRTLLM_CONFIG} (kiln export writes them there)")
    return Checkpoint(spec, tensors, tokenizer_files, prequantized=prequantized, quantization=quantization)
