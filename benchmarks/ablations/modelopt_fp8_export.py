"""Step 2 (in .venv-modelopt): Model Optimizer's FP8_DEFAULT_CFG (per-tensor weights and static
activations, max calibration) on kiln's calibration ids; its Hugging Face export to /tmp/mofp8/fp8."""
import torch, transformers
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from safetensors.torch import load_file
model = transformers.AutoModelForCausalLM.from_pretrained("/tmp/mofp8/smollm2-hf", torch_dtype=torch.float32)
ids = load_file("/tmp/mofp8/calib.safetensors")["ids"]
def loop(m):
    for i in range(0, ids.shape[0], 8):
        m(ids[i:i + 8])
model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, loop)
with torch.inference_mode():
    export_hf_checkpoint(model, export_dir="/tmp/mofp8/fp8")
import shutil
for name in ("tokenizer.json", "tokenizer_config.json"):  # (the export leaves them out)
    shutil.copy(f"/tmp/mofp8/smollm2-hf/{name}", f"/tmp/mofp8/fp8/{name}")
