"""TensorRT-LLM checkpoints: kiln's export, TensorRT-LLM's int4 packing, and the round trip
(export, re-import as a checkpoint, build) reproducing the engine's logits."""
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln import constants as names
from kiln.builder.cli import build as run_build
from kiln.builder.cli import main as build_main
from kiln.builder.checkpoint.trtllm import unpack_int4_along_out
from kiln.builder.export import ExportError, export_checkpoint, pack_int4_along_out
from kiln.errors import CheckpointError
from kiln.runtime.engine import Engine
from tests.helpers import build_engine, forward_logits, generator, write_config

SMALL = {"calibration": {"samples": 8, "seq_len": 64}, "accuracy": {"tokens": 512, "window": 128},
         "accuracy_gate": None}
PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 8, 150, 3]


def test_int4_packing_along_out_is_tensorrt_llms():
    g = generator("trt-int4")
    q = torch.randint(-8, 8, (6, 10), generator=g, dtype=torch.int8)
    packed = pack_int4_along_out(q)
    assert packed.dtype == torch.int8 and packed.shape == (3, 10)
    byte = int(packed.view(torch.uint8)[1, 4])  # rows 2 and 3, column 4: signed nibbles, low = even row
    assert byte & 0x0F == int(q[2, 4]) & 0x0F and byte >> 4 == int(q[3, 4]) & 0x0F
    assert torch.equal(unpack_int4_along_out(packed), q)


