"""Checkpoint readers: damaged or unsupported checkpoints give clear errors; builds are atomic."""
import json
import shutil

import pytest
import torch

from kiln.builder.checkpoint import load_checkpoint
from kiln.builder.cli import main
from kiln.errors import CheckpointError
from tests.helpers import write_config


@pytest.fixture
def llama_copy(tiny_models, tmp_path):
    return shutil.copytree(tiny_models["llama"], tmp_path / "llama")


def test_truncated_safetensors(llama_copy):
    path = llama_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(llama_copy)


def test_missing_tensor(llama_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.up.weight"):
        load_checkpoint(llama_copy)


@pytest.mark.parametrize("extra,refused", [
    ("model.layers.0.self_attn.o_proj.bias", True),  # an output-projection bias kiln's Llama has no place for
    ("model.layers.1.self_attn.q_proj.bias", True),  # a q bias on an architecture without them (Qwen2 has them)
    ("model.layers.0.self_attn.q_norm.weight", True),  # a head norm on an architecture without them (Qwen3 has them)
    ("model.layers.1.post_feedforward_layernorm.weight", True),  # Gemma's MLP output norm, on a Llama
    ("model.layers.0.self_attn.rotary_emb.inv_freq", False),  # older exports' RoPE buffer: computed from the config
])
def test_tensors_the_model_would_drop_are_refused_by_name(llama_copy, tiny_models, extra, refused):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_copy / "model.safetensors")
    tensors[extra] = torch.ones(8)
    save_file(tensors, llama_copy / "model.safetensors")
    if refused:
        with pytest.raises(CheckpointError, match=f"has no place for: {extra}"):
            load_checkpoint(llama_copy)
    else:  # skipped: the same tensors as without it
        assert set(load_checkpoint(llama_copy).tensors) == set(load_checkpoint(tiny_models["llama"]).tensors)


def test_unsupported_architecture(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_checkpoint(llama_copy)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}},
     "rope scaling type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75 .* not supported on llama"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     "rope scaling type 'yarn' is not supported"),
])
def test_rope_variants_kiln_cannot_run_on_a_family_are_refused(change, message, tiny_models, tmp_path):
    """(Phi-3 has LongRoPE and partial rotary; Llama, as transformers runs it, neither.)"""
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "llama")
    config = {**json.loads((folder / "config.json").read_text()), **change}
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"\['chunked_attention'\]"),
    ({"layer_types": ["sliding_attention"]}, "each of the 2 layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope type 'yarn' on the full_attention layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope type 'linear' on the sliding_attention layers"),
])
def test_gemma3_variants_kiln_cannot_run_are_refused(change, message, tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models["gemma3"], tmp_path / "gemma3")
    config = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


def test_olmoe_variants_kiln_cannot_run_are_refused(tiny_models, tmp_path):
    """clip_qkv (queries, keys and values clamped) is refused by name; a q norm of the per-head
    length on OLMoE (whose norms span every head) by the tensor's name and shape."""
    from safetensors.torch import load_file, save_file

    from kiln.builder.compile import pack_weights

    folder = shutil.copytree(tiny_models["olmoe"], tmp_path / "olmoe")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(CheckpointError, match="clip_qkv 8.0"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.self_attn.q_norm.weight"
    tensors[key] = tensors[key][:16].clone()  # one head's worth
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers.1.attention.q_norm.weight has shape \(16,\); norms over "
                                              r"each projection of this model take \[64\]"):
        pack_weights(load_checkpoint(folder), torch.float32)


def test_gemma3_configs_of_older_transformers_read_alike(tiny_models, tmp_path):
    """Gemma 3 configs on the Hub (transformers 4.5x) state RoPE as rope_theta, rope_local_base_freq
    and rope_scaling, and the layer pattern as sliding_window_pattern: the same spec as the
    rope_parameters / layer_types form transformers 5 saves."""
    folder = shutil.copytree(tiny_models["gemma3"], tmp_path / "gemma3")
    config = json.loads((folder / "config.json").read_text())
    new = load_checkpoint(folder).spec
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (folder / "config.json").write_text(json.dumps(config))
    old = load_checkpoint(folder).spec
    assert old == new
    assert (new.full_attention_layers, new.local_rope_theta, new.rope_linear_factor) == ((1,), 10_000.0, 8.0)


