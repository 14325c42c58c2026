"""The fused step (kiln::decode_layers: every layer of a step in one plugin call) against
LlamaModel's Python loop over the same kernels: the same logits and the same KV cache, bit for
bit, for every kind of linear an engine holds, for decode steps and for steps of many rows that
carry prefill chunks beside decodes."""
import json

import pytest
import torch

from kiln.plugins import ops
from kiln.runtime.engine import Engine
from kiln.runtime.model import KVPool, StepContext
from tests.helpers import AVX512_BF16_LEVELS, build_engine

SMALL = {"calibration": {"samples": 8, "seq_len": 64}, "accuracy": {"tokens": 512, "window": 128},
         "accuracy_gate": None}
PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12]


def decode(model, spec, fused: bool, steps: int, rows: int, grouped: bool = False):
    """A prompt per sequence, then `steps` decode steps of `rows` sequences at once; the logits
    of every step and the pool. grouped: the executor's pool (a block table per group of layers)."""
    model.fused_decode = fused
    block = 8
    blocks = -(-(len(PROMPT) + steps) // block)
    groups = len(KVPool.layout_for(spec, grouped).groups)
    pool = KVPool(spec, groups * rows * blocks, block, model.kv_dtype, grouped)
    pool.storage.view(torch.uint8).zero_()  # (the pool is left uninitialized: compare written slots only)
    # a run of blocks for each row and group, the groups' interleaved
    tables = torch.tensor([[list(range((r * groups + g) * blocks, (r * groups + g + 1) * blocks)) for r in range(rows)]
                           for g in range(groups)], dtype=torch.int32)
    for r in range(rows):
        ctx = StepContext.single(0, len(PROMPT) - r, [])
        ctx.block_tables = tables[:, r : r + 1].contiguous()
        model.forward(torch.tensor(PROMPT[r:]), ctx, pool)
    out = []
    for i in range(steps):
        lens = [len(PROMPT) - r + i for r in range(rows)]
        ctx = StepContext(positions=torch.tensor(lens), query_start=torch.arange(rows + 1, dtype=torch.int32),
                          context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                          logits_rows=torch.arange(rows))
        out.append(model.forward(torch.tensor([40 + i] * rows), ctx, pool))
    model.fused_decode = True
    return torch.stack(out), pool.storage


def mixed_step(model, spec, fused: bool):
    """One step as the executor makes them under load, after each sequence's cache is filled:
    17 sequences decoding (3-19 cached tokens), a new prompt's first chunk of 21 tokens and
    another's second chunk of 13 after 9 cached: 51 rows, past the kernels' 16-row lanes (and a
    remainder for their row paths). Every row's logits and the pool."""
    model.fused_decode = fused
    block, blocks = 8, 4
    g = torch.Generator().manual_seed(19)
    cached = [3 + r for r in range(17)] + [0, 9]
    new = [1] * 17 + [21, 13]
    pool = KVPool(spec, len(cached) * blocks, block, model.kv_dtype)
    pool.storage.view(torch.uint8).zero_()
    tables = torch.arange(len(cached) * blocks, dtype=torch.int32).view(1, len(cached), blocks)
    for s, count in enumerate(cached):
        if count:
            ctx = StepContext.single(0, count, [])
            ctx.block_tables = tables[:, s : s + 1].contiguous()
            model.forward(torch.randint(1, 256, (count,), generator=g), ctx, pool)
    starts = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    ctx = StepContext(positions=torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]), query_start=starts,
                      context_lens=torch.tensor(cached, dtype=torch.int32), block_tables=tables,
                      logits_rows=torch.arange(sum(new)))
    logits = model.forward(torch.randint(1, 256, (sum(new),), generator=g), ctx, pool)
    model.fused_decode = True
    return logits, pool.storage


def assert_fused_equals_loop(model, spec):
    """1 and 3 rows decoding 4 steps: decode_layers gives the Python loop's logits and KV cache, bit for bit."""
    for rows in (1, 3):
        fused_logits, fused_pool = decode(model, spec, True, 4, rows)
        assert model._plan is not None  # the fused path ran
        loop_logits, loop_pool = decode(model, spec, False, 4, rows)
        assert torch.equal(fused_logits, loop_logits)
        assert torch.equal(fused_pool.view(torch.uint8), loop_pool.view(torch.uint8))


