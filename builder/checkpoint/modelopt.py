"""Checkpoints quantized by NVIDIA Model Optimizer, in its Hugging Face export format: a Hugging
Face folder with `hf_quant_config.json` and, per quantized linear, under the usual HF names:

    FP8                  weight float8_e4m3fn [out, in], weight_scale and input_scale (one each)
    W4A16_AWQ            weight uint8 [out / 2, in]: int4 packed along the OUTPUT dimension (rows
                         2k / 2k+1 in the low / high nibble, signed), weight_scale [out, in / group],
                         pre_quant_scale [in] where AWQ's scale could not be folded into a norm
    W8A8_SQ_PER_CHANNEL  weight int8 [out, in], weight_scale [out], pre_quant_scale [in] (the
                         SmoothQuant scale, on every linear), input_scale (static per tensor)
    kv_cache_quant_algo FP8: self_attn.k_proj.k_scale and v_proj.v_scale per layer (E4M3 keys
                         after rotary embedding and values, one scale each)

kiln keeps them as they are (fusing q/k/v and gate/up row-wise) and computes as Model Optimizer's
fake-quantized model does: FP8 and W4A16 through kiln's own kernels, W8A8 with the static
activation scale. Checked in tests against an export Model Optimizer makes of a tiny Llama."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln import constants as names
from kiln.builder.checkpoint import one_for_fused
from kiln.builder.checkpoint.trtllm import unpack_int4_along_out
from kiln.errors import CheckpointError
from kiln.plugins.formats import pack_int4
from kiln.runtime.spec import ModelSpec

# kiln's fused linear -> the HF modules it is made of (rows in this order)
HF_MODULES = {names.ATTN_QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              names.ATTN_OUT: ("self_attn.o_proj",),
              names.MLP_GATE_UP: ("mlp.gate_proj", "mlp.up_proj"),
              names.MLP_DOWN: ("mlp.down_proj",)}
ALGOS = {names.MODELOPT_FP8: ("fp8", names.LINEAR_FP8), names.MODELOPT_W4A16_AWQ: ("int4_awq", names.LINEAR_INT4),
         names.MODELOPT_W8A8_SQ: ("int8_sq", names.LINEAR_W8A8)}
UNQUANTIZED_OK = ("lm_head", "model.embed_tokens")


def read_quant_config(folder: Path) -> dict | None:
    path = folder / names.MODELOPT_QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    quant = config.get("quantization") or {}
    algo = quant.get("quant_algo")
    if algo not in ALGOS:
        raise CheckpointError(f"{path}: quant_algo {algo!r} is not one kiln reads ({', '.join(ALGOS)})")
    if quant.get("kv_cache_quant_algo") not in (None, names.MODELOPT_FP8):
        raise CheckpointError(f"{path}: kv_cache_quant_algo {quant['kv_cache_quant_algo']!r} is not one kiln reads "
                              f"(none, FP8); export without it and set quantization.kv_cache to have kiln "
                              f"calibrate its own")
    excluded = [m for m in quant.get("exclude_modules") or [] if m not in UNQUANTIZED_OK]
    if excluded:
        raise CheckpointError(f"{path}: layers left unquantized ({excluded}) are not supported")
    producer = config.get("producer") or {}
    quant["producer"] = f"{producer.get('name', 'modelopt')} {producer.get('version', '')}".strip()
    return quant


def take_quantized(raw: dict[str, torch.Tensor], spec: ModelSpec, quant: dict,
                   source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Pops the quantized linears' tensors from `raw` (HF name -> tensor); returns them as
    engine tensors (kiln's formats, fused) and engine.json's `quantization` entry."""
    algo = quant["quant_algo"]
    kiln_algo, kind = ALGOS[algo]

    def pop(key: str) -> torch.Tensor:
        if key not in raw:
            raise CheckpointError(f"{source}: a {algo} checkpoint lacks {key}")
        return raw.pop(key)

    out: dict[str, torch.Tensor] = {}
    for i in range(spec.num_layers):
        for fused, modules in HF_MODULES.items():
            where = f"{source}: layer {i} {'/'.join(modules)}"
            keys = [f"model.layers.{i}.{m}." for m in modules]
            weights = [pop(k + "weight") for k in keys]
            w_scales = [pop(k + names.MODELOPT_WEIGHT_SCALE).float() for k in keys]
            pre = [raw.pop(k + names.MODELOPT_PRE_QUANT_SCALE, None) for k in keys]
            act = [raw.pop(k + names.MODELOPT_INPUT_SCALE, None) for k in keys]
            part: dict[str, torch.Tensor] = {}
            if kind == names.LINEAR_FP8:
                part[names.QWEIGHT] = torch.cat(weights).contiguous()
                part[names.WEIGHT_SCALES] = torch.cat([s.reshape(-1).expand(w.shape[0])
                                                       for s, w in zip(w_scales, weights)]).contiguous()
            elif kind == names.LINEAR_INT4:
                q = torch.cat([unpack_int4_along_out(w) for w in weights])
                part[names.QWEIGHT] = pack_int4(q)
                part[names.WEIGHT_SCALES] = torch.cat(w_scales).contiguous()
            else:
                part[names.QWEIGHT] = torch.cat(weights).to(torch.int8).contiguous()
                part[names.WEIGHT_SCALES] = torch.cat([s.reshape(-1) for s in w_scales]).contiguous()
                part[names.WEIGHT_SUM] = part[names.QWEIGHT].to(torch.int32).sum(dim=1, dtype=torch.int32)
            if any(p is not None for p in pre):
                if any(p is None for p in pre):
                    raise CheckpointError(f"{where}: pre_quant_scale on some of the fused linears only")
                part[names.PRE_SCALE] = one_for_fused([p.float().reshape(-1) for p in pre], "pre_quant_scale", where)
            if kind in (names.LINEAR_FP8, names.LINEAR_W8A8):
                if any(a is None for a in act):
                    raise CheckpointError(f"{where}: a {algo} linear lacks its input_scale")
                part[names.INPUT_SCALE] = one_for_fused([a.float().reshape(1) for a in act], "input_scale", where)
            prefix = names.linear_prefix(names.layer_tensor(i, fused))
            out.update({names.linear_tensor(prefix, k): v for k, v in part.items()})
        if quant.get("kv_cache_quant_algo"):
            k_scale = pop(f"model.layers.{i}.{names.MODELOPT_K_SCALE}").float().reshape(())
            v_scale = pop(f"model.layers.{i}.{names.MODELOPT_V_SCALE}").float().reshape(())
            out[names.layer_tensor(i, names.ATTN_KV_SCALES)] = torch.stack(
                [k_scale.expand(spec.kv_size), v_scale.expand(spec.kv_size)]).contiguous()
    kv_cache = names.KV_CACHE_FP8 if quant.get("kv_cache_quant_algo") else "none"
    meta = {"algo": kiln_algo, "linear": kind, "kv_cache": kv_cache, "key_rotation": names.KEY_ROTATION_NONE,
            "source": f"Model Optimizer Hugging Face export ({quant['producer']}, {algo})"}
    if kind == names.LINEAR_INT4:
        meta["group_size"] = int(quant["group_size"])
    if kind == names.LINEAR_FP8:
        meta["activations"] = "fp8_per_tensor_static"
    if kind == names.LINEAR_W8A8:
        meta["activations"] = "int8_per_tensor_static"
    return out, meta
