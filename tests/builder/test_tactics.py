"""Tactics at build time (builder/tactics.py): the row buckets, the choice of the fastest candidate,
the fast mode's shortcut, the timing cache, engine.json's record and the loader honouring it (or
saying why not)."""
import json
import os

import pytest

from kiln import constants as names
from kiln.builder import tactics
from kiln.errors import EngineError
from kiln.runtime.engine import Engine, sha256_file
from tests.helpers import AVX512_BF16_LEVELS, build_engine

KILN, TORCH = names.TACTIC_KILN, names.TACTIC_TORCH


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TACTICS_CACHE", str(tmp_path / "tactics.json"))


@pytest.fixture(autouse=True, scope="module")
def row_layout_level(plugin_isas):
    """Tactics choose between kiln's kernel on the row layouts and PyTorch's GEMM. On avx512bf16 and
    avx512amx a bf16 dense linear has one route (the tiled layout at every row count;
    test_tiled_bf16_linears_get_no_tactic), so there this module runs avx512, whose bf16 linears
    have both."""
    from kiln.plugins import ops

    if ops.active_isa() not in AVX512_BF16_LEVELS:
        yield
        return
    ops.select_isa("avx512")
    yield
    ops.select_isa(os.environ.get("KILN_ISA", "auto"))


def test_buckets_double_up_to_the_limit():
    assert tactics.buckets(1) == [1]
    assert tactics.buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert tactics.buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def fake_times(monkeypatch, torch_wins_from: int) -> list:
    """median_us made to report kiln's kernel faster below `torch_wins_from` rows and PyTorch's GEMM
    from there on; returns the log of (implementation, rows) timed. The implementation is told
    apart by what the linear's run() calls."""
    timed = []

    def median_us(run, repeats):
        seen = []
        from kiln.runtime import linear

        real_gemm, real_linear = linear.gemm, linear.ops.linear
        monkeypatch.setattr(linear, "gemm", lambda x, *a: seen.append((TORCH, x.shape[0])) or real_gemm(x, *a))
        monkeypatch.setattr(linear.ops, "linear", lambda x, *a: seen.append((KILN, x.shape[0])) or real_linear(x, *a))
        run()
        monkeypatch.setattr(linear, "gemm", real_gemm)
        monkeypatch.setattr(linear.ops, "linear", real_linear)
        choice, rows = seen[0]
        timed.append((choice, rows))
        return float(rows) * (1.0 if (choice == KILN) == (rows < torch_wins_from) else 2.0)

    monkeypatch.setattr(tactics, "median_us", median_us)
    return timed


@pytest.mark.parametrize("mode", ("fast", "exhaustive"))
def test_the_fastest_candidate_is_chosen_at_each_bucket(tiny_engines, monkeypatch, mode):
    engine = Engine(tiny_engines("llama", "bfloat16"))
    timed = fake_times(monkeypatch, torch_wins_from=16)
    chosen = tactics.choose(engine.model, mode, max_num_tokens=256, max_batch_size=4,
                            library=engine.dir / engine.meta["plugins"]["file"])
    assert chosen["mode"] == mode and chosen["isa"] == engine.isa
    keys = {linear.tactic_key() for linear in engine.model.linears()}
    assert set(chosen["linears"]) == keys
    head = engine.model.lm_head.tactic_key()
    for key, entry in chosen["linears"].items():
        assert entry["buckets"] == ([1, 2, 4] if key == head else [1, 2, 4, 8, 16, 32, 64, 128, 256])
        assert entry["choices"] == [KILN if rows < 16 else TORCH for rows in entry["buckets"]]
        untimed = [rows for rows, us in zip(entry["buckets"], entry["torch_us"]) if us is None]
        # fast: once the GEMM has won two buckets running (16, 32) the larger ones are not timed
        assert untimed == ([64, 128, 256] if mode == "fast" and key != head else [])
    assert all(rows <= (256 if mode == "exhaustive" else 32) for _, rows in timed)


def without_prefetch(section: dict) -> dict:
    return {key: value for key, value in section.items() if key != names.TACTIC_PREFETCH}


def test_a_rebuild_times_nothing_it_has_timed_before(tiny_engines, monkeypatch):
    engine = Engine(tiny_engines("llama", "bfloat16"))
    library = engine.dir / engine.meta["plugins"]["file"]
    first = tactics.choose(engine.model, "fast", 64, 4, library)
    monkeypatch.setattr(tactics, "median_us", lambda run, repeats: pytest.fail("timed again"))
    again = tactics.choose(engine.model, "fast", 64, 4, library)
    # (the prefetch distance is timed afresh: a few decode steps of the whole model, no cache)
    assert without_prefetch(again) == without_prefetch(first)
    # exhaustive wants more calls a bucket than fast timed: it times again
    with pytest.raises(pytest.fail.Exception, match="timed again"):
        tactics.choose(engine.model, "exhaustive", 64, 4, library)


