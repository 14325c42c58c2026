"""Quantized builds: folding, each algorithm end to end on a tiny model, the accuracy gate, and
SmolLM2 int8_sq / int4_awq within their gates on held-out text."""
import json

import pytest
import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.builder.cli import main as build_main
from kiln.quantize.algorithms import (
    LayerWeights, awq_scales, gptq, gptq_fp8, gptq_int4, gptq_int8, pick_group_size, smoothquant_scales)
from kiln.quantize.formats import fake_quant_fp8, fake_quant_int4, int4_scales, quantize_int4, quantize_int8
from kiln.runtime.engine import Engine
from kiln.runtime.spec import ModelSpec
from tests.helpers import SMOLLM2_CHECKPOINT, build_engine, forward_logits, generator, write_config

SMALL_CALIBRATION = {"samples": 8, "seq_len": 64}
SMALL_ACCURACY = {"tokens": 512, "window": 128}
PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12]


def _weights(engine):
    from safetensors.torch import load_file

    return load_file(engine.dir / names.WEIGHTS_FILE)


class PreScaled:
    def __init__(self, weight, pre_scale, bias=None):
        self.weight, self.pre_scale, self.bias = weight, pre_scale, bias

    def __call__(self, x):
        return F.linear(x if self.pre_scale is None else x * self.pre_scale, self.weight, self.bias)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe"])
def test_smoothquant_folding_keeps_the_float_model(arch, tiny_engines):
    """x / s folded into the norms, the up rows (an expert's own) and pre-scales (out, each
    expert's gate_up, a shared expert's gate_up); W * s: same logits before rounding."""
    engine = Engine(tiny_engines(arch))
    weights = {k: v.clone() for k, v in _weights(engine).items()}
    model = engine.model
    model.fused_decode = model.fused_experts = False  # the linears below run in the Python loop
    want = forward_logits(engine, PROMPT)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.layers):
        lw = LayerWeights.take(weights, i, engine.spec)
        assert set(lw.linears) == set(layer.linears())
        scales = {k: smoothquant_scales(w, torch.rand(w.shape[1], generator=g) * 10 + 0.1, 0.5)
                  for k, w in lw.linears.items()}
        assert all((s - 1).abs().max() > 0.1 for s in scales.values())  # the scales do something
        lw.apply_scales(scales)
        want_pre_scaled = {"out"} | {k for k in lw.linears if k.endswith("gate_up") and engine.spec.num_experts}
        assert set(lw.pre_scales) == want_pre_scaled
        layer.input_norm, layer.post_attention_norm = lw.input_norm, lw.post_attention_norm
        for key, w in lw.linears.items():  # (biases as they were: scales act on the inputs)
            layer.set_linear(key, PreScaled(w, lw.pre_scales.get(key), layer.linears()[key].bias))
    got = forward_logits(engine, PROMPT)
    assert (got - want).abs().max() < 1e-4


def test_awq_scale_search_never_loses_to_no_scaling():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(256, 128, generator=g) * torch.linspace(0.1, 8, 128)  # some channels matter more
    s = awq_scales(w, x, x.abs().mean(0), 32)
    plain = (x @ (fake_quant_int4(w, 32)).T - x @ w.T).pow(2).mean()
    scaled = (x @ (fake_quant_int4(w * s, 32) / s).T - x @ w.T).pow(2).mean()
    assert scaled < plain


def correlated_inputs(rows, features, generator):
    """Calibration-like activations: correlated channels of very different sizes."""
    mix = torch.randn(features, features, generator=generator) / features ** 0.5 + torch.eye(features)
    return (torch.randn(rows, features, generator=generator) @ mix) * torch.linspace(0.2, 4, features)