@pytest.mark.parametrize("quantization, quant_algo, weight_dtype", [
    ({"algo": "none"}, None, torch.float32),
    ({"algo": "int4_awq", "group_size": 32}, "W4A16_AWQ", torch.int8),
    ({"algo": "int4_awq", "group_size": 32, "lm_head": "int4"}, "W4A16_AWQ", torch.int8),
    ({"algo": "fp8", "fp8_weight_scales": "per_tensor"}, "FP8", torch.float8_e4m3fn),
])
def test_export_and_reimport_reproduce_the_logits(quantization, quant_algo, weight_dtype, tiny_models, tmp_path):
    engine_dir = build_engine(tmp_path / "a", tiny_models["llama"], "float32", quantization={**quantization, **SMALL})
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = json.loads((export / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["quantization"]["quant_algo"] == quant_algo
    assert config["mapping"]["world_size"] == 1 and config["rotary_scaling"]["type"] == "llama3"
    tensors = load_file(export / "rank0.safetensors")
    layer = "transformer.layers.1."
    engine = Engine(engine_dir)
    spec = engine.spec
    assert tensors[layer + "attention.qkv.weight"].dtype == weight_dtype
    assert tensors[layer + "mlp.fc.weight"].shape[0] * (2 if quant_algo == "W4A16_AWQ" else 1) == spec.intermediate_size
    if quant_algo == "W4A16_AWQ":
        assert tensors[layer + "attention.dense.weights_scaling_factor"].shape == (spec.hidden_size, spec.q_size // 32)
        assert tensors[layer + "attention.dense.prequant_scaling_factor"].shape == (spec.q_size,)
        assert not torch.all(tensors[layer + "attention.dense.prequant_scaling_factor"] == 1)  # AWQ's scales
    if quant_algo == "FP8":
        assert tensors[layer + "mlp.proj.weights_scaling_factor"].shape == ()
        assert tensors[layer + "mlp.proj.activation_scaling_factor"].item() > 0

    again = build_engine(tmp_path / "b", export, "float32")
    meta = json.loads((again / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["algo"] == {None: "none", "W4A16_AWQ": "int4_awq", "FP8": "fp8"}[quant_algo]
    want = forward_logits(engine, PROMPT)
    got = forward_logits(Engine(again), PROMPT)
    # the same weights and scales; only the int8 / int4 lm_head comes back dequantized (float32), with
    # the final norm that absorbed its AWQ scales
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_quantized_kv_cache_exports_one_scale_per_layer(tiny_models, tmp_path):
    engine_dir = build_engine(tmp_path / "a", tiny_models["llama"], "bfloat16",
                              quantization={"algo": "none", "kv_cache": "int8", **SMALL})
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = json.loads((export / "config.json").read_text())
    assert config["quantization"]["kv_cache_quant_algo"] == "INT8"
    exported = load_file(export / "rank0.safetensors")["transformer.layers.0.attention.kv_cache_scaling_factor"]
    original = load_file(engine_dir / names.WEIGHTS_FILE)[names.layer_tensor(0, names.ATTN_KV_SCALES)]
    assert exported.shape == (1,) and exported.item() == original.max().item()
    again = Engine(build_engine(tmp_path / "b", export, "bfloat16"))
    assert again.model.kv_dtype == torch.int8
    assert torch.all(again.model.layers[0].kv_scales == exported.item())
    logits = forward_logits(again, PROMPT)
    assert logits.isfinite().all()


@pytest.mark.parametrize("quantization, message", [
    ({"algo": "int8_sq"}, "no TensorRT-LLM checkpoint form"),
    ({"algo": "fp8"}, "fp8_weight_scales: per_tensor"),
])
def test_formats_without_a_faithful_export_are_refused(quantization, message, tiny_models, tmp_path):
    engine_dir = build_engine(tmp_path / "a", tiny_models["llama"], "bfloat16", quantization={**quantization, **SMALL})
    with pytest.raises(ExportError, match=message):
        export_checkpoint(engine_dir, tmp_path / "trtllm")


def test_mixtral_exports_as_tensorrt_llms_moe_and_reimports_to_the_same_logits(tiny_models, tmp_path):
    """Mixtral as TensorRT-LLM's llama converter writes it: a "moe" config section, the router in
    float32, each layer's experts stacked in mlp.fc with an expert's up rows (HF's w3) before its
    gate rows (w1), and mlp.proj; read back, the same logits."""
    engine_dir = build_engine(tmp_path / "a", tiny_models["mixtral"], "float32")
    engine = Engine(engine_dir)
    spec = engine.spec
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = json.loads((export / "config.json").read_text())
    assert config["architecture"] == "MixtralForCausalLM"
    assert config["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
    assert config["intermediate_size"] == spec.expert_intermediate_size
    tensors = load_file(export / "rank0.safetensors")
    width, layer = spec.expert_intermediate_size, "transformer.layers.1."
    assert not any(".mlp.gate." in key for key in tensors)
    assert tensors[layer + "mlp.router.weight"].dtype == torch.float32
    assert tensors[layer + "mlp.fc.weight"].shape == (4, 2 * width, spec.hidden_size)
    assert tensors[layer + "mlp.proj.weight"].shape == (4, spec.hidden_size, width)
    kiln_weights = load_file(engine_dir / names.WEIGHTS_FILE)
    gate_up = kiln_weights[names.layer_tensor(1, names.expert_tensor(3, "gate_up.weight"))]  # rows: gate, up
    assert torch.equal(tensors[layer + "mlp.fc.weight"][3], torch.cat([gate_up[width:], gate_up[:width]]))
    again = Engine(build_engine(tmp_path / "b", export, "float32"))
    assert (again.spec.num_experts, again.spec.experts_per_token, again.spec.normalize_expert_weights) == (4, 2, True)
    torch.testing.assert_close(forward_logits(again, PROMPT), forward_logits(engine, PROMPT), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", [{"algo": "none"}, {"algo": "int4_awq", "group_size": 32}])
def test_phi3_exports_its_fused_mlp_and_long_rope_and_reimports_to_the_same_logits(quantization, tmp_path):
    """Phi-3 as TensorRT-LLM's phi3 converter writes it: gate_up one module, mlp.fc, with its up rows
    before its gate rows (no mlp.gate), partial rotary (rotary_pct) and LongRoPE's factors in the
    config; read back, the same logits (an engine beyond the original context: the long factors)."""
    from tests.helpers import make_tiny_model

    half = 16 * 3 // 4 // 2
    g = torch.Generator().manual_seed(11)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist()}
    folder = make_tiny_model(tmp_path / "phi3", "phi3", seed=7, rope_parameters=rope, original_max_position_embeddings=32)
    engine_dir = build_engine(tmp_path / "a", folder, "float32", quantization={**quantization, **SMALL},
                              max_input_len=64, max_seq_len=128)
    engine = Engine(engine_dir)
    spec = engine.spec
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = json.loads((export / "config.json").read_text())
    assert (config["architecture"], config["hidden_act"], config["rotary_pct"]) == ("Phi3ForCausalLM", "swiglu", 0.75)
    assert config["position_embedding_type"] == "long_rope" and config["original_max_position_embeddings"] == 32
    assert config["longrope_scaling_long_factors"] == list(spec.rope_longrope.long_factor)
    tensors = load_file(export / "rank0.safetensors")
    assert not any(".mlp.gate." in key for key in tensors)
    fc = tensors["transformer.layers.1.mlp.fc.weight"]
    kiln_weights = load_file(engine_dir / names.WEIGHTS_FILE)
    if quantization["algo"] == "none":
        gate_up = kiln_weights[names.layer_tensor(1, names.MLP_GATE_UP)]  # rows: gate, up
        width = spec.intermediate_size
        assert torch.equal(fc, torch.cat([gate_up[width:], gate_up[:width]]))
    else:  # int4: two rows a byte along the output; the up rows' scales first
        assert fc.shape == (spec.intermediate_size, spec.hidden_size) and fc.dtype == torch.int8
        scales = kiln_weights[names.linear_tensor(names.linear_prefix(names.layer_tensor(1, names.MLP_GATE_UP)),
                                                  names.WEIGHT_SCALES)]
        assert torch.equal(tensors["transformer.layers.1.mlp.fc.weights_scaling_factor"], scales.float().roll(
            -spec.intermediate_size, dims=0))
    again = Engine(build_engine(tmp_path / "b", export, "float32", max_input_len=64, max_seq_len=128))
    assert (again.spec.rotary_dim, again.spec.rope_longrope) == (spec.rotary_dim, spec.rope_longrope)
    torch.testing.assert_close(forward_logits(again, PROMPT), forward_logits(engine, PROMPT), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, quantization", [
    ("qwen2", {"algo": "none"}),
    ("qwen3", {"algo": "none"}),
    ("qwen3", {"algo": "int4_awq", "group_size": 32}),
    ("qwen3_moe", {"algo": "none"}),
    ("qwen2_moe", {"algo": "none"}),
])
def test_qwen_exports_as_tensorrt_llms_qwen_and_reimports_to_the_same_logits(arch, quantization, tiny_models, tmp_path):
    """Qwen2, Qwen3, Qwen3-MoE and Qwen2-MoE as TensorRT-LLM's qwen converter writes them:
    qwen_type, attn_bias (Qwen2's q / k / v biases), Qwen3's attention.q_layernorm / k_layernorm,
    for an MoE its experts' width beside the moe section, and Qwen2-MoE's shared expert; read back,
    the same model and logits."""
    engine_dir = build_engine(tmp_path / "a", tiny_models[arch], "float32", quantization={**quantization, **SMALL})
    engine = Engine(engine_dir)
    spec = engine.spec
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = json.loads((export / "config.json").read_text())
    assert (config["architecture"], config["qwen_type"], config["attn_bias"]) == (
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "qwen2_moe": "Qwen2MoeForCausalLM"}[arch], arch, arch.startswith("qwen2"))
    tensors = load_file(export / "rank0.safetensors")
    kiln_weights = load_file(engine_dir / names.WEIGHTS_FILE)
    assert ("transformer.layers.0.attention.qkv.bias" in tensors) == arch.startswith("qwen2")
    assert ("transformer.layers.0.attention.q_layernorm.weight" in tensors) == spec.head_norms
    for trt_name, kiln_name in (("q_layernorm", names.ATTN_Q_NORM), ("k_layernorm", names.ATTN_K_NORM))[:2 * spec.head_norms]:
        exported = tensors[f"transformer.layers.1.attention.{trt_name}.weight"]
        assert exported.shape == (spec.head_dim,) and torch.equal(exported, kiln_weights[names.layer_tensor(1, kiln_name)])
    if arch == "qwen3_moe":  # 6 experts of 48, 2 a token, their weights not renormalized
        assert config["moe"] == {"num_experts": 6, "top_k": 2, "normalization_mode": 0}
        assert config["moe_intermediate_size"] == spec.expert_intermediate_size == 48
    if arch == "qwen2_moe":  # and a gated shared expert: up rows before gate rows, as the experts'
        assert config["moe_shared_expert_intermediate_size"] == spec.shared_expert_intermediate_size > 0
        gate_up = kiln_weights[names.layer_tensor(1, names.MLP_GATE_UP)]
        width = spec.shared_expert_intermediate_size
        assert torch.equal(tensors["transformer.layers.1.mlp.shared_expert.fc.weight"],
                           torch.cat([gate_up[width:], gate_up[:width]]))
        assert tensors["transformer.layers.1.mlp.shared_expert_gate.weight"].shape == (1, spec.hidden_size)
    again_engine = Engine(build_engine(tmp_path / "b", export, "float32"))
    again = again_engine.spec
    assert (again.qkv_bias, again.head_norms) == (spec.qkv_bias, spec.head_norms)
    moe_fields = ("num_experts", "expert_intermediate_size", "normalize_expert_weights", "round_expert_weights",
                  "shared_expert_intermediate_size", "shared_expert_gated")
    assert [getattr(again, f) for f in moe_fields] == [getattr(spec, f) for f in moe_fields]
    torch.testing.assert_close(forward_logits(again_engine, PROMPT), forward_logits(engine, PROMPT), rtol=1e-5, atol=1e-5)


def test_a_quantized_mixture_of_experts_export_is_refused(tiny_models, tmp_path):
    engine_dir = build_engine(tmp_path / "a", tiny_models["mixtral"], "bfloat16",
                              quantization={"algo": "int4_wo", "group_size": 32, **SMALL})
    with pytest.raises(ExportError, match="int4_wo Mixture-of-Experts engine has no TensorRT-LLM checkpoint form"):
        export_checkpoint(engine_dir, tmp_path / "trtllm")
    assert not (tmp_path / "trtllm").exists()


def test_tensorrt_llm_experts_of_the_wrong_shape_are_refused(tiny_models, tmp_path):
    from safetensors.torch import save_file

    export = export_checkpoint(build_engine(tmp_path / "a", tiny_models["mixtral"], "float32"), tmp_path / "trtllm")
    tensors = load_file(export / "rank0.safetensors")
    key = "transformer.layers.0.mlp.proj.weight"
    tensors[key] = tensors[key][:3].contiguous()  # 3 experts where the config says 4
    save_file(tensors, export / "rank0.safetensors")
    config = write_config(tmp_path / "b.yaml", export, "float32")
    with pytest.raises(CheckpointError, match=r"layer 0 mlp.proj is \(3, "):
        run_build(config, tmp_path / "b")


@pytest.mark.parametrize("arch", ["gemma3", "olmoe"])
def test_an_architecture_the_export_does_not_cover_is_refused(arch, tiny_engines, tmp_path):
    with pytest.raises(ExportError, match=f"does not write {arch} models yet"):
        export_checkpoint(tiny_engines(arch), tmp_path / "trtllm")
    assert not (tmp_path / "trtllm").exists()


def test_a_sliding_window_shorter_than_the_engine_is_refused(tmp_path):
    """TensorRT-LLM's checkpoint cannot carry the window: exporting would lose it silently."""
    from tests.helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "mistral", sliding_window=64)
    with pytest.raises(ExportError, match="sliding window of 64 positions up to max_seq_len 512"):
        export_checkpoint(build_engine(tmp_path / "long", folder), tmp_path / "trtllm")
    assert not (tmp_path / "trtllm").exists()
    export_checkpoint(build_engine(tmp_path / "short", folder, max_input_len=32, max_seq_len=64), tmp_path / "ok")


def test_a_quantized_checkpoint_is_built_as_it_is(tiny_models, tmp_path, capsys):
    engine_dir = build_engine(tmp_path / "a", tiny_models["llama"], "float32",
                              quantization={"algo": "fp8", "fp8_weight_scales": "per_tensor", **SMALL})
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    config = write_config(tmp_path / "b.yaml", export, "float32", quantization={"algo": "int8_sq"})
    assert build_main(["--config", str(config), "--output", str(tmp_path / "b")]) == 2
    assert "is already quantized" in " ".join(capsys.readouterr().err.split())  # (rich wraps lines)


def test_kiln_export_cli(tiny_engines, tmp_path, capsys):
    from kiln.cli import main

    assert main(["export", "--engine", str(tiny_engines("llama")), "--output", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "rank0.safetensors").is_file() and (tmp_path / "t" / "tokenizer.json").is_file()


def test_rotated_fp8_keys_export_a_scale_that_bounds_them_unrotated(tiny_models, tmp_path):
    """An FP8 cache with rotated keys (key_rotation auto): TensorRT-LLM stores keys unrotated, so
    the exported scale must bound H (H k) = k from the rotated keys' scales."""
    from kiln.builder.export import _kv_scale
    from kiln.plugins.formats import hadamard_matrix

    engine_dir = build_engine(tmp_path / "a", tiny_models["llama"], "bfloat16",
                              quantization={"algo": "none", "kv_cache": "fp8", **SMALL})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["key_rotation"] == names.KEY_ROTATION_HADAMARD
    export = export_checkpoint(engine_dir, tmp_path / "trtllm")
    again = Engine(build_engine(tmp_path / "b", export, "bfloat16"))
    assert again.model.kv_dtype == torch.float8_e4m3fn and again.model.key_hadamard == 0
    assert forward_logits(again, PROMPT).isfinite().all()
    # the bound itself, on keys with a few large channels (as RoPE'd keys have)
    spec = again.spec
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(500, spec.num_kv_heads, spec.head_dim, generator=g)
    keys[..., 3] *= 40
    rotated = keys @ hadamard_matrix(spec.head_dim)
    scales = torch.stack([rotated.abs().amax(0).reshape(-1), torch.rand(spec.kv_size, generator=g)]) / 448
    bound = _kv_scale(scales, meta, spec) * 448
    assert keys.abs().max() <= bound * (1 + 1e-5)
    assert _kv_scale(scales, {}, spec) * 448 < keys.abs().max()  # the rotated scales alone would saturate