def test_linears_with_one_route_get_no_tactic(tiny_engines, monkeypatch):
    """float32 dense linears have only PyTorch's GEMM: nothing is timed or recorded."""
    engine = Engine(tiny_engines("llama", "float32"))
    monkeypatch.setattr(tactics, "median_us", lambda run, repeats: pytest.fail("nothing to choose between"))
    chosen = tactics.choose(engine.model, "fast", 64, 4, engine.dir / engine.meta["plugins"]["file"])
    assert chosen["linears"] == {}


@pytest.mark.parametrize("isa", AVX512_BF16_LEVELS)
def test_tiled_bf16_linears_get_no_tactic(isa, tiny_engines, plugin_isas, monkeypatch):
    """On avx512bf16 and avx512amx every bf16 linear of the model takes the tiled layout at every
    row count (vdpbf16ps, AMX tiles): nothing is timed or recorded (and a tactic of the row layout's
    never applies: runtime/test_tactics.py)."""
    from kiln.plugins import ops

    if isa not in plugin_isas:
        pytest.skip(f"this CPU lacks {isa}")
    before = ops.active_isa()
    ops.select_isa(isa)
    try:
        engine = Engine(tiny_engines("llama", "bfloat16"))
        assert all(linear.tiled for linear in engine.model.linears())
        monkeypatch.setattr(tactics, "median_us", lambda run, repeats: pytest.fail("nothing to choose between"))
        chosen = tactics.choose(engine.model, "fast", 64, 4, engine.dir / engine.meta["plugins"]["file"])
        assert chosen["isa"] == isa and chosen["linears"] == {}
    finally:
        ops.select_isa(before)  # the module's level (row_layout_level)


