"""Where a quantized KV cache loses accuracy on SmolLM2, and what rotating the keys buys:
the float32 model with the cache's rounding simulated in a plain PyTorch attention (the
reference's), keys and values quantized together or one at a time, keys rotated or not
(docs/quantization.md "Key rotation" quotes its output).

    PYTHONPATH=. python benchmarks/ablations/kv_rotation.py THREADS TOKENS [--json OUT]

Per rotation (none, the Hadamard matrix kiln uses, the same with random signs), format (fp8,
int8) and what is quantized (K and V, K only, V only), with two kinds of key scale: the
calibrated maximum of the keys as stored (at the calibration positions only: could saturate
elsewhere) and the bound over every position that kiln's calibration takes (its kv_observer). Prints perplexity
increase and KL against the float model on the held-out tokens (windows of 1024)."""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kiln.plugins import ops, reference
from kiln.quantize.calibrate import KVStats, kv_observer
from kiln.quantize.datasets import calibration_sequences, evaluation_ids
from kiln.quantize.evaluate import window_logits
from kiln.plugins.formats import hadamard_matrix

parser = argparse.ArgumentParser()
parser.add_argument("threads", type=int)
parser.add_argument("tokens", type=int)
parser.add_argument("--json", type=Path)
args = parser.parse_args()
torch.set_num_threads(args.threads)
sys.path.insert(0, str(Path(__file__).parent))
from smollm2 import load  # noqa: E402

spec, _, tokenizer, model = load()
model.fused_decode = False
D, KVH = spec.head_dim, spec.num_kv_heads
signs = torch.where(torch.rand(D, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
ROTATIONS = {"none": torch.eye(D), "hadamard": hadamard_matrix(D), "hadamard, random signs": hadamard_matrix(D) * signs}
FORMAT_MAX = {"fp8": 448.0, "int8": 127.0}
WINDOW = 1024


def fake_quant(x, scale, fmt):
    y = x / scale
    if fmt == "int8":
        return torch.round(y).clamp(-127, 127) * scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


class Attention:
    """Stands in for ops.paged_attention over one window from position 0: RoPE, then keys times R
    (and queries: R is orthonormal, so it is q R^T . k R^T), then the simulated rounding."""

    def __init__(self):
        self.layer, self.mode, self.rotation, self.stats = 0, "float", "none", {}
        self.fmt, self.keys, self.values, self.bound = "fp8", True, True, False

    def __call__(self, qkv, k_pool, v_pool, block_tables, query_start, context_lens, cos, sin, heads, scale,
                 kv_scales=None, key_hadamard=0):
        layer, self.layer = self.layer, (self.layer + 1) % spec.num_layers
        tokens = qkv.shape[0]
        q, k, v = (t.reshape(tokens, -1, D).float() for t in qkv.split((heads * D, KVH * D, KVH * D), dim=-1))
        pos = torch.arange(tokens)
        c, s = cos[pos].float(), sin[pos].float()
        r = ROTATIONS[self.rotation]
        q, keys = reference.rope(q, c, s) @ r.T, reference.rope(k, c, s) @ r.T
        if self.mode == "calibrate":  # kiln's own observer for the bounds and V's range
            st = self.stats.setdefault((self.rotation, layer), {"k": torch.zeros(KVH, D), "kv": KVStats.empty(KVH * D)})
            st["k"] = torch.maximum(st["k"], keys.abs().amax(0))
            kv_observer(st["kv"], heads * D, KVH * D, D)(qkv)
        elif self.mode == "quantize":
            st, top = self.stats[self.rotation, layer], FORMAT_MAX[self.fmt]
            if self.keys:
                keys = fake_quant(keys, (key_bound(self.rotation, st) if self.bound else st["k"]) / top, self.fmt)
            if self.values:
                v = fake_quant(v, st["kv"].v_absmax.reshape(KVH, D) / top, self.fmt)
        keys, v = keys.repeat_interleave(heads // KVH, 1), v.repeat_interleave(heads // KVH, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) * scale
        scores = scores.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(tokens, heads * D).to(qkv.dtype)


def key_bound(rotation, st):
    """The calibrated bound on the keys as stored at every position (random signs on H's columns
    leave |H| and so the bound unchanged)."""
    kv = st["kv"]
    return (kv.k_absmax if rotation == "none" else kv.k_hadamard_absmax).reshape(KVH, D)


attention = Attention()
ops.paged_attention = attention  # LlamaModel's Python loop calls ops.paged_attention


def log_probs(ids):
    out = []
    for begin in range(0, len(ids) - 1, WINDOW):
        attention.layer = 0
        out.append(torch.log_softmax(window_logits(model, ids[begin:begin + WINDOW], 32)[:-1], dim=-1))
    return out


def score(ids, reference_lp, lp):
    nll, kl, n = 0.0, 0.0, 0
    for w, (r, q) in enumerate(zip(reference_lp, lp)):
        targets = torch.tensor(ids[w * WINDOW + 1: w * WINDOW + 1 + r.shape[0]])
        nll -= q[torch.arange(len(targets)), targets].sum().item()
        kl += (r.exp() * (r - q)).sum().item()
        n += len(targets)
    return nll / n, kl / n


start = time.time()
calibration = calibration_sequences(tokenizer, "builtin", 32, 512, base=Path.cwd())
ids = evaluation_ids(tokenizer, "builtin", args.tokens, base=Path.cwd())
reference_lp = log_probs(ids)
base_nll, _ = score(ids, reference_lp, reference_lp)
rows = []
for rotation in ROTATIONS:
    attention.mode, attention.rotation = "calibrate", rotation
    for sequence in calibration:
        attention.layer = 0
        window_logits(model, sequence, 32)
    ratio = float(torch.stack([(key_bound(rotation, attention.stats[rotation, i]) / attention.stats[rotation, i]["k"]).median()
                               for i in range(spec.num_layers)]).median())
    for fmt in FORMAT_MAX:
        for keys, values in ((True, True), (True, False), (False, True)):
            for bound in ((False, True) if keys else (False,)):
                attention.mode = "quantize"
                attention.fmt, attention.keys, attention.values, attention.bound = fmt, keys, values, bound
                nll, kl = score(ids, reference_lp, log_probs(ids))
                rows.append({"rotation": rotation, "format": fmt, "quantized": "K and V" if keys and values else
                             "K only" if keys else "V only", "key_scale": "bound" if bound else "calibrated max",
                             "bound_over_max": ratio, "ppl_increase": math.exp(nll - base_nll) - 1, "kl": kl})
                print(rows[-1], f"({time.time() - start:.0f} s)", file=sys.stderr, flush=True)

table = Table(title=f"KV-cache rounding on SmolLM2, float32 model, {len(ids)} held-out tokens")
for column in ("rotation", "format", "quantized", "key scale", "bound / max", "ppl increase", "KL"):
    table.add_column(column)
for r in rows:
    table.add_row(r["rotation"], r["format"], r["quantized"], r["key_scale"], f"{r['bound_over_max']:.2f}",
                  f"{r['ppl_increase'] * 100:+.2f}%", f"{r['kl']:.4f}")
Console().print(table)
if args.json:
    args.json.write_text(json.dumps({"tokens": len(ids), "rows": rows}, indent=2) + "\n")
