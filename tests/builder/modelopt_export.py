"""Run by tests/builder/test_modelopt.py in a separate environment with NVIDIA Model Optimizer
(nvidia-modelopt 0.47 pins transformers < 5.15; scripts/setup.sh makes .venv-modelopt):

    python modelopt_export.py HF_FOLDER OUT_FOLDER fp8|fp8_kv|int4_awq|int8_sq GROUP_SIZE

quantizes the model with Model Optimizer's own calibration on random tokens, writes its
Hugging Face export to OUT_FOLDER, and OUT_FOLDER-logits.safetensors: a prompt and the logits of
the fake-quantized model. Nothing from kiln is imported here."""
import copy
import sys
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
import transformers
from modelopt.torch.export import export_hf_checkpoint
from safetensors.torch import save_file

src, out, algo, group = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
config = copy.deepcopy({"fp8": mtq.FP8_DEFAULT_CFG, "fp8_kv": mtq.FP8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG,
                        "int8_sq": mtq.INT8_SMOOTHQUANT_CFG}[algo])
if algo == "fp8_kv":  # and an FP8 KV cache
    config["quant_cfg"] = config["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
for entry in config["quant_cfg"]:
    if algo == "int4_awq" and entry.get("quantizer_name") == "*weight_quantizer":
        entry["cfg"]["block_sizes"][-1] = group
g = torch.Generator().manual_seed(1)
batches = [torch.randint(3, model.config.vocab_size, (2, 32), generator=g) for _ in range(4)]
prompt = torch.tensor([[1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 8, 150, 3]])


def calibrate(m):
    for batch in batches:
        m(batch)


model = mtq.quantize(model, config, calibrate)
with torch.inference_mode():
    logits = model(prompt).logits[0].float().clone()
    export_hf_checkpoint(model, export_dir=str(out))
save_file({"prompt": prompt[0], "quantized": logits}, str(out.parent / f"{out.name}-logits.safetensors"))
