"""Quantized builds: folding, each algorithm end to end on a tiny model, the accuracy gate, and
SmolLM2 int8_sq / int4_awq within their gates on held-out text."""
import json

import pytest
import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.builder.cli import main as build_main
from kiln.quantize.algorithms import LayerWeights, awq_scales, pick_group_size, smoothquant_scales
from kiln.runtime.engine import Engine
from kiln.runtime.spec import ModelSpec
from tests.helpers import SMOLLM2_CHECKPOINT, build_engine, forward_logits, write_config

SMALL_CALIBRATION = {"samples": 8, "seq_len": 64}
SMALL_ACCURACY = {"tokens": 512, "window": 128}
PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12]


def packed_float_weights(tiny_engines):
    engine = Engine(tiny_engines("llama"))
    return engine, {k: v.clone() for k, v in _weights(engine).items()}


def _weights(engine):
    from safetensors.torch import load_file

    return load_file(engine.dir / names.WEIGHTS_FILE)


class PreScaled:
    def __init__(self, weight, pre_scale):
        self.weight, self.pre_scale = weight, pre_scale

    def __call__(self, x):
        return F.linear(x * self.pre_scale, self.weight)


def test_smoothquant_folding_keeps_the_float_model(tiny_engines):
    """x / s folded into the norms, the up rows and a pre-scale; W * s: same logits before rounding."""
    engine, weights = packed_float_weights(tiny_engines)
    want = forward_logits(engine, PROMPT)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(engine.model.layers):
        lw = LayerWeights.take(weights, i)
        scales = {n: smoothquant_scales(getattr(lw, n), torch.rand(getattr(lw, n).shape[1], generator=g) * 10 + 0.1,
                                        0.5) for n in ("qkv", "gate_up", "down", "out")}
        assert all((s - 1).abs().max() > 0.1 for s in scales.values())  # the scales do something
        lw.apply_scales(scales)
        layer.input_norm, layer.post_attention_norm = lw.input_norm, lw.post_attention_norm
        layer.qkv.weight, layer.gate_up.weight, layer.down.weight = lw.qkv, lw.gate_up, lw.down
        layer.out = PreScaled(lw.out, lw.pre_scale_out)
    got = forward_logits(engine, PROMPT)
    assert (got - want).abs().max() < 1e-4


def test_awq_scale_search_never_loses_to_no_scaling():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(256, 128, generator=g) * torch.linspace(0.1, 8, 128)  # some channels matter more
    s = awq_scales(w, x, x.abs().mean(0), 32)
    from kiln.quantize.formats import fake_quant_int4

    plain = (x @ (fake_quant_int4(w, 32)).T - x @ w.T).pow(2).mean()
    scaled = (x @ (fake_quant_int4(w * s, 32) / s).T - x @ w.T).pow(2).mean()
    assert scaled < plain


def spec(**shape):
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192)
    return ModelSpec(**{**base, **shape})


def test_group_size_auto():
    assert pick_group_size("auto", spec()) == 64  # SmolLM2: 576 is not a multiple of 128
    assert pick_group_size(128, spec()) == 128  # kiln's kernels take a shorter last group
    assert pick_group_size("auto", spec(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                                        intermediate_size=11008)) == 128


@pytest.mark.parametrize("algo, kind, qdtype", [("int8_wo", "int8_wo", torch.int8), ("int4_wo", "int4", torch.uint8),
                                                ("int4_awq", "int4", torch.uint8), ("w4a8_awq", "w4a8", torch.uint8),
                                                ("int8_sq", "w8a8", torch.int8)])
def test_each_algorithm_builds_runs_and_reports(algo, kind, qdtype, tiny_models, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / algo, tiny_models["llama"], "bfloat16", quantization={
        "algo": algo, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY, "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["algo"] == algo and meta["linear"] == kind and meta["lm_head"] == "int8_wo"
    report = meta["accuracy"]
    assert report["tokens"] > 300 and report["ppl_quantized"] > 0 and 0 <= report["token_agreement"] <= 1
    assert report["kl"] >= 0 and report["passed"]
    assert ("calibration" in meta) == (algo in ("int4_awq", "w4a8_awq", "int8_sq"))
    tensors = _weights(Engine(engine_dir))
    assert tensors[names.linear_tensor("layers.0.mlp.down", names.QWEIGHT)].dtype == qdtype
    assert "layers.0.mlp.down.weight" not in tensors
    llm = llm_for(engine_dir)
    out = llm.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8
    batched = llm.generate([PROMPT, PROMPT[:5]], max_tokens=4, ignore_eos=True)  # decode rows go to the GEMVs
    assert [len(o.token_ids) for o in batched] == [4, 4]


def test_a_gate_set_too_tight_fails_the_build_with_exit_2_and_the_table(tiny_models, tmp_path, capsys):
    config = write_config(tmp_path / "q.yaml", tiny_models["llama"], "bfloat16", quantization={
        "algo": "int4_wo", "accuracy": SMALL_ACCURACY,
        "accuracy_gate": {"max_ppl_increase": 10, "min_token_agreement": 0.0, "max_kl": 1e-9}})
    code = build_main(["--config", str(config), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "accuracy of int4_wo" in err and "perplexity" in err and "over max_kl" in err
    assert not (tmp_path / "out" / "engine").exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["int8_sq", "int4_awq"])
def test_smollm2_stays_within_the_default_gates(algo, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / algo, SMOLLM2_CHECKPOINT, "bfloat16", quantization={
        "algo": algo, "calibration": {"samples": 24, "seq_len": 128}, "accuracy": {"tokens": 1024, "window": 256}},
        max_input_len=256, max_seq_len=512)
    report = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]["accuracy"]
    assert report["passed"], report
    assert report["ppl_increase"] < (0.05 if algo == "int8_sq" else 0.3)
    assert "Paris" in llm_for(engine_dir).generate("The capital of France is", max_tokens=8).text
