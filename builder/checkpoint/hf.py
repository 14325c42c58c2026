"""Hugging Face folders: config.json + one or many .safetensors files + tokenizer.json."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from kiln import constants as names
from kiln.builder.checkpoint import Checkpoint, refuse_unused
from kiln.errors import CheckpointError
from kiln.runtime.spec import LongRope, ModelSpec, RopeScaling

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text models (model_type gemma3_text: the 1B, or a text-only export)
    "Gemma3ForConditionalGeneration": "gemma3",  # 4B and up: the language model of the multimodal checkpoint
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
# Mixture-of-Experts layers: the router, and each expert's projections (Mixtral's w1 / w3 / w2 are
# the gate / up / down projections)
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_NAMES = {"w1": "gate.weight", "w3": "up.weight", "w2": "down.weight", "gate_proj": "gate.weight",
                 "up_proj": "up.weight", "down_proj": "down.weight"}
_ROUTERS = {"mixtral": "block_sparse_moe.gate.weight", "qwen3_moe": "mlp.gate.weight", "olmoe": "mlp.gate.weight",
            "qwen2_moe": "mlp.gate.weight"}
# Qwen2-MoE's shared expert: the canonical dense MLP beside the router and experts, and its gate
_SHARED_EXPERT_NAMES = {"mlp.shared_expert.gate_proj.weight": "mlp.gate.weight",
                        "mlp.shared_expert.up_proj.weight": "mlp.up.weight",
                        "mlp.shared_expert.down_proj.weight": "mlp.down.weight",
                        "mlp.shared_expert_gate.weight": names.CKPT_SHARED_GATE}
# transformers' Gemma3TextConfig defaults: configs on the Hub leave out what equals them
GEMMA3_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True,
}
# a multimodal Gemma 3 checkpoint's language model -> the text model's names; its vision tower and
# projector are not part of a text engine
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attention.q.weight",
    "self_attn.k_proj.weight": "attention.k.weight",
    "self_attn.v_proj.weight": "attention.v.weight",
    "self_attn.o_proj.weight": "attention.o.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.q_proj.bias": "attention.q.bias",
    "self_attn.k_proj.bias": "attention.k.bias",
    "self_attn.v_proj.bias": "attention.v.bias",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
# Gemma: the norm after attention is an output norm; the MLP's input norm is pre_feedforward's
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "attention.out_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "mlp.out_norm.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": names.CKPT_EMBED,
    "model.norm.weight": names.CKPT_FINAL_NORM,
    "lm_head.weight": names.CKPT_LM_HEAD,
}
# fused projections (Phi-3) -> the canonical tensors they hold, row blocks in this order
_FUSED = {
    "self_attn.qkv_proj.weight": ("attention.q.weight", "attention.k.weight", "attention.v.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate.weight", "mlp.up.weight"),
}
# tensors some checkpoints carry that hold nothing kiln needs (older exports saved RoPE's inverse
# frequencies, which kiln computes from the config)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (names.TOKENIZER_JSON, names.TOKENIZER_CONFIG_JSON, names.SPECIAL_TOKENS_MAP_JSON,
                   names.CHAT_TEMPLATE_FILE)  # the chat template: transformers 4.43+ saves it on its own


def canonical_name(hf_name: str, architecture: str) -> str | None:
    for prefix in _LANGUAGE_MODEL_PREFIXES if architecture == "gemma3" else ():
        if hf_name.startswith(prefix):
            hf_name = "model." + hf_name.removeprefix(prefix)
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    layer_names = _GEMMA_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    match = _LAYER.match(hf_name)
    if match and match.group(2) in layer_names:
        return names.layer_tensor(int(match.group(1)), layer_names[match.group(2)])
    if match and architecture == "qwen2_moe" and match.group(2) in _SHARED_EXPERT_NAMES:
        return names.layer_tensor(int(match.group(1)), _SHARED_EXPERT_NAMES[match.group(2)])
    if match and architecture in _ROUTERS:
        if match.group(2) == _ROUTERS[architecture]:
            return names.layer_tensor(int(match.group(1)), names.CKPT_ROUTER)
        expert = _EXPERT.match(match.group(2))
        if expert:
            return names.layer_tensor(int(match.group(1)),
                                      names.expert_tensor(int(expert.group(1)), _EXPERT_NAMES[expert.group(2)]))
    return None


def _gemma_norms(tensors: dict) -> None:
    """Gemma's RMSNorms multiply by (1 + w): store the multipliers (1 + w in float32, as
    transformers computes them), so kiln's norms and its scale folding apply unchanged."""
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + tensors[name].float()


