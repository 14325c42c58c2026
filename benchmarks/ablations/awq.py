"""AWQ variants on SmolLM2, group 64, measured on the same held-out tokens (docs/benchmarks.md
quotes its output).

    PYTHONPATH=. python benchmarks/ablations/awq.py TOKENS ROWS VARIANT...

ROWS: calibration rows sampled per linear; VARIANT: base, duo, cliprows, clipgrid, rms, grid40,
rel, sqrtrel (each swaps one piece of kiln.quantize.algorithms for the run)."""
import sys, time, torch
from pathlib import Path
import kiln.quantize.algorithms as A
from kiln.quantize.calibrate import calibrate
from kiln.quantize.datasets import calibration_sequences, evaluation_ids
from kiln.quantize.formats import fake_quant_int4
from kiln.quantize.report import measure
from kiln.runtime.model import LlamaModel

from smollm2 import load

spec, w, tok, ref = load()
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 256
t = time.time()
stats = calibrate(ref, calibration_sequences(tok, "builtin", 64, 256, base=Path.cwd()), rows=rows)
print("calibrated", time.time() - t, "rows", rows, flush=True)
ids = evaluation_ids(tok, "builtin", int(sys.argv[1]), base=Path.cwd())

def run(label):
    t = time.time()
    q = A.quantize_weights(w, spec, A.QuantOptions("int4_awq", group_size=64), torch.bfloat16, stats)
    qt = time.time() - t
    model = LlamaModel(spec, q, 2048, A.quantization_meta(A.QuantOptions("int4_awq", group_size=64)))
    r = measure(ref, model, ids, 512)
    print(f"{label:40s} ppl {r.ppl_increase:+.2%} agree {r.token_agreement:.2%} kl {r.kl:.4f} (quantize {qt:.0f}s)", flush=True)

orig_awq = A.awq_scales
def duo(wt, x, absmean_x, group):
    reference = x @ wt.T
    best_error, best = float("inf"), torch.ones_like(absmean_x)
    wmean = wt.abs().mean(dim=0).clamp(min=1e-6)
    for i in range(A.AWQ_GRID):
        a = i / A.AWQ_GRID
        for duo_on in (False, True):
            s = absmean_x.clamp(min=1e-4).pow(a)
            if duo_on:
                s = s / wmean.pow(1 - a)
            s = s / (s.max() * s.min()).sqrt()
            error = (x @ (fake_quant_int4(wt * s, group) / s).T - reference).pow(2).mean().item()
            if error < best_error:
                best_error, best = error, s
    return best

for v in sys.argv[3:]:
    if v == "base":
        A.awq_scales = orig_awq; run("awq baseline")
    elif v == "duo":
        A.awq_scales = duo; run("awq + duo scaling (w mean)")

def rms_scales(wt, x, absmean_x, group):
    return orig_awq(wt, x, x.pow(2).mean(dim=0).sqrt(), group)

for v in sys.argv[3:]:
    if v == "cliprows":
        A.awq_scales = orig_awq; A.CLIP_ROWS = 256; run("clip search on 256 rows"); A.CLIP_ROWS = 128
    elif v == "clipgrid":
        A.awq_scales = orig_awq; A.CLIP_GRID = 20; run("clip grid 20"); A.CLIP_GRID = 10
    elif v == "rms":
        A.awq_scales = rms_scales; run("awq scales from rms|x|"); A.awq_scales = orig_awq
    elif v == "grid40":
        A.awq_scales = orig_awq; A.AWQ_GRID = 40; run("awq grid 40"); A.AWQ_GRID = 20

def normalised_scales(power):
    """AWQ's scale search with each row's output error divided by ||reference row||^(2 power)."""
    def search(wt, x, absmean_x, group):
        reference = x @ wt.T
        norm = reference.pow(2).sum(dim=1).clamp(min=1e-12).pow(power)
        best_error, best = float("inf"), torch.ones_like(absmean_x)
        for i in range(A.AWQ_GRID):
            s = absmean_x.clamp(min=1e-4).pow(i / A.AWQ_GRID)
            s = s / (s.max() * s.min()).sqrt()
            error = ((x @ (fake_quant_int4(wt * s, group) / s).T - reference).pow(2).sum(dim=1) / norm).mean().item()
            if error < best_error:
                best_error, best = error, s
        return best
    return search

rel_scales, sqrt_scales = normalised_scales(1.0), normalised_scales(0.5)

for v in sys.argv[3:]:
    if v == "rel":
        A.awq_scales = rel_scales; run("awq scale loss relative per row"); A.awq_scales = orig_awq
    if v == "sqrtrel":
        A.awq_scales = sqrt_scales; run("awq scale loss / row norm"); A.awq_scales = orig_awq