@pytest.mark.parametrize("grid", ["int4", "int8", "fp8"])
def test_gptq_lowers_the_output_error_and_stays_on_the_grid(plugin_isas, grid):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 160, generator=g) * 0.05
    x = correlated_inputs(1024, 160, g)
    gram = x.T @ x
    if grid == "int4":  # groups of 48 and a shorter last one (160 = 3 x 48 + 16)
        q, scales = gptq_int4(w, gram, 48)
        nearest = fake_quant_int4(w, 48)
        on_grid = fake_quant_int4(q, 48, scales)
    elif grid == "int8":
        q, scales = gptq_int8(w, gram)
        s = (w.abs().amax(dim=1, keepdim=True) / 127)
        torch.testing.assert_close(scales, s[:, 0])
        nearest, on_grid = torch.round(w / s) * s, torch.round(q / s) * s
        packed, stored = quantize_int8(q, scales)  # what the engine stores: the same grid
        torch.testing.assert_close(packed.float() * stored[:, None], q, rtol=0, atol=1e-7)
    else:
        s = w.abs().amax(dim=1) / 448
        q = gptq_fp8(w, gram, s)
        nearest, on_grid = fake_quant_fp8(w, s[:, None]), fake_quant_fp8(q, s[:, None])
    torch.testing.assert_close(q, on_grid, rtol=0, atol=1e-7)
    error = (x @ (q - w).T).pow(2).mean()
    assert error < 0.85 * (x @ (nearest - w).T).pow(2).mean()


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(plugin_isas):  # GPTQ's column loop is a plugin op
    """With x^T x diagonal no column's error can be made up by another: GPTQ must round each
    weight to nearest, group scales included."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g)
    q, scales = gptq_int4(w, torch.diag(torch.rand(96, generator=g) + 0.5), 32)
    torch.testing.assert_close(scales, int4_scales(w, 32))
    torch.testing.assert_close(q, fake_quant_int4(w, 32))


def test_gptq_with_too_few_calibration_rows_still_rounds(plugin_isas):  # GPTQ's column loop is a plugin op
    """Fewer calibration rows than inputs leave x^T x singular: the damping makes it solvable and
    the result is still on the grid and no worse than rounding to nearest on those rows."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g) * 0.05
    x = correlated_inputs(8, 64, g)
    x[:, 5] = 0  # an input that never fires
    q, scales = gptq_int4(w, x.T @ x, 32)
    torch.testing.assert_close(q, fake_quant_int4(q, 32, scales), rtol=0, atol=1e-7)
    assert (x @ (q - w).T).pow(2).mean() <= (x @ (fake_quant_int4(w, 32) - w).T).pow(2).mean()


def test_gptq_result_does_not_depend_on_the_update_block(plugin_isas):  # GPTQ's column loop is a plugin op
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 100, generator=g)
    x = correlated_inputs(400, 100, g)
    s = w.abs().amax(dim=1) / 448
    one = gptq(w, x.T @ x, "fp8", s, block=1)
    torch.testing.assert_close(gptq(w, x.T @ x, "fp8", s, block=32), one, rtol=0, atol=1e-5)
    torch.testing.assert_close(gptq(w, x.T @ x, "fp8", s, block=128), one, rtol=0, atol=1e-5)


def spec(**shape):
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192)
    return ModelSpec(**{**base, **shape})


def test_group_size_auto():
    assert pick_group_size("auto", spec()) == 64  # SmolLM2: 576 is not a multiple of 128
    assert pick_group_size(128, spec()) == 128  # kiln's kernels take a shorter last group
    assert pick_group_size("auto", spec(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                                        intermediate_size=11008)) == 128


@pytest.mark.parametrize("algo, options, kind, qdtype", [
    ("int8_wo", {}, "int8_wo", torch.int8), ("int4_wo", {}, "int4", torch.uint8),
    ("int4_awq", {}, "int4", torch.uint8), ("w4a8_awq", {}, "w4a8", torch.uint8),
    ("w4a8_awq", {"w4a8_activations": "fp8"}, "w4a8_fp8", torch.uint8), ("int8_sq", {}, "w8a8", torch.int8),
    ("fp8", {}, "fp8", torch.float8_e4m3fn), ("fp8", {"fp8_weight_scales": "per_tensor"}, "fp8", torch.float8_e4m3fn)])
def test_each_algorithm_builds_runs_and_reports(algo, options, kind, qdtype, tiny_models, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / algo, tiny_models["llama"], "bfloat16", quantization={
        "algo": algo, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY, "accuracy_gate": None,
        **options})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["algo"] == algo and meta["linear"] == kind and meta["lm_head"] == "int8_wo"
    report = meta["accuracy"]
    assert report["tokens"] > 300 and report["ppl_quantized"] > 0 and 0 <= report["token_agreement"] <= 1
    assert report["kl"] >= 0 and report["gate"] is None and report["failures"] is None  # gate off: judged by nothing
    assert ("calibration" in meta) == (algo in ("int4_awq", "w4a8_awq", "int8_sq", "fp8"))
    tensors = _weights(Engine(engine_dir))
    down = "layers.0.mlp.down"
    assert tensors[names.linear_tensor(down, names.QWEIGHT)].dtype == qdtype
    assert "layers.0.mlp.down.weight" not in tensors
    input_scale = tensors.get(names.linear_tensor(down, names.INPUT_SCALE))
    assert (input_scale is not None) == (kind in ("fp8", "w4a8_fp8"))
    if input_scale is not None:
        assert input_scale.shape == (1,) and input_scale.item() > 0
    scales = tensors[names.linear_tensor(down, names.WEIGHT_SCALES)]
    if options.get("fp8_weight_scales") == "per_tensor":
        assert meta["fp8_weight_scales"] == "per_tensor" and torch.all(scales == scales[0])
    llm = llm_for(engine_dir)
    out = llm.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8
    batched = llm.generate([PROMPT, PROMPT[:5]], max_tokens=4, ignore_eos=True)  # decode rows go to the GEMVs
    assert [len(o.token_ids) for o in batched] == [4, 4]


