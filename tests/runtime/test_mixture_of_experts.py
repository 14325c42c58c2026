"""Mixture-of-Experts layers: routing against a dense reference, and a step that runs (so reads)
only the experts its tokens were routed to."""
import pytest
import torch

from kiln.runtime.engine import Engine
from tests.helpers import forward_logits, generator

PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 380, 45]


def dense_reference(model, layer, x):
    """Every expert on every row, weighted by the router's top-k weights (zero elsewhere)."""
    spec = model.spec
    probs = (x.float() @ layer.router.float().T).softmax(dim=-1)
    top, chosen = probs.topk(spec.experts_per_token, dim=-1)
    if spec.normalize_expert_weights:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, expert in enumerate(layer.experts):
        out += weights[:, e:e + 1] * expert.down(model.activation(expert.gate_up(x))).float()
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_routing_matches_a_dense_reference(arch, tiny_engines):
    model = Engine(tiny_engines(arch)).model
    x = torch.randn(37, model.spec.hidden_size, generator=generator(arch))
    for layer in model.layers:
        torch.testing.assert_close(model.mixture(x, layer), dense_reference(model, layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_step_runs_only_the_experts_its_tokens_chose(arch, tiny_engines):
    """One token: experts_per_token experts a layer, one row each; a prefill: each expert at most
    once a layer, the rows adding up to tokens x experts_per_token."""
    engine = Engine(tiny_engines(arch))
    spec = engine.spec
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
