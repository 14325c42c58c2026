"""GPTQ error feedback on int4 (group 64) for SmolLM2, measured on the same held-out tokens as
awq.py (docs/benchmarks.md quotes its output).

    PYTHONPATH=. python benchmarks/ablations/gptq.py TOKENS VARIANT...

VARIANT: rtn (int4_wo: no scales, round to nearest), awq (int4_awq, round to nearest), gptq_awq (int4_awq, GPTQ rounding), gptq_alone (GPTQ
on int4 without AWQ's scales and clipping), fp8 / gptq_fp8, sq / gptq_sq (int8_sq)."""
import sys, time, torch
from pathlib import Path
import kiln.quantize.algorithms as A
from kiln.quantize.calibrate import Grams, calibrate
from kiln.quantize.datasets import calibration_sequences, evaluation_ids
from kiln.quantize.report import measure
from kiln.runtime.model import LlamaModel

torch.manual_seed(0)
from smollm2 import load

spec, w, tok, ref = load()
t = time.time()
sequences = calibration_sequences(tok, "builtin", 64, 256, base=Path.cwd())
stats = calibrate(ref, sequences, gram_layers=range(spec.num_layers))
grams = Grams(ref, sequences, stats, budget=1 << 40)  # every layer's sums held
print("calibrated", round(time.time() - t), "s", flush=True)
ids = evaluation_ids(tok, "builtin", int(sys.argv[1]), base=Path.cwd())


def run(label, algo, rounding):
    options = A.QuantOptions(algo, group_size=64, weight_rounding=rounding)
    t = time.time()
    q = A.quantize_weights(w, spec, options, torch.bfloat16, stats, grams=grams)
    qt = time.time() - t
    model = LlamaModel(spec, q, 2048, A.quantization_meta(options))
    r = measure(ref, model, ids, 512)
    print(f"{label:40s} ppl {r.ppl_increase:+.2%} agree {r.token_agreement:.2%} kl {r.kl:.4f} (quantize {qt:.0f}s)",
          flush=True)


awq_scales, awq_clip = A.awq_scales, A.awq_clip
for v in sys.argv[2:]:
    algo, rounding = {"rtn": ("int4_wo", "nearest"), "awq": ("int4_awq", "nearest"), "gptq_awq": ("int4_awq", "gptq"),
                      "gptq_alone": ("int4_awq", "gptq"), "fp8": ("fp8", "nearest"), "gptq_fp8": ("fp8", "gptq"),
                      "sq": ("int8_sq", "nearest"), "gptq_sq": ("int8_sq", "gptq")}[v]
    if v == "gptq_alone":  # no AWQ scales, no clipping: GPTQ on int4_wo's grid
        A.awq_scales = lambda w, x, absmean, group: torch.ones_like(absmean)
        A.awq_clip = lambda w, x, group: torch.ones(w.shape[0], -(-w.shape[1] // group))
    run(f"{algo}, weight_rounding {rounding}" + (" (no AWQ scales or clip)" if v == "gptq_alone" else ""),
        algo, rounding)
    A.awq_scales, A.awq_clip = awq_scales, awq_clip
