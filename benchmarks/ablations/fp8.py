"""Where SmolLM2 loses accuracy under FP8 and a quantized KV cache: variants measured on the
same held-out tokens (docs/benchmarks.md quotes its output).

    PYTHONPATH=. python benchmarks/ablations/fp8.py THREADS TOKENS VARIANT...

VARIANT: fp8, fp8_nohead, fp8_tensor, wonly (FP8 weights only), only_{qkv,out,gate_up,down}
(FP8 activations on that linear only), kv_int8 / kv_fp8 (the KV cache alone), fp8_mse (the
activation-weighted weight-scale search, as it was tried before it became the default)."""
import sys, time, torch
from pathlib import Path
from kiln import constants as names
from kiln.quantize.algorithms import QuantOptions, quantize_weights, quantization_meta
from kiln.quantize.calibrate import calibrate
from kiln.quantize.datasets import calibration_sequences, evaluation_ids
from kiln.quantize.report import measure
from kiln.runtime.model import LlamaModel

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from smollm2 import load

spec, w, tok, ref = load()
t = time.time()
stats = calibrate(ref, calibration_sequences(tok, "builtin", 64, 256, base=Path.cwd()))
print("calibrated", time.time() - t, flush=True)
ids = evaluation_ids(tok, "builtin", int(sys.argv[2]) if len(sys.argv) > 2 else 4096, base=Path.cwd())

def run(label, options, drop_scales=(), kv=None):
    q = quantize_weights(w, spec, options, torch.bfloat16, stats)
    for key in list(q):
        if key.endswith(names.INPUT_SCALE) and any(f".{d}" in key for d in drop_scales):
            del q[key]
    meta = quantization_meta(options)
    if "all" in drop_scales:
        meta["linear"] = names.LINEAR_FP8
    model = LlamaModel(spec, q, 2048, meta)  # linears without an input_scale: FP8 weights only
    r = measure(ref, model, ids, 512)
    print(f"{label:40s} ppl {r.ppl_increase:+.2%} agree {r.token_agreement:.2%} kl {r.kl:.4f}", flush=True)

import kiln.runtime.linear as L
orig = L.load_linear
def lenient(weights, name, dtype, quant, bias=None):  # allow fp8 without input_scale (weight-only)
    try:
        return orig(weights, name, dtype, quant, bias)
    except KeyError:
        prefix = names.linear_prefix(name)
        return L.Fp8Linear(weights[prefix + ".qweight"], weights[prefix + ".scales"], bias, None, dtype)
import kiln.runtime.model as M
M.load_linear = lenient

for variant in sys.argv[3:]:
    if variant == "fp8":
        run("fp8 per channel", QuantOptions("fp8"))
    elif variant == "fp8_nohead":
        run("fp8 per channel, bf16 lm_head", QuantOptions("fp8", lm_head="none"))
    elif variant == "fp8_tensor":
        run("fp8 per tensor", QuantOptions("fp8", fp8_per_tensor=True))
    elif variant == "wonly":
        run("fp8 weights only", QuantOptions("fp8"), drop_scales=("qkv", "out", "gate_up", "down"))
    elif variant.startswith("only_"):
        keep = variant[5:]
        run(f"fp8 act only on {keep}", QuantOptions("fp8"), drop_scales=tuple(n for n in ("qkv", "out", "gate_up", "down") if n != keep))
    elif variant.startswith("kv_"):
        run(f"kv cache {variant[3:]} only", QuantOptions("none", kv_cache=variant[3:]))

def fp8_mse_quant(wt, x2, per_tensor=False):
    """per-row scale ratio in [0.7, 1] minimising sum_j E[x_j^2] (w - q)^2"""
    from kiln.quantize.formats import FP8_MAX
    amax = wt.abs().amax(dim=1)
    best_err = torch.full_like(amax, float("inf")); best = amax / FP8_MAX
    for i in range(16):
        r = 1 - i * 0.02
        s = (amax * r / FP8_MAX).clamp(min=1e-12)
        q = (wt / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s[:, None]
        err = ((q - wt) ** 2 * x2[None, :]).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err); best = torch.where(better, s, best)
    q = (wt / best[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, best.contiguous()

import kiln.quantize.algorithms as A
if "fp8_mse" in sys.argv:
    def qw(weights, spec, options, dtype, stats, progress=lambda: None):
        out = A.__dict__["_orig_qw"](weights, spec, options, dtype, stats, progress)
        for i in range(spec.num_layers):
            layer = A.LayerWeights.take(weights, i, spec)
            for n, wn in A.LINEAR_WEIGHTS.items():
                prefix = names.linear_prefix(names.layer_tensor(i, wn))
                x2 = stats[i, n].rows.pow(2).mean(dim=0)
                q, s = fp8_mse_quant(layer.linears[n], x2)
                out[prefix + ".qweight"], out[prefix + ".scales"] = q, s
        return out
    A._orig_qw = A.quantize_weights
    quantize_weights = qw
    run("fp8 mse-searched weight scales", QuantOptions("fp8"))
    run("fp8 mse weights only", QuantOptions("fp8"), drop_scales=("qkv", "out", "gate_up", "down"))
