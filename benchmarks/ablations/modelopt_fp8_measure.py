"""Step 3 (kiln's .venv): a bf16 kiln engine built from the export, scored against the float32
GGUF weights on the held-out text with kiln.quantize.report.measure (windows of 512)."""
import sys
from pathlib import Path
from kiln.quantize.datasets import evaluation_ids
from kiln.quantize.report import measure
from kiln.runtime.engine import Engine
from tests.helpers import build_engine
from smollm2 import load

_, _, tok, ref = load()
engine = Engine(build_engine(Path("/tmp/mofp8/engine"), Path("/tmp/mofp8/fp8"), "bfloat16", max_input_len=1024, max_seq_len=2048))
ids = evaluation_ids(tok, "builtin", int(sys.argv[1]), base=Path.cwd())
r = measure(ref, engine.model, ids, 512)
print(f"Model Optimizer FP8 (per-tensor, max calibration, bf16 lm_head): tokens {r.tokens} ppl {r.ppl_reference:.4f} -> {r.ppl_quantized:.4f} ({r.ppl_increase:+.2%}) agree {r.token_agreement:.2%} kl {r.kl:.4f}")
