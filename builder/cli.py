"""`build-engine --config FILE [--output DIR]`: checkpoint + YAML -> engine/ and triton_repo/."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from kiln import constants as names
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kiln.errors import ConfigError, KilnError

console = Console(stderr=True, highlight=False)

STEPS = 6  # validate, load, compile plugins, pack, write engine, write repository
QUANT_STEPS = 3  # calibrate, quantize, measure accuracy (calibrate only when the algorithm needs it)


class GateFailed(KilnError):
    """The quantized engine lost more accuracy than quantization.accuracy_gate allows."""


class StepLog:
    def __init__(self, total: int):
        self.index = 0
        self.total = total

    @contextmanager
    def __call__(self, title: str):
        self.index += 1
        console.print(f"[bold][{self.index}/{self.total}][/bold] {title} ...")
        start = time.perf_counter()
        yield
        console.print(f"      done in {time.perf_counter() - start:.1f}s")


def check_model_limits(config, spec) -> None:
    build = config.build
    if build.max_seq_len > spec.max_position_embeddings:
        raise ConfigError(
            f"build.max_seq_len: {build.max_seq_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}; allowed: <= {spec.max_position_embeddings}"
        )
    if spec.sliding_window and build.max_seq_len > spec.sliding_window:
        raise ConfigError(
            f"build.max_seq_len: {build.max_seq_len} exceeds the model's sliding_window "
            f"{spec.sliding_window}, which kiln does not implement; allowed: <= {spec.sliding_window}"
        )


def _replace(staged: Path, final: Path) -> None:
    """Put a finished folder in place; an older one there is removed only after the swap."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{int(time.time() * 1000)}")
        final.rename(old)
    staged.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def progress_bar(what: str, total: int):
    with Progress(TextColumn(f"      {what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


def quantize(config, spec, tokenizer_files: dict[str, str], weights, dtype, step) -> tuple[dict, dict]:
    """Calibrate (when the algorithm needs it), quantize, measure the accuracy it cost and check
    the gate. Returns the engine's tensors and engine.json's `quantization` entry."""
    from tokenizers import Tokenizer

    from kiln.quantize.algorithms import QuantOptions, pick_group_size, quantization_meta, quantize_weights
    from kiln.quantize.calibrate import Grams, calibrate, gram_chunks
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
    stats = None
    chunks = gram_chunks(reference) if options.gptq else [range(0)]  # layers whose x^T x are held together
    if options.needs_calibration:
        c = q.calibration
        with step(f"Calibrate on {c.samples} x {c.seq_len} tokens of {c.dataset}"):
            sequences = calibration_sequences(tokenizer, c.dataset, c.samples, c.seq_len, base=Path.cwd())
            with progress_bar("sequences", len(sequences)) as advance:
                stats = calibrate(reference, sequences, progress=advance, gram_layers=chunks[0])
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
    return quantized, meta


def build(config_path: Path, output: Path | None) -> tuple[Path, Path]:
    from kiln.builder.checkpoint import load_checkpoint
    from kiln.builder.compile import pack_weights
    from kiln.builder.config import load_config, resolve_checkpoint
    from kiln.builder.engine_writer import write_engine
    from kiln.builder.triton_writer import write_triton_repo
    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins
    import torch

    from kiln.quantize.algorithms import NEEDS_CALIBRATION
    from kiln.runtime.engine import DTYPES

    config = load_config(config_path)
    q = config.quantization
    quantizing = q.algo != "none" or q.kv_cache != "none"
    calibrating = q.algo in NEEDS_CALIBRATION or q.kv_cache != "none"
    step = StepLog(STEPS + (QUANT_STEPS - (not calibrating) if quantizing else 0))
    with step(f"Validate config {config_path}"):
        checkpoint_path = resolve_checkpoint(config.model.checkpoint, Path.cwd())
        out = output or Path("kiln-out")
        engine_dir = Path(config.engine_output or out / "engine").absolute()
        repo_dir = Path(config.triton.output or out / "triton_repo").absolute()
    with step(f"Load checkpoint {checkpoint_path}"):
        checkpoint = load_checkpoint(checkpoint_path, config.model.format)
        spec = checkpoint.spec
        check_model_limits(config, spec)
        if checkpoint.quantization is not None and quantizing:
            raise ConfigError(f"checkpoint {checkpoint_path} is already quantized "
                              f"({checkpoint.quantization['source']}); build it as it is with "
                              f"quantization.algo: none and kv_cache: none")
        console.print(
            f"      {spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_heads} heads / {spec.num_kv_heads} kv heads, vocab {spec.vocab_size}"
        )
    with step("Compile plugins (cached by content hash)"):
        library = build_plugins()
        ops.load_library(library)
        isa = ops.select_isa("auto")
        console.print(f"      {library} (kernels for this host: {isa})")
    dtype = DTYPES[config.model.dtype]
    with step(f"Pack weights ({'float32 for quantization' if quantizing else config.model.dtype}, "
              "QKV and gate/up fused)"):
        with progress_bar("layers", spec.num_layers) as advance:
            weights = pack_weights(checkpoint, torch.float32 if quantizing else dtype, advance)
    quant_meta = checkpoint.quantization  # an already quantized checkpoint, or None
    if quantizing:
        weights, quant_meta = quantize(config, spec, checkpoint.tokenizer_files, weights, dtype, step)
    staging = []
    try:
        with step(f"Write engine {engine_dir}"):
            engine_dir.parent.mkdir(parents=True, exist_ok=True)
            staging.append(Path(tempfile.mkdtemp(prefix=".kiln-staging-", dir=engine_dir.parent)))
            write_engine(staging[-1] / "engine", config, spec, weights, checkpoint.tokenizer_files,
                         library, isa, quant_meta)
        with step(f"Write Triton repository {repo_dir}"):
            repo_dir.parent.mkdir(parents=True, exist_ok=True)
            staging.append(Path(tempfile.mkdtemp(prefix=".kiln-staging-", dir=repo_dir.parent)))
            write_triton_repo(config, repo_dir, engine_dir, write_to=staging[-1] / "repo")
        _replace(staging[0] / "engine", engine_dir)
        _replace(staging[1] / "repo", repo_dir)
    finally:
        for folder in staging:
            shutil.rmtree(folder, ignore_errors=True)
    return engine_dir, repo_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build-engine", description="Build a kiln engine and its Triton model repository."
    )
    parser.add_argument("--config", required=True, type=Path, help="build config (YAML)")
    parser.add_argument(
        "--output", type=Path, default=None,
        help="folder for engine/ and triton_repo/ (default ./kiln-out; the YAML's "
        "engine_output and triton.output override)",
    )
    args = parser.parse_args(argv)
    try:
        engine_dir, repo_dir = build(args.config, args.output)
    except KilnError as exc:
        console.print(f"[bold red]error:[/bold red] {exc}")
        return 2
    console.print(f"[bold green]engine[/bold green] {engine_dir}")
    console.print(f"[bold green]triton repository[/bold green] {repo_dir}")
    console.print(f"serve it with: kiln serve {repo_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
