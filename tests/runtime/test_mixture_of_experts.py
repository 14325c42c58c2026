"""Mixture-of-Experts layers: routing against a dense reference, and a step that runs (so reads)
only the experts its tokens were routed to."""
import pytest
import torch

from kiln.runtime.engine import Engine
from tests.helpers import forward_logits, generator

PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 380, 45]


def dense_reference(model, layer, x):
    """Every expert on every row, weighted by the router's top-k weights (zero elsewhere), and a
    shared expert where the layer has one."""
    spec = model.spec
    probs = (x.float() @ layer.router.float().T).softmax(dim=-1)
    top, chosen = probs.topk(spec.experts_per_token, dim=-1)
    if spec.normalize_expert_weights:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, expert in enumerate(layer.experts):
        out += weights[:, e:e + 1] * expert.down(model.activation(expert.gate_up(x))).float()
    if layer.gate_up is not None:  # Qwen2-MoE's shared expert, on every row, behind its sigmoid gate
        out += (x.float() @ layer.shared_gate.float().T).sigmoid() * layer.down(model.activation(layer.gate_up(x))).float()
    return out


@pytest.mark.parametrize("rows", [1, 3, 37])  # a few rows: the plugin op (moe_mlp); more: the Python loop
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_routing_matches_a_dense_reference(arch, rows, tiny_engines):
    model = Engine(tiny_engines(arch)).model
    x = torch.randn(rows, model.spec.hidden_size, generator=generator(arch, rows))
    for layer in model.layers:
        torch.testing.assert_close(model.mixture(x, layer), dense_reference(model, layer, x), rtol=1e-5, atol=1e-5)


SMALL = {"accuracy": {"tokens": 512, "window": 128}, "accuracy_gate": None}


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", None),
                                                 ("bfloat16", {"algo": "int4_wo", "group_size": 32, **SMALL}),
                                                 ("bfloat16", {"algo": "int8_wo", **SMALL})])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_the_fused_experts_equal_the_python_loop(arch, dtype, quantization, tiny_models, tmp_path):
    """moe_mlp (the experts of a few rows in one plugin call) gives the Python loop's bits, for
    every kind of linear an expert can be."""
    from tests.helpers import build_engine

    model = Engine(build_engine(tmp_path / "e", tiny_models[arch], dtype, quantization=quantization)).model
    for rows in (1, 2, 5):
        x = (torch.randn(rows, model.spec.hidden_size, generator=generator(arch, dtype, rows)) * 2).to(model.dtype)
        for layer in model.layers:
            model.fused_experts = True
            fused = model.mixture(x, layer)
            model.fused_experts = False
            loop = model.mixture(x, layer)
            assert torch.equal(fused, loop)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_a_step_runs_only_the_experts_its_tokens_chose(arch, tiny_engines):
    """One token: experts_per_token experts a layer, one row each; a prefill: each expert at most
    once a layer, the rows adding up to tokens x experts_per_token."""
    engine = Engine(tiny_engines(arch))
    spec = engine.spec
    # the Python loop, whose calls can be counted (decode_layers and moe_mlp route as it does, bit for bit)
    engine.model.fused_decode = engine.model.fused_experts = False
    calls: list[tuple[int, int, int]] = []  # (layer, expert, rows)
    for i, layer in enumerate(engine.model.layers):
        for e, expert in enumerate(layer.experts):
            def counted(x, inner=expert.gate_up, key=(i, e)):
                calls.append((*key, x.shape[0]))
                return inner(x)
            expert.gate_up = counted
    forward_logits(engine, PROMPT[:1])
    assert sorted(rows for _, _, rows in calls) == [1] * (spec.num_layers * spec.experts_per_token)
    calls.clear()
    forward_logits(engine, PROMPT)
    for i in range(spec.num_layers):
        experts = [e for layer, e, _ in calls if layer == i]
        assert len(experts) == len(set(experts)) <= spec.num_experts
        assert sum(rows for layer, _, rows in calls if layer == i) == len(PROMPT) * spec.experts_per_token