@pytest.mark.parametrize("algo, lm_head", [("int4_awq", "int4"), ("int8_wo", "int4"), ("w4a8_awq", "w4a8")])
def test_an_int4_lm_head_builds_and_runs_on_the_tiled_kernel(algo, lm_head, tiny_models, tiny_engines, tmp_path,
                                                             llm_for):
    """lm_head: int4 / w4a8 on a calibrated build (AWQ scales folded into the final norm, GPTQ)
    and int4 on one without calibration (round to nearest). w4a8 is int4's weights run with its
    input in int8 per row and group: its logits are W4A8's of the same weights."""
    from kiln.plugins import ops

    engine_dir = build_engine(tmp_path / algo, tiny_models["llama"], "bfloat16", quantization={
        "algo": algo, "lm_head": lm_head, "group_size": 32, "calibration": SMALL_CALIBRATION,
        "accuracy": SMALL_ACCURACY, "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    kind = {"int4": names.LINEAR_INT4, "w4a8": names.LINEAR_W4A8}[lm_head]
    assert meta["lm_head"] == kind and meta["lm_head_group_size"] == 32
    engine = Engine(engine_dir)
    head = engine.model.lm_head
    assert head.kind == kind and head.tiled and head.group_size == 32
    tensors = _weights(engine)
    assert tensors[names.linear_tensor(names.linear_prefix(names.LM_HEAD), names.QWEIGHT)].dtype == torch.uint8
    unquantized = _weights(Engine(tiny_engines("llama", "bfloat16")))
    folded = not torch.equal(tensors[names.FINAL_NORM], unquantized[names.FINAL_NORM])
    assert folded == (algo != "int8_wo")  # AWQ's scales live in the final norm
    x = torch.randn(3, engine.spec.hidden_size, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    w4a8 = ops.linear_w4a8_tiled(x, head.qweight, head.scales, 32, None)
    w4a16 = ops.linear_w4_tiled(x, head.qweight, head.scales, 32, None)
    assert torch.equal(head(x), w4a8 if lm_head == "w4a8" else w4a16)
    assert not torch.equal(w4a8, w4a16)  # the two kinds differ: the check above tells them apart
    out = llm_for(engine_dir).generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8


def outlier_head_problem(seed):
    """An output projection [96, 64], the final norm's weight and calibration statistics of its
    input, whose first four channels are large (as a final norm's output has them)."""
    from kiln.quantize.calibrate import LinearStats

    g = torch.Generator().manual_seed(seed)
    x = correlated_inputs(512, 64, g)
    x[:, :4] *= 20
    w = torch.randn(96, 64, generator=g)
    norm = torch.rand(64, generator=g) + 0.5
    return x, w, norm, LinearStats(x.abs().amax(0), x.abs().sum(0), x.shape[0], rows=x[:256], gram=x.T @ x)


def test_the_calibrated_int4_head_beats_round_to_nearest():
    """quantize_head_int4 with statistics (AWQ scales into the norm, clipping, GPTQ) against
    rounding the same head to nearest, on inputs with a few large channels."""
    from kiln.quantize.algorithms import QuantOptions, quantize_head_int4
    from kiln.plugins.formats import dequantize_int4
    from kiln.quantize.formats import quantize_int4

    x, w, norm, stats = outlier_head_problem(7)
    options = QuantOptions("int4_awq", group_size=32, lm_head="int4")
    q, scales, folded_norm = quantize_head_int4(w, norm, stats, options)
    got = (x * folded_norm / norm) @ dequantize_int4(q, scales, 32).T
    nearest = x @ dequantize_int4(*quantize_int4(w, 32), 32).T
    want = x @ w.T
    assert (got - want).pow(2).mean() < 0.5 * (nearest - want).pow(2).mean()
    q0, s0, norm0 = quantize_head_int4(w, norm, None, options)  # no statistics: round to nearest
    assert torch.equal(norm0, norm) and torch.equal(dequantize_int4(q0, s0, 32), dequantize_int4(*quantize_int4(w, 32), 32))


@pytest.mark.parametrize("algo", ["int8_sq", "int8_wo"])
def test_a_w8a8_lm_head_builds_and_runs_its_input_in_int8(algo, tiny_models, tiny_engines, tmp_path, llm_for):
    """lm_head: w8a8 on a calibrated build (SmoothQuant's scales folded into the final norm, GPTQ)
    and on one without calibration (int8 to nearest, the norm as it was): the head is a W8A8
    linear whose logits are linear_w8a8's of its weights, and the engine generates."""
    from kiln.plugins import ops

    engine_dir = build_engine(tmp_path / algo, tiny_models["llama"], "bfloat16", quantization={
        "algo": algo, "lm_head": "w8a8", "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
        "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["lm_head"] == names.LINEAR_W8A8 and "lm_head_group_size" not in meta
    engine = Engine(engine_dir)
    head = engine.model.lm_head
    assert head.kind == names.LINEAR_W8A8 and head.tiled == ops.tiled("w8a8")
    tensors = _weights(engine)
    prefix = names.linear_prefix(names.LM_HEAD)
    q = tensors[names.linear_tensor(prefix, names.QWEIGHT)]
    assert q.dtype == torch.int8 and q.shape == (engine.spec.vocab_size, engine.spec.hidden_size)
    weight_sum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
    assert torch.equal(tensors[names.linear_tensor(prefix, names.WEIGHT_SUM)], weight_sum)
    unquantized = _weights(Engine(tiny_engines("llama", "bfloat16")))
    folded = not torch.equal(tensors[names.FINAL_NORM], unquantized[names.FINAL_NORM])
    assert folded == (algo == "int8_sq")  # SmoothQuant's scales live in the final norm
    x = torch.randn(3, engine.spec.hidden_size, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    s = tensors[names.linear_tensor(prefix, names.WEIGHT_SCALES)]
    w8a8 = ops.linear_w8a8(x, q, s, weight_sum, None)
    assert torch.equal(head(x), w8a8)
    assert not torch.equal(w8a8, ops.linear_w8(x, q, s, None))  # int8 inputs: not the W8A16 head's logits
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


def test_the_smoothed_w8a8_head_beats_round_to_nearest():
    """quantize_head_w8a8 with statistics (SmoothQuant's scales into the norm, GPTQ) against int8
    to nearest with the input in int8 per row, on inputs with a few large channels."""
    from kiln.quantize.algorithms import QuantOptions, quantize_head_w8a8
    from kiln.plugins import reference
    from kiln.quantize.formats import quantize_int8

    x, w, norm, stats = outlier_head_problem(8)
    options = QuantOptions("int8_sq", lm_head="w8a8")
    parts, folded_norm = quantize_head_w8a8(w, norm, stats, options)
    got = reference.linear_w8a8(x * folded_norm / norm, parts[names.QWEIGHT], parts[names.WEIGHT_SCALES])
    nearest = reference.linear_w8a8(x, *quantize_int8(w))
    want = x @ w.T
    assert (got - want).pow(2).mean() < 0.75 * (nearest - want).pow(2).mean()  # seed 8: 0.53x
    parts0, norm0 = quantize_head_w8a8(w, norm, None, options)  # no statistics: int8 to nearest
    assert torch.equal(norm0, norm) and torch.equal(parts0[names.QWEIGHT], quantize_int8(w)[0])


@pytest.mark.parametrize("algo, kv_cache", [("none", "int8"), ("none", "fp8"), ("int4_awq", "fp8"),
                                            ("int8_sq", "int8")])
def test_quantized_kv_cache_builds_runs_and_reports(algo, kv_cache, tiny_models, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / kv_cache, tiny_models["llama"], "bfloat16", quantization={
        "algo": algo, "kv_cache": kv_cache, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
        "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]
    assert meta["kv_cache"] == kv_cache and meta["algo"] == algo and "calibration" in meta
    assert meta["key_rotation"] == ("hadamard" if kv_cache == "fp8" else "none")  # key_rotation: auto
    assert ("lm_head" in meta) == (algo != "none")  # a KV cache alone leaves the linears as they are
    report = meta["accuracy"]
    assert report["kl"] >= 0 and report["gate"] is None and report["failures"] is None  # gate off: judged by nothing
    engine = Engine(engine_dir)
    assert engine.model.key_hadamard == (engine.spec.head_dim if kv_cache == "fp8" else 0)
    tensors = _weights(engine)
    scales = tensors[names.layer_tensor(0, names.ATTN_KV_SCALES)]
    assert scales.shape == (2, engine.spec.kv_size) and (scales > 0).all()
    assert engine.model.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache]
    if algo == "none":
        assert tensors[names.layer_tensor(0, names.MLP_DOWN)].dtype == torch.bfloat16
    llm = llm_for(engine_dir)
    assert llm.executor.pool.storage.dtype == engine.model.kv_dtype
    out = llm.generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("algo, kv_cache", [("int4_awq", "fp8"), ("int8_sq", "int8")])
def test_qwen3_quantized_builds_keep_the_head_norms_and_report(algo, kv_cache, tiny_models, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / algo, tiny_models["qwen3"], "bfloat16", quantization={
        "algo": algo, "kv_cache": kv_cache, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
        "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())
    assert meta["model"]["architecture"] == "qwen3" and meta["model"]["head_norms"]
    report = meta["quantization"]["accuracy"]
    assert report["tokens"] > 300 and report["ppl_quantized"] > 0 and report["kl"] >= 0
    tensors = _weights(Engine(engine_dir))
    for norm in names.HEAD_NORMS:
        assert tensors[names.layer_tensor(1, norm)].dtype == torch.bfloat16
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("arch, algo, kind", [("mixtral", "int4_wo", names.LINEAR_INT4),
                                              ("qwen3_moe", "int8_wo", names.LINEAR_INT8)])
def test_mixture_of_experts_weight_only_builds_quantize_every_expert(arch, algo, kind, tiny_models, tmp_path, llm_for):
    """Every expert's linears (and the attention's) are stored quantized, the router as it is; the
    accuracy report measures the build; the engine runs a batch."""
    groups = {"group_size": 32} if algo == "int4_wo" else {}
    engine_dir = build_engine(tmp_path / algo, tiny_models[arch], "bfloat16", quantization={
        "algo": algo, **groups, "accuracy": SMALL_ACCURACY, "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())
    assert meta["quantization"]["linear"] == kind and meta["model"]["num_experts"] > 0
    report = meta["quantization"]["accuracy"]
    assert report["tokens"] > 300 and report["ppl_quantized"] > 0 and report["kl"] >= 0
    tensors = _weights(Engine(engine_dir))
    for e in range(meta["model"]["num_experts"]):
        for linear in ("gate_up", "down"):
            prefix = names.layer_tensor(1, names.expert_tensor(e, linear))
            assert names.linear_tensor(prefix, names.QWEIGHT) in tensors
            assert names.layer_tensor(1, names.expert_tensor(e, f"{linear}.weight")) not in tensors
    assert tensors[names.layer_tensor(1, names.MLP_ROUTER)].dtype == torch.bfloat16
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("arch, algo, options, kind", [
    ("mixtral", "int4_awq", {"group_size": 32}, names.LINEAR_INT4),
    ("qwen3_moe", "int8_sq", {}, names.LINEAR_W8A8),
    ("mixtral", "fp8", {}, names.LINEAR_FP8),
    ("qwen3_moe", "w4a8_awq", {"group_size": 32, "w4a8_activations": "fp8"}, names.LINEAR_W4A8_FP8),
    ("qwen2_moe", "int4_awq", {"group_size": 32}, names.LINEAR_INT4)])
def test_calibrated_quantization_of_a_mixture_of_experts(arch, algo, options, kind, tiny_models, tmp_path, llm_for):
    """Each expert is calibrated on the tokens routed to it: engine.json counts them (every
    calibration token reaches top-k experts); AWQ / SmoothQuant scales of an expert's gate/up
    projection are its own pre-scale (its input norm feeds the router and the other experts),
    those of its down projection fold into its own up rows; the build reports its accuracy and runs."""
    engine_dir = build_engine(tmp_path / algo, tiny_models[arch], "bfloat16", quantization={
        "algo": algo, **options, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
        "accuracy_gate": None})
    meta = json.loads((engine_dir / names.ENGINE_JSON).read_text())
    spec, quant = meta["model"], meta["quantization"]
    assert quant["linear"] == kind and quant["weight_rounding"] == "gptq"
    routing = quant["calibration"]["experts"]
    assert sorted(routing) == [str(i) for i in range(spec["num_layers"])]
    for layer in routing.values():
        assert len(layer["tokens"]) == spec["num_experts"]
        assert layer["pooled"] == [e for e, tokens in enumerate(layer["tokens"]) if tokens < 32]
        assert sum(layer["tokens"]) == SMALL_CALIBRATION["samples"] * SMALL_CALIBRATION["seq_len"] * spec[
            "experts_per_token"]
    report = quant["accuracy"]
    assert report["tokens"] > 300 and report["ppl_quantized"] > 0 and report["kl"] >= 0
    tensors = _weights(Engine(engine_dir))
    scaled = algo != "fp8"  # AWQ and SmoothQuant rescale inputs; FP8 does not
    for e in range(spec["num_experts"]):
        gate_up, down = (names.layer_tensor(1, names.expert_tensor(e, n)) for n in ("gate_up", "down"))
        assert (names.linear_tensor(gate_up, names.PRE_SCALE) in tensors) == scaled
        assert names.linear_tensor(down, names.PRE_SCALE) not in tensors
        assert (names.linear_tensor(down, names.INPUT_SCALE) in tensors) == (kind in (names.LINEAR_FP8,
                                                                                   names.LINEAR_W4A8_FP8))
    assert tensors[names.layer_tensor(1, names.MLP_ROUTER)].dtype == torch.bfloat16
    if spec["shared_expert_intermediate_size"]:  # Qwen2-MoE's shared expert: pre-scaled as the experts are
        shared = names.linear_prefix(names.layer_tensor(1, names.MLP_GATE_UP))
        assert names.linear_tensor(shared, names.PRE_SCALE) in tensors
        assert tensors[names.layer_tensor(1, names.MLP_SHARED_GATE)].dtype == torch.bfloat16
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_awq_on_experts_beats_round_to_nearest(arch, tiny_models, tmp_path):
    """Per-expert AWQ scales and clipping with GPTQ rounding lose less than rounding every expert to
    nearest at the same group size (KL on held-out text, both reports from the same build path)."""
    kl = {}
    for algo in ("int4_wo", "int4_awq"):
        engine_dir = build_engine(tmp_path / algo, tiny_models[arch], "bfloat16", quantization={
            "algo": algo, "group_size": 32, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
            "accuracy_gate": None})
        kl[algo] = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]["accuracy"]["kl"]
    assert kl["int4_awq"] < 0.9 * kl["int4_wo"], kl


def test_experts_calibration_never_routes_to_are_quantized_from_every_token(tiny_models, tmp_path, llm_for, capsys):
    """A Qwen3-MoE whose routers never pick experts 4 and 5 (their logits are 0, while of the rows
    r, -r, s, -s at least two are positive for every input): the build names them, quantizes
    them from every token's statistics (AWQ scales searched on them, rounded to nearest), and
    each such expert's output on random inputs is as close to the original as rounding it to
    nearest would be."""
    from safetensors.torch import load_file, save_file
    import shutil

    folder = tmp_path / "unrouted"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    checkpoint = load_file(folder / "model.safetensors")
    routers = [k for k in checkpoint if k.endswith("mlp.gate.weight")]
    for key in routers:
        r, s = checkpoint[key][0], checkpoint[key][1]
        checkpoint[key] = torch.stack([r, -r, s, -s, torch.zeros_like(r), torch.zeros_like(r)])
    save_file(checkpoint, folder / "model.safetensors", metadata={"format": "pt"})
    engine_dir = build_engine(tmp_path / "e", folder, "bfloat16", quantization={
        "algo": "int4_awq", "group_size": 32, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY,
        "accuracy_gate": None})
    printed = " ".join(capsys.readouterr().err.split())  # (rich wraps long lines)
    assert "quantized from every token's statistics" in printed and "layer 1 experts 4 (0), 5 (0)" in printed
    routing = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]["calibration"]["experts"]
    assert len(routers) == len(routing) == 2
    for layer in routing.values():
        assert layer["pooled"] == [4, 5] and layer["tokens"][4:] == [0, 0] and min(layer["tokens"][:4]) > 0
    from kiln.plugins.formats import dequantize_int4

    tensors = _weights(Engine(engine_dir))

    def stored(e: int, n: str) -> torch.Tensor:
        prefix = names.layer_tensor(1, names.expert_tensor(e, n))
        return dequantize_int4(tensors[names.linear_tensor(prefix, names.QWEIGHT)],
                               tensors[names.linear_tensor(prefix, names.WEIGHT_SCALES)], 32)

    def mlp(x, gate_up, down):
        gate, up = (x @ gate_up.T).chunk(2, dim=1)
        return (F.silu(gate) * up) @ down.T

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    for e in (4, 5):
        original = {c: checkpoint[f"model.layers.1.mlp.experts.{e}.{c}_proj.weight"].float() for c in ("gate", "up", "down")}
        want = mlp(x, torch.cat([original["gate"], original["up"]]), original["down"])
        pre_scale = tensors[names.linear_tensor(names.layer_tensor(1, names.expert_tensor(e, "gate_up")),
                                                names.PRE_SCALE)]
        # (its AWQ scale, searched on every token's statistics: the grid may pick 1 for all)
        got = mlp(x * pre_scale, stored(e, "gate_up"), stored(e, "down"))
        nearest = mlp(x, *(dequantize_int4(*quantize_int4(w, 32), 32) for w in (
            torch.cat([original["gate"], original["up"]]), original["down"])))
        # on inputs unlike the calibration text's, no worse than rounding to nearest
        assert (got - want).norm() < 1.1 * (nearest - want).norm()
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("arch, quantization", [("mixtral", {"algo": "int4_wo", "group_size": 32, "kv_cache": "int8"}),
                                                ("qwen3_moe", {"algo": "none", "kv_cache": "fp8"})])
def test_a_mixture_of_experts_takes_a_quantized_kv_cache(arch, quantization, tiny_models, tmp_path, llm_for):
    """Calibration measures the keys and values (after Qwen3-MoE's head norms) through the
    routed layers; the engine stores the cache quantized, reports the accuracy and runs a batch."""
    engine_dir = build_engine(tmp_path / "e", tiny_models[arch], "bfloat16", quantization={
        **quantization, "calibration": SMALL_CALIBRATION, "accuracy": SMALL_ACCURACY, "accuracy_gate": None})
    engine = Engine(engine_dir)
    assert engine.model.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[quantization["kv_cache"]]
    tensors = _weights(engine)
    assert tensors[names.layer_tensor(1, names.ATTN_KV_SCALES)].shape == (2, engine.spec.kv_size)
    assert engine.meta["quantization"]["accuracy"]["kl"] >= 0
    out = llm_for(engine_dir).generate([PROMPT, PROMPT[:5]], max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kv_calibration_bounds_the_rotated_keys(arch, tiny_engines):
    """No rotated key the engine writes exceeds its channel's calibrated range (the pair-norm
    bound), on the calibration text itself; values reach theirs exactly. (Qwen3: the keys after
    its head norms, which the cache holds.)"""
    from kiln.quantize.calibrate import calibrate
    from kiln.runtime.model import KVPool, StepContext

    model = Engine(tiny_engines(arch)).model
    ids = list(range(3, 60))
    stats = calibrate(model, [ids])
    spec = model.spec
    pool = KVPool(spec, 2, 32, model.kv_dtype)
    model.forward(torch.tensor(ids), StepContext.single(0, len(ids), [0, 1]), pool)
    for i in range(spec.num_layers):
        keys = pool.keys[i].transpose(1, 2).reshape(-1, spec.kv_size)[: len(ids)].float().abs().amax(dim=0)
        values = pool.values[i].transpose(1, 2).reshape(-1, spec.kv_size)[: len(ids)].float().abs().amax(dim=0)
        assert (keys <= stats[i, "kv"].k_absmax * (1 + 1e-5) + 1e-6).all()
        torch.testing.assert_close(values, stats[i, "kv"].v_absmax)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_kv_calibration_bounds_the_hadamard_rotated_keys_at_every_position(head_dim):
    """k_hadamard_absmax bounds H rope(k, p) for every position p (here 0 .. 8191), and is not
    vacuous (the positions reach a third of it or more); the unrotated bound is the pair norm, as before."""
    from kiln.quantize.calibrate import KVStats, kv_observer
    from kiln.plugins.formats import hadamard_matrix
    from kiln.runtime.rope import cos_sin_tables

    kv_heads, q_size = 2, 4 * head_dim
    spec = ModelSpec(architecture="llama", num_layers=1, hidden_size=4 * head_dim, num_heads=4,
                     num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=8, vocab_size=16,
                     max_position_embeddings=8192)
    g = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(6, kv_heads, head_dim, generator=g)
    keys[..., 5] *= 30  # a large channel, as Llama's keys have
    stats = KVStats.empty(kv_heads * head_dim)
    qkv = torch.cat([torch.zeros(6, q_size), keys.reshape(6, -1), torch.randn(6, kv_heads * head_dim, generator=g)], 1)
    kv_observer(stats, q_size, kv_heads * head_dim, head_dim)(qkv)
    cos, sin = cos_sin_tables(spec, 8192, torch.float32)
    half = head_dim // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    roped = keys[:, None] * cos[None, :, None] + rotated_half[:, None] * sin[None, :, None]  # [6, positions, g, d]
    stored = (roped @ hadamard_matrix(head_dim)).abs().amax(dim=(0, 1)).reshape(-1)
    assert (stored <= stats.k_hadamard_absmax * (1 + 1e-5)).all()
    assert (stored >= 0.3 * stats.k_hadamard_absmax).all()  # (deterministic: a fixed seed)
    assert (roped.abs().amax(dim=(0, 1)).reshape(-1) <= stats.k_absmax * (1 + 1e-5)).all()


@pytest.mark.parametrize("columns", [1, 5, 64, 97])
def test_add_gram_sums_the_upper_blocks_and_whole_gram_mirrors_them(columns):
    """add_gram (only the blocks on and above the diagonal) then whole_gram: x^T x summed over
    several calls, as one full product sums it."""
    from kiln.quantize.calibrate import add_gram, whole_gram

    g = generator(f"gram-{columns}")
    parts = [torch.randn(rows, columns, generator=g) for rows in (7, 1, 30)]
    gram = torch.zeros(columns, columns)
    for x in parts:
        add_gram(gram, x)
    full = torch.cat(parts)
    want = full.T @ full
    torch.testing.assert_close(whole_gram(gram), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gram, gram.T)


def test_gram_sums_held_a_chunk_of_layers_at_a_time_match_one_pass(tiny_engines):
    """GPTQ's x^T x sums within a small budget (a chunk of layers per pass over the text, each
    pass stopped after its chunk, GramObserver) equal those the calibration pass sums (Observer)."""
    from kiln.quantize.calibrate import Grams, calibrate, gram_chunks

    model = Engine(tiny_engines("llama")).model
    sequences = [list(range(3, 40)), list(range(50, 70))]
    layers = range(len(model.layers))
    whole = calibrate(model, sequences, gram_layers=layers)
    per_layer = gram_chunks(model, budget=1)
    assert per_layer == [range(i, i + 1) for i in layers]
    assert gram_chunks(model) == [layers]
    grams = Grams(model, sequences, calibrate(model, sequences, gram_layers=per_layer[0]), budget=1)
    for i in layers:
        for name in ("qkv", "out", "gate_up", "down"):
            torch.testing.assert_close(grams(i, name), whole[i, name].gram, rtol=1e-5, atol=1e-4)
    assert grams.passes == len(layers) - 1  # the first chunk came from the calibration pass


def test_fp8_linears_match_the_fake_quantized_float_computation():
    """An Fp8Linear (decode kernel and prefill path) computes E4M3(x / a) @ (E4M3(W / s) * s).T * a,
    checked against torch's own float8 conversions."""
    from kiln.quantize.formats import quantize_fp8
    from kiln.runtime.linear import Fp8Linear

    g = generator("fp8-linear")
    w, x = torch.randn(48, 96, generator=g) * 0.1, torch.randn(20, 96, generator=g) * 3
    q, s = quantize_fp8(w)
    a = float(x.abs().max()) / 448 * 0.7  # some activations saturate
    xq = (x / a).clamp(-448, 448).to(torch.float8_e4m3fn).float() * a
    want = xq @ (q.float() * s[:, None]).T
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        linear = Fp8Linear(q, s, None, None, dtype, input_scale=torch.tensor([a]))
        for rows in (1, 3, 20):  # the GEMV and the dense path
            got = linear(x[:rows].to(dtype)).float()
            torch.testing.assert_close(got, want[:rows], rtol=tol, atol=tol * float(want.abs().max()))


def test_options_for_another_algorithm_are_refused(tmp_path):
    from kiln.builder.config import load_config
    from kiln.errors import ConfigError

    config = write_config(tmp_path / "q.yaml", "/nonexistent", "bfloat16",
                          quantization={"algo": "int8_sq", "w4a8_activations": "fp8"})
    with pytest.raises(ConfigError, match="w4a8_activations applies to algo w4a8_awq"):
        load_config(config)
    config = write_config(tmp_path / "q.yaml", "/nonexistent", "bfloat16",
                          quantization={"algo": "int4_wo", "weight_rounding": "nearest"})
    with pytest.raises(ConfigError, match="weight_rounding applies to algo int4_awq / w4a8_awq / int8_sq / fp8"):
        load_config(config)
    config = write_config(tmp_path / "q.yaml", "/nonexistent", "bfloat16",
                          quantization={"algo": "int4_awq", "smoothquant_alpha": 0.7})
    with pytest.raises(ConfigError, match="smoothquant_alpha applies to algo int8_sq"):
        load_config(config)
    config = write_config(tmp_path / "q.yaml", "/nonexistent", "bfloat16",  # a w8a8 head is smoothed with it
                          quantization={"algo": "int4_awq", "smoothquant_alpha": 0.7, "lm_head": "w8a8"})
    assert load_config(config).quantization.smoothquant_alpha == 0.7
    config = write_config(tmp_path / "q.yaml", "/nonexistent", "bfloat16",
                          quantization={"algo": "int8_wo", "key_rotation": "hadamard"})
    with pytest.raises(ConfigError, match="key_rotation: hadamard rotates the keys of a quantized KV cache"):
        load_config(config)


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
@pytest.mark.parametrize("algo, kv_cache, max_increase", [("int8_sq", "none", 0.05), ("int4_awq", "none", 0.3),
                                                          ("fp8", "int8", 0.05)])
def test_smollm2_stays_within_the_default_gates(algo, kv_cache, max_increase, tmp_path, llm_for):
    engine_dir = build_engine(tmp_path / algo, SMOLLM2_CHECKPOINT, "bfloat16", quantization={
        "algo": algo, "kv_cache": kv_cache, "calibration": {"samples": 24, "seq_len": 128},
        "accuracy": {"tokens": 1024, "window": 256}}, max_input_len=256, max_seq_len=512)
    report = json.loads((engine_dir / names.ENGINE_JSON).read_text())["quantization"]["accuracy"]
    assert report["passed"], report
    assert report["ppl_increase"] < max_increase
    assert "Paris" in llm_for(engine_dir).generate("The capital of France is", max_tokens=8).text