def _fused_parts(hf_name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, canonical names) of a fused projection's tensor, else None."""
    match = _LAYER.match(hf_name)
    if match and match.group(2) in _FUSED:
        return int(match.group(1)), _FUSED[match.group(2)]
    return None


def _split_fused(raw: dict, spec: ModelSpec) -> dict:
    """Phi-3's qkv_proj (q, k, v rows) and gate_up_proj (gate, up rows) as the canonical tensors."""
    out = {}
    for key, tensor in raw.items():
        fused = _fused_parts(key)
        if fused is None:
            continue
        layer, parts = fused
        sizes = [spec.q_size, spec.kv_size, spec.kv_size] if len(parts) == 3 else [spec.intermediate_size] * 2
        if tensor.shape[0] != sum(sizes):
            raise CheckpointError(f"{key} has {tensor.shape[0]} rows; the config says {sum(sizes)}")
        for name, piece in zip(parts, tensor.split(sizes)):
            out[names.layer_tensor(layer, name)] = piece.float()
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(config: dict, source: Path, arch: str) -> dict:
    """ModelSpec's RoPE fields: the base, and Llama 3 / linear / (Phi-3) LongRoPE scaling."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return dict(rope_theta=theta)
    if kind == "llama3":
        return dict(rope_theta=theta, rope_scaling=RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        ))
    if kind == "linear":
        return dict(rope_theta=theta, rope_linear_factor=float(scaling["factor"]))
    if kind == "longrope" and arch == "phi3":  # as transformers' _compute_longrope_parameters
        original = int(scaling.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
        factor = scaling.get("factor") or int(config.get("max_position_embeddings", original)) / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return dict(rope_theta=theta, rope_longrope=LongRope(
            short_factor=scaling["short_factor"], long_factor=scaling["long_factor"],
            original_max_position_embeddings=original, attention_factor=float(attention)))
    raise CheckpointError(f"{source}: rope scaling type {kind!r} is not supported (default, llama3, linear; "
                          "longrope on Phi-3)")


def _gemma3_options(config: dict, source: Path) -> dict:
    """ModelSpec fields of a Gemma 3 text config (transformers' Gemma3TextConfig, as saved by
    transformers 4.50+ or 5.x); what kiln does not implement is refused by name."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:  # Gemma 2 style tanh soft-capping
            raise CheckpointError(f"{source}: {key} {config[key]} (soft-capped logits) is not supported")
    if config.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention (an encoder variant) is not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{source}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) else "full_attention"
        for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise CheckpointError(f"{source}: layer_types must name each of the {layers} layers sliding_attention or "
                              f"full_attention; got {len(types)} entries{', with ' + str(unknown) if unknown else ''}")
    rope = config.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or config.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    linear = None
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "linear" and kind == "full_attention":
            linear = float(params["factor"])
        elif rope_type not in (None, "default"):
            raise CheckpointError(f"{source}: rope type {rope_type!r} on the {kind} layers is not supported "
                                  "(default, or linear on the full_attention layers)")
    window = config.get("sliding_window")
    return dict(
        head_norms=True, output_norms=True, activation="gelu_tanh",
        embed_scale=float(config["hidden_size"]) ** 0.5,
        query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_theta=float(full["rope_theta"]), local_rope_theta=float(local["rope_theta"]), rope_linear_factor=linear,
        sliding_window=int(window) if window else None,
        full_attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def _moe_options(config: dict, source: Path, arch: str) -> dict:
    """ModelSpec fields of Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE (every layer's MLP a set of
    experts; what kiln does not implement is refused by name)."""
    span, shared = "head", {}
    if arch == "olmoe":  # routed as Qwen3-MoE; its q / k norms span every head of the projection
        if config.get("clip_qkv") is not None:
            raise CheckpointError(f"{source}: clip_qkv {config['clip_qkv']} (clamped q / k / v) is not supported")
        experts, width = int(config["num_experts"]), int(config["intermediate_size"])
        normalize, rounded, span = bool(config.get("norm_topk_prob", False)), True, "projection"
    elif arch in ("qwen3_moe", "qwen2_moe"):
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise CheckpointError(f"{source}: dense layers among the experts' (mlp_only_layers "
                                  f"{config.get('mlp_only_layers')}, decoder_sparse_step "
                                  f"{config.get('decoder_sparse_step')}) are not supported yet")
        # (the Hub's configs say num_experts; transformers 5 saves it as num_local_experts)
        experts = int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])
        width = int(config["moe_intermediate_size"])
        normalize, rounded = bool(config.get("norm_topk_prob", False)), True
        if arch == "qwen2_moe":  # a shared expert beside the routed ones, gated by a sigmoid
            shared = dict(shared_expert_intermediate_size=int(config["shared_expert_intermediate_size"]),
                          shared_expert_gated=True)
    else:
        experts, width, normalize, rounded = int(config["num_local_experts"]), int(config["intermediate_size"]), True, False
    sliding = config.get("sliding_window") if config.get("use_sliding_window", arch == "mixtral") else None
    return dict(**_rope(config, source, arch), head_norms=arch in ("qwen3_moe", "olmoe"), head_norms_span=span,
                qkv_bias=arch == "qwen2_moe" and bool(config.get("qkv_bias", True)), **shared,
                sliding_window=int(sliding) if sliding else None,
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                num_experts=experts, experts_per_token=int(config["num_experts_per_tok"]),
                expert_intermediate_size=width, normalize_expert_weights=normalize, round_expert_weights=rounded)


