"""The quantization steps of a build: calibrate on text (when the algorithm needs it), quantize
the packed float32 weights, measure what that cost against the unquantized model and check
`quantization.accuracy_gate`."""
from __future__ import annotations

from pathlib import Path

from kiln import constants as names
from kiln.builder.progress import console, progress_bar
from kiln.errors import KilnError

STEPS = 3  # calibrate, quantize, measure accuracy (calibrate only when the algorithm needs it)


class GateFailed(KilnError):
    """The quantized engine lost more accuracy than quantization.accuracy_gate allows."""


def steps(config) -> int:
    """How many build steps quantization adds for this config."""
    from kiln.quantize.algorithms import NEEDS_CALIBRATION

    q = config.quantization
    if q.algo == "none" and q.kv_cache == "none":
        return 0
    calibrating = q.algo in NEEDS_CALIBRATION or q.kv_cache != "none"
    return STEPS - (not calibrating)


def quantize(config, spec, tokenizer_files: dict[str, str], weights, dtype, step) -> tuple[dict, dict]:
    """Calibrate (when the algorithm needs it), quantize, measure the accuracy it cost and check
    the gate. Returns the engine's tensors and engine.json's `quantization` entry."""
    from tokenizers import Tokenizer

    from kiln.quantize.algorithms import QuantOptions, pick_group_size, quantization_meta, quantize_weights
    from kiln.quantize.calibrate import EXPERTS, Grams, calibrate, gram_chunks
    from kiln.quantize.datasets import calibration_sequences, evaluation_ids
    from kiln.quantize.report import apply_gate, measure, report_table
    from kiln.runtime.model import LlamaModel

    q = config.quantization
    tokenizer = Tokenizer.from_str(tokenizer_files[names.TOKENIZER_JSON])
    max_positions = max(q.calibration.seq_len, q.accuracy.window, config.build.max_seq_len)
    reference = LlamaModel(spec, weights, max_positions)  # float32, unquantized
    options = QuantOptions(q.algo, q.kv_cache, pick_group_size(q.group_size, spec), q.smoothquant_alpha,
                           q.lm_head, q.fp8_weight_scales == "per_tensor", q.w4a8_activations, q.weight_rounding,
                           q.key_rotation)
    stats, routing = None, {}
    chunks = gram_chunks(reference) if options.gptq else [range(0)]  # layers whose x^T x are held together
    if options.needs_calibration:
        c = q.calibration
        with step(f"Calibrate on {c.samples} x {c.seq_len} tokens of {c.dataset}"):
            sequences = calibration_sequences(tokenizer, c.dataset, c.samples, c.seq_len, base=Path.cwd())
            with progress_bar("sequences", len(sequences)) as advance:
                stats = calibrate(reference, sequences, progress=advance, gram_layers=chunks[0])
            routing = {index: value for (index, key), value in stats.items() if key == EXPERTS}
            if routing:
                console.print(routing_summary(routing))
    detail = {"int8_sq": f", alpha {q.smoothquant_alpha}", "fp8": f", weights {q.fp8_weight_scales}",
              "int4_awq": f", group size {options.group_size}", "int4_wo": f", group size {options.group_size}",
              "w4a8_awq": f", group size {options.group_size}, {q.w4a8_activations} activations"}.get(q.algo, "")
    if options.gptq:
        detail += ", GPTQ rounding" + (f", x^T x for {len(chunks)} chunks of layers in turn" if len(chunks) > 1 else "")
    with step(f"Quantize ({q.label}{detail})"):
        with progress_bar("layers", spec.num_layers) as advance:
            grams = Grams(reference, sequences, stats) if options.gptq else None
            quantized = quantize_weights(weights, spec, options, dtype, stats, advance, grams)
    meta = quantization_meta(options)
    with step(f"Measure accuracy on {q.accuracy.tokens} tokens of {q.accuracy.text}"):
        ids = evaluation_ids(tokenizer, q.accuracy.text, q.accuracy.tokens, base=Path.cwd())
        model = LlamaModel(spec, quantized, max_positions, meta)
        with progress_bar("windows", -(-len(ids) // q.accuracy.window)) as advance:
            report = apply_gate(measure(reference, model, ids, q.accuracy.window, progress=advance), q.gate())
    console.print(report_table(report, q.label))
    if not report.passed:
        raise GateFailed("the quantized engine is over quantization.accuracy_gate: " + "; ".join(report.failures)
                         + " (no engine written; loosen the gate, change the algorithm, or calibrate on more text)")
    meta["accuracy"] = report.to_json()
    if stats is not None:
        meta["calibration"] = q.calibration.model_dump()
        if routing:  # tokens per expert, per layer, and the experts quantized from every token's statistics
            meta["calibration"]["experts"] = {str(index): r.to_json() for index, r in routing.items()}
    return quantized, meta


def routing_summary(routing: dict) -> str:
    """One line on how calibration routed a Mixture-of-Experts model's tokens, naming the
    experts it routed too few to (calibrate.MIN_EXPERT_TOKENS)."""
    from kiln.quantize.calibrate import MIN_EXPERT_TOKENS

    tokens = [t for r in routing.values() for t in r.tokens]
    line = f"Experts: {min(tokens)}-{max(tokens)} calibration tokens each over {len(routing)} layers"
    pooled = [f"layer {index} expert{'s' if len(r.pooled) > 1 else ''} "
              + ", ".join(f"{e} ({r.tokens[e]})" for e in r.pooled) for index, r in routing.items() if r.pooled]
    if not pooled:
        return line
    return (line + f"; quantized from every token's statistics (routed under {MIN_EXPERT_TOKENS} tokens): "
            + "; ".join(pooled))
