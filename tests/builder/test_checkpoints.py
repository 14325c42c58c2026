"""Checkpoint readers: damaged or unsupported checkpoints give clear errors; builds are atomic."""
import json
import shutil

import pytest

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
                          "long_factor": [2.0] * 8}}, "rope scaling type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75"),
])
def test_phi_variants_kiln_cannot_run_yet_are_refused(change, message, tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models["phi3"], tmp_path / "phi3")
    config = {**json.loads((folder / "config.json").read_text()), **change}
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


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
