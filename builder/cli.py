"""`build-engine --config FILE [--output DIR]`: checkpoint + YAML -> engine/ and triton_repo/."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kiln import constants as names
from kiln.builder.progress import StepLog, console, progress_bar
from kiln.errors import ConfigError, KilnError

STEPS = 7  # validate, load, compile plugins, pack, choose tactics, write engine, write repository


def check_model_limits(config, spec) -> None:
    build = config.build
    if build.max_seq_len > spec.max_position_embeddings:
        raise ConfigError(
            f"build.max_seq_len: {build.max_seq_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}; allowed: <= {spec.max_position_embeddings}"
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


def _chat_template_note(tokenizer_dir: Path) -> str:
    """What the OpenAI chat endpoint will have: the checkpoint's chat template, checked to compile."""
    from kiln.triton_repo.chat_template import ChatTemplate, ChatTemplateError

    try:
        template = ChatTemplate.from_tokenizer_dir(tokenizer_dir)
    except ChatTemplateError as exc:
        return f"[yellow]warning:[/yellow] {exc}; /v1/chat/completions will refuse requests"
    if template is None:
        return "no chat template in the checkpoint (/v1/chat/completions will refuse requests)"
    return "chat template kept (for /v1/chat/completions)"


def choose_tactics(config, spec, weights: dict, dtype, quant_meta: dict | None, library: Path) -> dict:
    """engine.json's tactics: the engine's linears, as the runtime loads them, timed here."""
    from kiln.builder import tactics
    from kiln.runtime.model import LlamaModel

    model = LlamaModel(spec, weights, config.build.max_seq_len, quant_meta)
    keys = {linear.tactic_key() for linear in model.linears() if len(linear.candidates()) > 1}
    with progress_bar("linear shapes", len(keys)) as advance:
        chosen = tactics.choose(model, config.build.tactics, config.build.max_num_tokens,
                                config.build.max_batch_size, library, advance)
    for key, entry in chosen["linears"].items():
        console.print(f"      {key}: {describe_routes(entry['buckets'], entry['choices'])}")
    prefetch = chosen[names.TACTIC_PREFETCH]
    steps = ", ".join(f"{us / 1000:.2f} ms at {nbytes} bytes" for nbytes, us in prefetch["step_us"].items())
    console.print(f"      weight prefetch: {prefetch['bytes']} bytes ahead (one-token decode steps: {steps})")
    return chosen


def describe_routes(buckets: list[int], choices: list[str]) -> str:
    """"kiln up to 32 rows, torch above": each run of buckets with one choice."""
    runs = []
    for rows, choice in zip(buckets, choices):
        if runs and runs[-1][1] == choice:
            runs[-1][0] = rows
        else:
            runs.append([rows, choice])
    if len(runs) == 1:
        return f"{runs[0][1]} at every row count"
    return ", ".join(f"{choice} up to {rows} rows" for rows, choice in runs[:-1]) + f", {runs[-1][1]} above"


def build(config_path: Path, output: Path | None) -> tuple[Path, Path]:
    from kiln.builder.checkpoint import load_checkpoint
    from kiln.builder.compile import pack_weights
    from kiln.builder.config import load_config, resolve_checkpoint
    from kiln.builder.engine_writer import write_engine
    from kiln.builder.quantization import quantize, steps
    from kiln.builder.triton_writer import write_triton_repo
    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins
    import torch

    from kiln.runtime.engine import DTYPES

    config = load_config(config_path)
    q = config.quantization
    quantizing = q.algo != "none" or q.kv_cache != "none"
    step = StepLog(STEPS + steps(config))
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
        isa = ops.active_isa()  # the host's best, or the level KILN_ISA names
        console.print(f"      {library} (kernels: {isa})")
    dtype = DTYPES[config.model.dtype]
    with step(f"Pack weights ({'float32 for quantization' if quantizing else config.model.dtype}, "
              "QKV and gate/up fused)"):
        with progress_bar("layers", spec.num_layers) as advance:
            weights = pack_weights(checkpoint, torch.float32 if quantizing else dtype, advance)
    quant_meta = checkpoint.quantization  # an already quantized checkpoint, or None
    if quantizing:
        weights, quant_meta = quantize(config, spec, checkpoint.tokenizer_files, weights, dtype, step)
    tactics = None
    with step(f"Choose tactics ({config.build.tactics})"):
        if config.build.tactics != "none":
            tactics = choose_tactics(config, spec, weights, dtype, quant_meta, library)
    staging = []
    try:
        with step(f"Write engine {engine_dir}"):
            engine_dir.parent.mkdir(parents=True, exist_ok=True)
            staging.append(Path(tempfile.mkdtemp(prefix=".kiln-staging-", dir=engine_dir.parent)))
            write_engine(staging[-1] / "engine", config, spec, weights, checkpoint.tokenizer_files,
                         library, isa, quant_meta, tactics)
            console.print(f"      {_chat_template_note(staging[-1] / 'engine' / names.TOKENIZER_DIR)}")
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