@pytest.mark.parametrize("dtype, quantization", [
    ("bfloat16", {"algo": "none"}),
    ("float32", {"algo": "none"}),
    ("bfloat16", {"algo": "int8_wo"}),
    ("bfloat16", {"algo": "int4_awq", "group_size": 32, "lm_head": "int4"}),
    ("bfloat16", {"algo": "int4_wo", "group_size": 96}),  # groups not a power of two, a last one shorter
    ("bfloat16", {"algo": "w4a8_awq", "group_size": 96}),
    ("bfloat16", {"algo": "w4a8_awq", "group_size": 32, "w4a8_activations": "fp8"}),
    ("bfloat16", {"algo": "int8_sq", "kv_cache": "int8"}),
    ("bfloat16", {"algo": "fp8", "kv_cache": "fp8"}),  # keys rotated (key_rotation auto)
    ("bfloat16", {"algo": "none", "kv_cache": "fp8", "key_rotation": "none"}),
    ("float32", {"algo": "int8_wo", "kv_cache": "int8", "key_rotation": "hadamard"}),
])
# Qwen3: head norms, head_dim of its own; Gemma 3: output norms, GeGLU, a sliding-window layer with
# its own rotary tables (the decode steps here go past its window of 6)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fused_decode_equals_the_python_loop(arch, dtype, quantization, tiny_models, tmp_path):
    engine = Engine(build_engine(tmp_path / "e", tiny_models[arch], dtype, quantization={**quantization, **SMALL}))
    model = engine.model
    assert model.layers[0].qkv.plan()["kind"].startswith("dense") == (quantization["algo"] == "none")
    if quantization["algo"] == "none":  # bf16 tiled where AVX512-BF16 or AMX multiplies it
        assert model.layers[0].qkv.tiled == (dtype == "bfloat16" and ops.active_isa() in AVX512_BF16_LEVELS)
    if quantization["algo"] == "int8_wo":  # tiled where the kernels are AVX-512 ones
        assert model.layers[0].qkv.tiled == ops.active_isa().startswith("avx512")
    if quantization["algo"] == "int8_sq":  # tiled where AVX-512 VNNI (or AMX) multiplies int8
        assert model.layers[0].qkv.tiled == (ops.active_isa() in AVX512_BF16_LEVELS)
    if quantization["algo"] in ("int4_awq", "int4_wo", "w4a8_awq"):
        assert model.layers[0].qkv.tiled
    rotated = quantization.get("key_rotation", "auto") == "hadamard" or (
        quantization.get("key_rotation", "auto") == "auto" and quantization.get("kv_cache") == "fp8")
    assert model.key_hadamard == (engine.spec.head_dim & -engine.spec.head_dim if rotated else 0)
    assert_fused_equals_loop(model, engine.spec)
    model.make_batch_invariant()  # the runtime's default: every linear its kernel at every row count
    assert model.fused_rows == float("inf")  # so every step fuses, however many rows
    fused_logits, fused_pool = mixed_step(model, engine.spec, True)
    loop_logits, loop_pool = mixed_step(model, engine.spec, False)
    assert torch.equal(fused_logits, loop_logits)
    assert torch.equal(fused_pool.view(torch.uint8), loop_pool.view(torch.uint8))


