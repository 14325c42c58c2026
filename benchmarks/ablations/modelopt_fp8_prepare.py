"""Step 1 of the Model Optimizer FP8 comparison (docs/benchmarks.md), in kiln's .venv:
SmolLM2 (the GGUF's weights in float32) saved as a Hugging Face folder, and kiln's builtin
calibration token ids, under /tmp/mofp8.

    PYTHONPATH=. .venv/bin/python benchmarks/ablations/modelopt_fp8_prepare.py
    .venv-modelopt/bin/python benchmarks/ablations/modelopt_fp8_export.py
    PYTHONPATH=. .venv/bin/python benchmarks/ablations/modelopt_fp8_measure.py 100000
"""
import torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from tests.helpers import SMOLLM2_FILE, smollm2_dir
from tokenizers import Tokenizer
from kiln.quantize.datasets import calibration_sequences
from safetensors.torch import save_file
out = Path("/tmp/mofp8/smollm2-hf")
tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_FILE)
model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_FILE, dtype=torch.float32)
import transformers
config = model.config
for attr in ("quantization_config",):
    if hasattr(config, attr): delattr(config, attr)
clean = transformers.LlamaForCausalLM(config)
clean.load_state_dict(model.state_dict())
clean.save_pretrained(out); tok.save_pretrained(out)
seqs = calibration_sequences(Tokenizer.from_file(str(out / "tokenizer.json")), "builtin", 64, 256, base=Path.cwd())
save_file({"ids": torch.tensor(seqs)}, "/tmp/mofp8/calib.safetensors")
print(len(seqs), len(seqs[0]))
