import os
import random

import pytest

from tests.helpers import SMOLLM2_CHECKPOINT, build_engine, make_tiny_model, seed_of

# every kernel level the plugin library has, lowest first (AVX2 with AVX-VNNI is its own level)
ISAS = ("scalar", "avx2", "avx2vnni", "avx512", "avx512bf16", "avx512amx")


@pytest.fixture(autouse=True)
def fixed_seed(request):
    """Every test starts from a seed of its own id (printed, so a failure can be replayed): tests
    that draw from torch's or random's global generators are replayable too."""
    import torch

    seed = seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """architecture -> Hugging Face folder of a tiny random model."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch)
            for arch in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "olmoe",
                         "qwen2_moe")}


@pytest.fixture(scope="session")
def tiny_engines(tiny_models, tmp_path_factory):
    """(architecture, dtype) -> engine dir, built on first use."""
    root = tmp_path_factory.mktemp("tiny_engines")
    built = {}

    def get(arch: str, dtype: str = "float32"):
        if (arch, dtype) not in built:
            built[arch, dtype] = build_engine(root / f"{arch}-{dtype}", tiny_models[arch], dtype)
        return built[arch, dtype]

    return get


@pytest.fixture(scope="session")
def smollm2_engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    built = {}

    def get(dtype: str):
        if dtype not in built:
            built[dtype] = build_engine(root / dtype, SMOLLM2_CHECKPOINT, dtype, max_input_len=512,
                                        max_seq_len=1024, max_batch_size=16)
        return built[dtype]

    return get


@pytest.fixture(scope="session")
def plugin_isas():
    """Load the plugin library; the instruction sets this host can run (reset to KILN_ISA, or
    auto, after)."""
    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins

    ops.load_library(build_plugins())
    isas = []
    for isa in ISAS:
        try:
            ops.select_isa(isa)
            isas.append(isa)
        except RuntimeError:
            pass
    ops.select_isa(os.environ.get("KILN_ISA", "auto"))
    return isas


@pytest.fixture(params=ISAS)
def isa(request, plugin_isas):
    from kiln.plugins import ops

    if request.param not in plugin_isas:
        pytest.skip(f"this CPU lacks {request.param}")
    ops.select_isa(request.param)
    yield request.param
    ops.select_isa(os.environ.get("KILN_ISA", "auto"))


@pytest.fixture(scope="session")
def llm_for():
    """Open an LLM once per (engine, runtime options) for the whole session; all are closed
    (executor threads stopped) at the end."""
    from kiln.runtime.llm import LLM

    opened = {}

    def get(engine_dir, **options):
        key = (str(engine_dir), tuple(sorted(options.items())))
        if key not in opened:
            opened[key] = LLM(engine_dir, **options)
        return opened[key]

    yield get
    for llm in opened.values():
        llm.close()


@pytest.fixture(scope="session")
def batch_engine(tiny_models, tmp_path_factory):
    """Tiny float32 Llama built for batching tests: 64 sequences a step, 256 tokens a step
    (long prompts are chunked), blocks of 16 tokens."""
    return build_engine(tmp_path_factory.mktemp("batch_engine"), tiny_models["llama"], "float32",
                        max_batch_size=64, max_num_tokens=256, max_input_len=256, max_seq_len=512,
                        kv_block_size=16)