def test_a_hub_gemma3_4b_config_reads_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json (transformers 4.50) states only what differs from
    Gemma3TextConfig's defaults, nested under text_config: the rest comes from the defaults."""
    from pathlib import Path

    from kiln.builder.checkpoint.hf import spec_from_config

    config = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
              "image_token_index": 262144, "mm_tokens_per_image": 256,
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    spec = spec_from_config(config, {}, Path("gemma-3-4b-it"))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (34, 2560, 8, 4, 256)
    assert (spec.vocab_size, spec.eos_ids, spec.tie_embeddings, spec.sliding_window) == (262_208, (1, 106), True, 1024)
    assert spec.full_attention_layers == (5, 11, 17, 23, 29)
    assert (spec.rope_theta, spec.local_rope_theta, spec.rope_linear_factor) == (1_000_000.0, 10_000.0, 8.0)
    assert spec.query_scale == 256**-0.5 and spec.embed_scale == 2560**0.5 and spec.norm_eps == 1e-6


def test_gemma_norms_are_stored_as_their_multipliers(tiny_models):
    """Gemma's RMSNorm multiplies by (1 + w): the canonical norm weights are 1 + w, every one of
    them (input, both output norms, the MLP's input norm, the head norms and the final norm)."""
    from safetensors.torch import load_file

    raw = load_file(tiny_models["gemma3"] / "model.safetensors")
    tensors = load_checkpoint(tiny_models["gemma3"]).tensors
    pairs = {"model.norm.weight": "final_norm.weight",
             "model.layers.1.input_layernorm.weight": "layers.1.input_norm.weight",
             "model.layers.1.post_attention_layernorm.weight": "layers.1.attention.out_norm.weight",
             "model.layers.1.pre_feedforward_layernorm.weight": "layers.1.post_attention_norm.weight",
             "model.layers.1.post_feedforward_layernorm.weight": "layers.1.mlp.out_norm.weight",
             "model.layers.1.self_attn.k_norm.weight": "layers.1.attention.k_norm.weight"}
    for hf, canonical in pairs.items():
        assert raw[hf].abs().max() > 0.1  # random, not the zeros Gemma starts from
        assert torch.equal(tensors[canonical], 1.0 + raw[hf].float()), hf


def test_a_fused_projection_of_the_wrong_size_is_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_models["phi3"], tmp_path / "phi3")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="qkv_proj.weight has 127 rows; the config says 128"):
        load_checkpoint(folder)


def test_no_tokenizer(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_checkpoint(llama_copy)


def test_pickle_checkpoints_are_not_read(llama_copy):
    (llama_copy / "model.safetensors").rename(llama_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="does not read .bin"):
        load_checkpoint(llama_copy)


def test_sharded_checkpoint(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).save_pretrained(folder, max_shard_size="100KB")
    shutil.copy(tiny_models["llama"] / "tokenizer.json", folder)
    assert (folder / "model.safetensors.index.json").exists()
    whole, sharded = load_checkpoint(tiny_models["llama"]), load_checkpoint(folder)
    assert whole.tensors.keys() == sharded.tensors.keys()
    assert all((whole.tensors[k] == sharded.tensors[k]).all() for k in whole.tensors)


def test_failed_build_keeps_the_previous_output(llama_copy, tmp_path, capsys):
    """A build that fails midway leaves the earlier engine in place and no staging folders."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "ok.yaml", llama_copy)
    assert main(["--config", str(config), "--output", str(out)]) == 0
    before = sorted(p.name for p in out.iterdir())
    path = llama_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    assert main(["--config", str(config), "--output", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == before == ["engine", "triton_repo"]
    assert "truncated or corrupt" in " ".join(capsys.readouterr().err.split())