@pytest.mark.parametrize("dtype, quantization", [
    ("bfloat16", {"algo": "none"}),
    ("float32", {"algo": "none"}),
    ("bfloat16", {"algo": "int4_wo", "group_size": 32}),
    ("bfloat16", {"algo": "int8_wo", "kv_cache": "fp8"}),
    ("bfloat16", {"algo": "int4_awq", "group_size": 32}),  # experts' gate/up with pre-scales
    ("bfloat16", {"algo": "int8_sq", "kv_cache": "int8"}),
    ("bfloat16", {"algo": "fp8"}),
    ("bfloat16", {"algo": "w4a8_awq", "group_size": 32}),
])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_fused_decode_routes_experts_as_the_python_loop(arch, dtype, quantization, tiny_models, tmp_path):
    """Mixture-of-Experts layers inside decode_layers (router, top-k, the chosen experts' linears)
    give the Python loop's logits and KV cache, bit for bit."""
    engine = Engine(build_engine(tmp_path / "e", tiny_models[arch], dtype, quantization={**quantization, **SMALL}))
    assert_fused_equals_loop(engine.model, engine.spec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_table_per_layer_group_gives_the_same_numbers(dtype, tiny_models, tmp_path):
    """Gemma 3's sliding-window and global layers keep their keys in block tables of their own
    (the executor's pool, kv_layout) and share the pool's slots: the fused step and the Python
    loop give the logits of one table for every layer, bit for bit."""
    engine = Engine(build_engine(tmp_path / "e", tiny_models["gemma3"], dtype))
    layout = KVPool.layout_for(engine.spec, grouped=True)
    assert layout.windows == (6, 0) and layout.slots == 1
    want, _ = decode(engine.model, engine.spec, True, 4, 3)
    for fused in (True, False):
        got, _ = decode(engine.model, engine.spec, fused, 4, 3, grouped=True)
        assert torch.equal(got, want), f"fused={fused}"


@pytest.fixture
def threads():
    """Set torch's thread count for a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("quantization", [{"algo": "none"}, {"algo": "int4_awq", "group_size": 32},
                                          {"algo": "int8_sq", "kv_cache": "int8"}])
def test_a_step_team_gives_the_bits_of_a_fork_per_kernel(quantization, threads, tiny_models, tmp_path):
    """ops.set_decode_team: a step's threads kept in one region for the whole step, or forked
    and joined for every kernel, at 1, 2 and 3 threads: the same logits and KV cache, bit for bit."""
    engine = Engine(build_engine(tmp_path / "e", tiny_models["llama"], "bfloat16",
                                 quantization={**quantization, **SMALL}))
    threads(1)
    want_logits, want_pool = decode(engine.model, engine.spec, True, 3, 3)
    before = ops.set_decode_team(True)
    try:
        assert ops.set_decode_team(False) is True and ops.set_decode_team(True) is False  # the previous setting
        for count in (2, 3):
            threads(count)
            for team in (True, False):
                ops.set_decode_team(team)
                logits, pool = decode(engine.model, engine.spec, True, 3, 3)
                assert torch.equal(logits, want_logits), f"threads={count} team={team}"
                assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8)), f"threads={count} team={team}"
    finally:
        ops.set_decode_team(before)


@pytest.mark.parametrize("team", [False, True])
def test_decode_layers_refuses_a_plan_of_the_wrong_size(team, threads, tiny_engines):
    """On two threads, with the step's threads in one region (a team) or forked per kernel: the
    check raises to the caller, and the next step runs and gives the same logits."""
    engine = Engine(tiny_engines("llama", "bfloat16"))
    model = engine.model
    want, _ = decode(model, engine.spec, True, 2, 2)
    threads(2)
    before = ops.set_decode_team(team)
    try:
        tensors, ints, floats = model.decode_plan()
        pool = KVPool(engine.spec, 2, 8, model.kv_dtype)
        h = torch.zeros(1, engine.spec.hidden_size, dtype=model.dtype)
        ctx = StepContext.single(0, 1, [0])
        with pytest.raises(RuntimeError, match="the plan has"):
            ops.decode_layers(h, h.clone(), tensors[:-1], ints, floats, pool.storage, pool.kv_layers,
                              pool.tables(ctx.block_tables), ctx.query_start, ctx.context_lens, model.cos, model.sin,
                              engine.spec.num_heads, model.scale, engine.spec.norm_eps)
        got, _ = decode(model, engine.spec, True, 2, 2)
        assert torch.equal(got, want)
    finally:
        ops.set_decode_team(before)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_plan_names_head_norms_only_where_the_model_has_them(arch, tiny_engines):
    """A layer's record names the head norms only where the model has them (decode_layers runs
    them where the record holds both)."""
    model = Engine(tiny_engines(arch)).model
    record = model._plan_record(0, model.layers[0])
    assert ("q_norm" in record and "k_norm" in record) == (arch == "qwen3")


def test_decode_plan_records_are_checked_by_name(tiny_engines):
    """The plan's positions come from the library; a record naming a field, entry or kind the
    library does not declare is refused before anything runs."""
    model = Engine(tiny_engines("llama", "bfloat16")).model
    layout = ops.library_info()["decode_plan"]
    layer = {**{name: getattr(model.layers[0], name).plan() for name in layout["layer_linears"]},
             "post_attention_norm": model.layers[0].post_attention_norm, "next_norm": model.final_norm}
    tensors, ints, floats = ops.decode_plan([layer])
    per_linear = len(layout["linear_tensors"])
    assert len(tensors) == len(layout["layer_linears"]) * per_linear + len(layout["layer_tensors"])
    assert tensors[0] is model.layers[0].qkv.weight and tensors[-1] is None  # kv_scales, head norms absent
    assert ints[0] == layout["linear_kinds"].index("dense_tiled" if model.layers[0].qkv.tiled else "dense")
    with pytest.raises(KeyError, match="unknown fields"):
        ops.decode_plan([{**layer, "qkv": {**layer["qkv"], "wieght": None}}])
    with pytest.raises(KeyError, match="unknown linear kind"):
        ops.decode_plan([{**layer, "out": {**layer["out"], "kind": "int3"}}])
    with pytest.raises(KeyError, match="unknown entries"):
        ops.decode_plan([{**layer, "final_norm": None}])


@pytest.mark.parametrize("arch, phases", [("llama", {"linears", "attention", "norms", "activation"}),
                                          ("mixtral", {"linears", "attention", "norms", "experts"})])
def test_step_clock_times_each_phase_of_decode_layers(arch, phases, tiny_engines):
    """ops.step_clock: off, decode steps gather nothing; on, each step counts once and each phase
    that runs takes time, within the step's; reading the clock clears it."""
    engine = Engine(tiny_engines(arch, "bfloat16"))
    ops.step_clock(False)
    decode(engine.model, engine.spec, True, 2, 1)
    assert json.loads(ops.step_clock(True))["calls"] == 0  # off: nothing gathered
    decode(engine.model, engine.spec, True, 3, 2)
    clock = json.loads(ops.step_clock(False))
    seconds = clock["seconds"]
    # the decode steps, and the prompts (10 and 9 rows) where steps that long fuse: Llama's bf16
    # dense linears take the kernel up to 64 rows, a Mixture of Experts fuses up to SKINNY_ROWS
    prompts = sum(len(PROMPT) - r <= engine.model.fused_rows for r in range(2))
    assert prompts == (2 if arch == "llama" else 0)
    assert clock["calls"] == 3 + prompts, clock
    assert {name for name, s in seconds.items() if s > 0} == phases | {"step"}, clock
    assert sum(s for name, s in seconds.items() if name != "step") <= seconds["step"], clock
    assert json.loads(ops.step_clock(False))["calls"] == 0  # read: cleared
