"""A build runs the kernel level the library is set to (KILN_ISA, or select_isa in tests), records
it in engine.json and leaves it set: under `KILN_ISA=avx2` a build, its calibration and its
accuracy report all run the AVX2 kernels, and so does whatever runs after it in the process."""
import json

from kiln import constants as names
from kiln.plugins import ops
from tests.helpers import build_engine


def test_the_build_keeps_the_selected_level(isa, tiny_models, tmp_path):
    engine_dir = build_engine(tmp_path / "engine", tiny_models["llama"])
    assert ops.active_isa() == isa
    assert json.loads((engine_dir / names.ENGINE_JSON).read_text())["target"]["isa"] == isa