def spec_from_config(config: dict, generation: dict, source: Path) -> ModelSpec:
    archs = config.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{source}: architectures {archs} not supported; kiln reads {sorted(ARCHITECTURES)}"
        )
    if "Gemma3ForConditionalGeneration" in archs:  # the language model's config, as transformers nests it
        top = {key: config[key] for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
               if config.get(key) is not None}  # (the Hub's 4B-27B configs state eos [1, 106] at the top)
        config = {**{k: v for k, v in (config.get("text_config") or {}).items() if v is not None}, **top}
    if arch == "gemma3":
        config = {**GEMMA3_DEFAULTS, **config}
    if config.get("mlp_bias") or (arch in ("llama", "qwen3", "gemma3", "qwen3_moe", "olmoe") and config.get("attention_bias")):
        raise CheckpointError(f"{source}: attention_bias / mlp_bias Llama variants are not supported")
    rope = config.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0)
    if partial != 1.0 and arch != "phi3":  # (Phi-4-mini has it; transformers' other families here do not)
        raise CheckpointError(f"{source}: partial_rotary_factor {partial} (rotary embedding on part of each head) is "
                              f"not supported on {arch} (Phi-3 / Phi-4 only)")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    if arch == "gemma3":
        options = _gemma3_options(config, source)
    elif arch in _ROUTERS:
        options = _moe_options(config, source, arch)
    else:
        sliding = config.get("sliding_window") if config.get("use_sliding_window", arch in ("mistral", "phi3")) else None
        options = dict(**_rope(config, source, arch), qkv_bias=arch == "qwen2", head_norms=arch == "qwen3",
                       sliding_window=int(sliding) if sliding else None,
                       rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
                       tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        bos_id=config.get("bos_token_id"),
        eos_ids=eos,
        pad_id=config.get("pad_token_id"),
        **options,
    )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors files (kiln does not read .bin/.pt)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{folder}: {f.name} is listed in the index but missing")
    return files


def load_hf(folder: Path) -> Checkpoint:
    config = _read_json(folder / "config.json")
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    try:
        spec = spec_from_config(config, generation, folder)
    except KeyError as exc:
        raise CheckpointError(f"{folder}/config.json lacks the key {exc}") from None
    from kiln.builder.checkpoint.modelopt import read_quant_config, take_quantized

    quant = read_quant_config(folder)  # a Model Optimizer export, or None
    raw, unknown = {}, []  # (a Model Optimizer export's every tensor is take_quantized's to read)
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if quant is not None or canonical_name(key, spec.architecture) is not None or _fused_parts(key):
                        raw[key] = f.get_tensor(key)
                    elif not key.endswith(_IGNORED_SUFFIXES) and not (
                            spec.architecture == "gemma3" and key.startswith(_VISION_PREFIXES)):
                        unknown.append(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc} (is it truncated or corrupt?)") from None
    canonical = {key: canonical_name(key, spec.architecture) for key in raw
                 if canonical_name(key, spec.architecture) is not None}
    if quant is None:
        refuse_unused(folder, spec, unknown, canonical)
    prequantized, quantization = take_quantized(raw, spec, quant, folder) if quant is not None else ({}, None)
    tensors = {canonical[key]: t.float() for key, t in raw.items() if key in canonical}
    tensors.update(_split_fused(raw, spec))
    if spec.architecture == "gemma3":
        _gemma_norms(tensors)
    tokenizer_files = {}
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            tokenizer_files[name] = (folder / name).read_text()
    if "tokenizer.json" not in tokenizer_files:
        raise CheckpointError(
            f"{folder} has no tokenizer.json (a fast tokenizer file); save one with "
            f"AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
        )
    return Checkpoint(spec, tensors, tokenizer_files, prequantized=prequantized, quantization=quantization)
