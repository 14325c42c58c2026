"""Checkpoints exported by NVIDIA Model Optimizer (its Hugging Face format, hf_quant_config.json),
made in the test from a tiny Llama by Model Optimizer itself, read by kiln. References that kiln
did not write: Model Optimizer's fake-quantized model, and Hugging Face transformers running the
export's tensors dequantized by this test."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kiln import constants as names
from kiln.runtime.engine import Engine
from tests.helpers import build_engine, forward_logits

ROOT = Path(__file__).resolve().parents[2]
MODELOPT_PYTHON = Path(os.environ.get("KILN_MODELOPT_PYTHON", ROOT / ".venv-modelopt" / "bin" / "python"))
GROUP = 32


@pytest.fixture(scope="module")
def modelopt_export(tiny_models, tmp_path_factory):
    if not MODELOPT_PYTHON.exists():
        if os.environ.get("KILN_REQUIRE_MODELOPT"):
            pytest.fail(f"{MODELOPT_PYTHON} is missing: scripts/setup.sh makes it")
        pytest.skip("no Model Optimizer environment (scripts/setup.sh makes .venv-modelopt)")
    root = tmp_path_factory.mktemp("modelopt")
    made = {}

    def export(algo: str) -> tuple[Path, dict]:
        if algo not in made:
            out = root / algo
            subprocess.run([str(MODELOPT_PYTHON), str(Path(__file__).with_name("modelopt_export.py")),
                            str(tiny_models["llama"]), str(out), algo, str(GROUP)], check=True,
                           capture_output=True, timeout=600)
            for name in ("tokenizer.json", "tokenizer_config.json"):  # (the export leaves them out)
                shutil.copy(tiny_models["llama"] / name, out / name)
            made[algo] = out, load_file(root / f"{algo}-logits.safetensors")
        return made[algo]

    return export


def dequantized_hf_model(folder: Path) -> transformers.PreTrainedModel:
    """transformers' Llama with the export's weights dequantized here (AWQ int4 unpacked as
    Model Optimizer documents it: two output rows per byte, row 2k in the low nibble, signed;
    w = q * weight_scale per group, times pre_quant_scale per input)."""
    tensors = load_file(folder / "model.safetensors")
    group = json.loads((folder / names.MODELOPT_QUANT_CONFIG).read_text())["quantization"]["group_size"]
    state = {}
    for key, value in tensors.items():
        if key.endswith(".weight") and value.dtype == torch.uint8:
            base = key.removesuffix("weight")
            b = value.to(torch.int16)
            low, high = b & 15, b >> 4
            low, high = torch.where(low > 7, low - 16, low), torch.where(high > 7, high - 16, high)
            w = torch.stack([low, high], 1).reshape(-1, value.shape[1]).float()
            w = w * tensors[base + "weight_scale"].float().repeat_interleave(group, dim=1)
            if base + "pre_quant_scale" in tensors:
                w = w * tensors[base + "pre_quant_scale"].float()[None, :]
            state[key] = w
        elif not key.endswith(("weight_scale", "pre_quant_scale", "input_scale")):
            state[key] = value.float()
    config = transformers.AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def kiln_logits(folder: Path, tmp_path: Path, prompt: torch.Tensor) -> tuple[torch.Tensor, dict]:
    engine_dir = build_engine(tmp_path / "engine", folder, "float32")
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    return forward_logits(Engine(engine_dir), prompt.tolist()), meta


def test_fp8_export_is_read_exactly(modelopt_export, tmp_path):
    folder, reference = modelopt_export("fp8")
    got, meta = kiln_logits(folder, tmp_path, reference["prompt"])
    assert meta["algo"] == "fp8" and meta["linear"] == "fp8" and "Model Optimizer" in meta["source"]
    # the same E4M3 weights, scales and static activation scales: Model Optimizer's model itself
    torch.testing.assert_close(got, reference["quantized"], rtol=1e-4, atol=1e-4)


def test_int4_awq_export_is_read_exactly(modelopt_export, tmp_path):
    folder, reference = modelopt_export("int4_awq")
    got, meta = kiln_logits(folder, tmp_path, reference["prompt"])
    assert meta["linear"] == "int4" and meta["group_size"] == GROUP
    with torch.inference_mode():
        want = dequantized_hf_model(folder)(reference["prompt"][None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # (Model Optimizer's own fake-quantized model differs from its export: the export gives q, k, v
    # one shared pre-quant scale and requantizes, so only the export's tensors are the reference)


def test_int8_smoothquant_export_is_read_exactly(modelopt_export, tmp_path):
    folder, reference = modelopt_export("int8_sq")
    got, meta = kiln_logits(folder, tmp_path, reference["prompt"])
    assert meta["linear"] == "w8a8" and meta["activations"] == "int8_per_tensor_static"
    # Model Optimizer's W8A8_SQ_PER_CHANNEL: x * pre_quant_scale, rounded with the one static
    # input_scale into [-128, 127], times the int8 weights per channel
    torch.testing.assert_close(got, reference["quantized"], rtol=1e-4, atol=1e-4)


def test_fp8_with_an_fp8_kv_cache_is_read_exactly(modelopt_export, tmp_path):
    folder, reference = modelopt_export("fp8_kv")
    got, meta = kiln_logits(folder, tmp_path, reference["prompt"])
    assert meta["kv_cache"] == "fp8"
    # keys (after rotary embedding) and values rounded to E4M3 with Model Optimizer's scales
    torch.testing.assert_close(got, reference["quantized"], rtol=1e-4, atol=1e-4)


def test_an_unknown_kv_cache_algorithm_is_refused_clearly(modelopt_export, tmp_path):
    from kiln.builder.checkpoint import load_checkpoint
    from kiln.errors import CheckpointError

    folder, _ = modelopt_export("fp8")
    copy = tmp_path / "kv"
    shutil.copytree(folder, copy)
    config = json.loads((copy / names.MODELOPT_QUANT_CONFIG).read_text())
    config["quantization"]["kv_cache_quant_algo"] = "NVFP4"
    (copy / names.MODELOPT_QUANT_CONFIG).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="kv_cache_quant_algo 'NVFP4'"):
        load_checkpoint(copy)
