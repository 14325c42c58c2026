"""Write an engine directory: engine.json, weights.safetensors, tokenizer/, plugins/, MANIFEST."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

import kiln
from kiln import constants as names
from kiln.builder.config import BuildConfig
from kiln.runtime.engine import sha256_file
from kiln.runtime.spec import ModelSpec


def write_engine(
    engine_dir: Path,
    config: BuildConfig,
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    tokenizer_files: dict[str, str],
    plugin_library: Path,
    target_isa: str,
    quantization: dict | None = None,
    tactics: dict | None = None,
) -> None:
    """tactics: builder/tactics.py's choices (None: build.tactics none)."""
    engine_dir.mkdir(parents=True)
    save_file(weights, engine_dir / names.WEIGHTS_FILE, metadata={"format": "pt"})
    (engine_dir / names.TOKENIZER_DIR).mkdir()
    for name, text in tokenizer_files.items():
        (engine_dir / names.TOKENIZER_DIR / name).write_text(text)
    (engine_dir / names.PLUGINS_DIR).mkdir()
    plugin_file = Path(names.PLUGINS_DIR) / plugin_library.name
    shutil.copy2(plugin_library, engine_dir / plugin_file)
    resolved = config.model_dump(mode="json")
    (engine_dir / names.RESOLVED_CONFIG_FILE).write_text(yaml.safe_dump(resolved, sort_keys=False))
    build = config.build
    meta = {
        "format_version": names.ENGINE_FORMAT_VERSION,
        "kiln_version": kiln.__version__,
        "torch_version": torch.__version__,
        "model": spec.to_json(),
        "dtype": config.model.dtype,
        "limits": {
            "max_batch_size": build.max_batch_size,
            "max_input_len": build.max_input_len,
            "max_seq_len": build.max_seq_len,
            "max_num_tokens": build.max_num_tokens,
            "kv_block_size": build.kv_block_size,
        },
        "quantization": quantization or {"algo": config.quantization.algo, "kv_cache": config.quantization.kv_cache},
        "target": {"device": "cpu", "isa": target_isa},
        names.TACTICS: tactics,
        "plugins": {"file": str(plugin_file), "sha256": sha256_file(engine_dir / plugin_file)},
        "runtime": resolved["runtime"],
        "build_config": resolved,
    }
    (engine_dir / names.ENGINE_JSON).write_text(json.dumps(meta, indent=2))
    files = sorted(p for p in engine_dir.rglob("*") if p.is_file())
    manifest = {"files": {str(p.relative_to(engine_dir)): sha256_file(p) for p in files}}
    (engine_dir / names.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