@pytest.fixture(scope="module")
def engine_with_tactics(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tactics")
    return build_engine(root / "llama", tiny_models["llama"], "bfloat16", tactics="fast", max_num_tokens=64)


def test_the_build_records_tactics_and_the_loader_takes_them(engine_with_tactics, caplog):
    meta = json.loads((engine_with_tactics / names.ENGINE_JSON).read_text())
    section = meta[names.TACTICS]
    assert section["mode"] == "fast" and section["isa"] == meta["target"]["isa"]
    engine = Engine(engine_with_tactics)
    assert engine.tactics.startswith(f"tactics of {section['cpu']} (fast) for ")
    for linear in engine.model.linears():
        entry = section["linears"][linear.tactic_key()]
        assert linear.tactic is not None and linear.tactic.choices == entry["choices"]
        for rows, choice, kiln_us, torch_us in zip(entry["buckets"], entry["choices"], entry["kiln_us"],
                                                   entry["torch_us"]):
            if kiln_us is not None and torch_us is not None:  # the winner is the faster one measured
                assert choice == (KILN if kiln_us <= torch_us else TORCH), (linear.tactic_key(), rows)


def test_tactics_of_other_kernels_are_not_taken(engine_with_tactics, monkeypatch, caplog):
    from kiln.plugins import ops

    built = json.loads((engine_with_tactics / names.ENGINE_JSON).read_text())["target"]["isa"]
    other = "scalar" if built != "scalar" else "avx2"
    monkeypatch.setattr(ops, "active_isa", lambda: other)
    with caplog.at_level("WARNING", logger="kiln.engine"):
        engine = Engine(engine_with_tactics)
    assert engine.tactics == f"defaults (tactics timed on {built} kernels, this host runs {other})"
    assert f"this host runs {other} kernels" in caplog.text
    assert all(linear.tactic is None for linear in engine.model.linears())


def edited_copy(engine_dir, destination, edit):
    """A copy of the engine whose engine.json's tactics section edit() changed (manifest updated)."""
    import shutil

    shutil.copytree(engine_dir, destination)
    meta = json.loads((destination / names.ENGINE_JSON).read_text())
    edit(meta[names.TACTICS])
    (destination / names.ENGINE_JSON).write_text(json.dumps(meta))
    manifest = json.loads((destination / names.MANIFEST_FILE).read_text())
    manifest["files"][names.ENGINE_JSON] = sha256_file(destination / names.ENGINE_JSON)
    (destination / names.MANIFEST_FILE).write_text(json.dumps(manifest))
    return destination


def test_malformed_tactics_are_refused(engine_with_tactics, tmp_path):
    def unknown_choice(section):
        next(iter(section["linears"].values()))["choices"][0] = "onednn"

    copy = edited_copy(engine_with_tactics, tmp_path / "engine", unknown_choice)
    with pytest.raises(EngineError, match="tactics are malformed.*unknown tactic choice.*rebuild"):
        Engine(copy)


@pytest.mark.parametrize("slow_at", tactics.PREFETCH_BYTES)
def test_the_prefetch_distance_chosen_is_the_fastest(tiny_engines, monkeypatch, slow_at):
    """Decode steps timed 1 ms, 4 ms at one distance: the other is chosen with the medians
    recorded, every step ran the model at the distance set, and the library's distance is what
    it was before."""
    from kiln.plugins import ops

    engine = Engine(tiny_engines("llama", "bfloat16"))
    steps = []

    def seconds(run):
        run()
        now = ops.set_prefetch(0)
        ops.set_prefetch(now)
        steps.append(now)
        return 0.004 if now == slow_at else 0.001

    monkeypatch.setattr(tactics, "seconds", seconds)
    before = ops.set_prefetch(1024)
    try:
        chosen = tactics.choose_prefetch(engine.model, "fast")
        assert ops.set_prefetch(before) == 1024
    finally:
        ops.set_prefetch(before)
    other = next(nbytes for nbytes in tactics.PREFETCH_BYTES if nbytes != slow_at)
    assert chosen == {"bytes": other, "step_us": {str(slow_at): 4000.0, str(other): 1000.0}}
    rounds = tactics.PREFETCH_STEPS["fast"] + 1  # (the first warms up)
    assert steps == list(tactics.PREFETCH_BYTES) * rounds


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_the_prefetch_distance_is_timed_on_sliding_window_and_expert_models(tiny_engines, arch):
    """The decode steps run the model's own layers (Gemma 3's sliding windows, Qwen3-MoE's
    experts): a distance chosen and a positive median for each."""
    engine = Engine(tiny_engines(arch, "bfloat16"))
    chosen = tactics.choose_prefetch(engine.model, "fast")
    assert chosen["bytes"] in tactics.PREFETCH_BYTES
    assert set(chosen["step_us"]) == {str(nbytes) for nbytes in tactics.PREFETCH_BYTES}
    assert all(us > 0 for us in chosen["step_us"].values())


def test_a_prefetch_tie_keeps_the_default(tiny_engines, monkeypatch):
    engine = Engine(tiny_engines("llama", "bfloat16"))
    monkeypatch.setattr(tactics, "seconds", lambda run: 0.002)
    assert tactics.choose_prefetch(engine.model, "fast")["bytes"] == tactics.DEFAULT_PREFETCH_BYTES


@pytest.mark.parametrize("nbytes", tactics.PREFETCH_BYTES)
def test_the_loader_sets_the_prefetch_distance_the_build_chose(engine_with_tactics, tmp_path, nbytes):
    from kiln.plugins import ops

    section = json.loads((engine_with_tactics / names.ENGINE_JSON).read_text())[names.TACTICS]
    assert section[names.TACTIC_PREFETCH]["bytes"] in tactics.PREFETCH_BYTES
    copy = edited_copy(engine_with_tactics, tmp_path / "engine",
                       lambda section: section[names.TACTIC_PREFETCH].update(bytes=nbytes))
    before = ops.set_prefetch(1024)
    try:
        engine = Engine(copy)
        assert ops.set_prefetch(before) == nbytes
    finally:
        ops.set_prefetch(before)
    assert engine.tactics.endswith(f"; weight prefetch {nbytes} bytes ahead")


def test_kiln_prefetch_bytes_outranks_the_build(engine_with_tactics, monkeypatch):
    from kiln.plugins import ops

    monkeypatch.setenv(names.PREFETCH_BYTES_ENV, "1024")
    before = ops.set_prefetch(2048)  # what the library would have taken from the variable at load
    try:
        engine = Engine(engine_with_tactics)
        assert ops.set_prefetch(before) == 2048
    finally:
        ops.set_prefetch(before)
    assert f"weight prefetch as {names.PREFETCH_BYTES_ENV} sets it" in engine.tactics


@pytest.mark.parametrize("nbytes", [-1, 1 << 30, "4096"])
def test_a_malformed_prefetch_distance_is_refused(engine_with_tactics, tmp_path, nbytes):
    copy = edited_copy(engine_with_tactics, tmp_path / "engine",
                       lambda section: section[names.TACTIC_PREFETCH].update(bytes=nbytes))
    with pytest.raises(EngineError, match="tactics are malformed.*prefetch.*rebuild"):
        Engine(copy)
