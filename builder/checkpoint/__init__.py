"""Checkpoint readers: each turns a checkpoint into one ModelSpec and canonical tensors.

Only safetensors, GGUF and JSON are read; nothing is unpickled."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln import constants as names
from kiln.errors import CheckpointError
from kiln.runtime.spec import ModelSpec


@dataclass
class Checkpoint:
    spec: ModelSpec
    tensors: dict[str, torch.Tensor]  # canonical names (kiln.constants.CKPT_*), float32
    tokenizer_files: dict[str, str] = field(default_factory=dict)  # file name -> text
    # An already quantized checkpoint (TensorRT-LLM): its quantized linears and KV-cache scales as
    # engine tensors (kiln's formats, fused), and engine.json's `quantization` entry for them
    prequantized: dict[str, torch.Tensor] = field(default_factory=dict)
    quantization: dict | None = None

    def expected_names(self) -> list[str]:
        spec = self.spec
        expected = [names.CKPT_EMBED, names.CKPT_FINAL_NORM]
        if not spec.tie_embeddings:
            expected.append(names.CKPT_LM_HEAD)
        per_layer = (names.CKPT_LAYER_TENSORS + (names.CKPT_QKV_BIASES if spec.qkv_bias else ())
                     + (names.CKPT_HEAD_NORMS if spec.head_norms else ())
                     + (names.CKPT_OUTPUT_NORMS if spec.output_norms else ()))
        if spec.num_experts:  # the router and every expert instead of one MLP (or beside it: a shared expert)
            per_layer = (tuple(n for n in per_layer if n not in names.CKPT_DENSE_MLP or spec.shared_expert_intermediate_size)
                         + (names.CKPT_ROUTER,) + ((names.CKPT_SHARED_GATE,) if spec.shared_expert_gated else ())
                         + tuple(names.expert_tensor(e, n) for e in range(spec.num_experts) for n in names.CKPT_EXPERT))
        for i in range(spec.num_layers):
            expected += [names.layer_tensor(i, n) for n in per_layer
                         if names.layer_tensor(i, n) not in self.prequantized_parts()]
        return expected

    def prequantized_parts(self) -> set[str]:
        """Canonical weights that the prequantized tensors stand for."""
        parts = set()
        for fused, canonical in PACKED_PARTS.items():
            for key in self.prequantized:
                if key.endswith(names.linear_prefix(fused) + "." + names.QWEIGHT):
                    layer = key.removesuffix(names.linear_prefix(fused) + "." + names.QWEIGHT)
                    parts.update(layer + c for c in canonical)
        return parts

    def validate(self, source: Path) -> None:
        missing = [n for n in self.expected_names() if n not in self.tensors]
        if missing:
            raise CheckpointError(
                f"checkpoint {source} lacks {len(missing)} tensors the model needs, e.g. "
                f"{missing[:3]} (canonical names); is it complete?"
            )


# packed (fused) linear -> the canonical weights it is made of
PACKED_PARTS = {
    names.ATTN_QKV: ("attention.q.weight", "attention.k.weight", "attention.v.weight"),
    names.ATTN_OUT: ("attention.o.weight",),
    names.MLP_GATE_UP: ("mlp.gate.weight", "mlp.up.weight"),
    names.MLP_DOWN: ("mlp.down.weight",),
}


def one_for_fused(tensors: list[torch.Tensor], what: str, where: str) -> torch.Tensor:
    """The one `what` (scale) that linears kiln fuses into one (q/k/v, gate/up) must share."""
    for t in tensors[1:]:
        if not torch.allclose(t.float(), tensors[0].float(), rtol=1e-6, atol=0):
            raise CheckpointError(f"{where}: kiln fuses these linears into one, which needs one {what} for all "
                                  f"of them; this checkpoint has different ones")
    return tensors[0]


def refuse_unused(source: Path, spec: ModelSpec, unknown: list[str], canonical: dict[str, str]) -> None:
    """A clear error naming the checkpoint's tensors the model would not use (the first few):
    `unknown`, the names the reader has no mapping for, and of `canonical` (name in the file ->
    canonical name) the q / k / v biases, head norms or output norms of an architecture without
    them. Dropping them silently would build a model that is not the checkpoint's."""
    unused = unknown + [name for name, c in canonical.items()
                        if (c.endswith(names.CKPT_QKV_BIASES) and not spec.qkv_bias)
                        or (c.endswith(names.CKPT_HEAD_NORMS) and not spec.head_norms)
                        or (c.endswith(names.CKPT_OUTPUT_NORMS) and not spec.output_norms)]
    if unused:
        shown = ", ".join(unused[:4]) + (f", ... ({len(unused)} in all)" if len(unused) > 4 else "")
        raise CheckpointError(f"{source}: tensors kiln's {spec.architecture} model has no place for: {shown} (a "
                              "variant of the architecture kiln does not implement)")


def detect_format(path: Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    from kiln.builder.checkpoint.trtllm import is_trtllm_checkpoint

    if is_trtllm_checkpoint(path):
        return "trtllm"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    raise CheckpointError(
        f"cannot tell the format of checkpoint {path}: expected a .gguf file, a Hugging Face "
        f"folder with config.json or a TensorRT-LLM checkpoint (config.json + rank0.safetensors); "
        f"set model.format to hf, gguf or trtllm"
    )


def load_checkpoint(path: Path, fmt: str = "auto") -> Checkpoint:
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "hf":
        from kiln.builder.checkpoint.hf import load_hf

        checkpoint = load_hf(path)
    elif fmt == "gguf":
        from kiln.builder.checkpoint.gguf import load_gguf

        checkpoint = load_gguf(path)
    elif fmt == "trtllm":
        from kiln.builder.checkpoint.trtllm import load_trtllm

        checkpoint = load_trtllm(path)
    else:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}; expected hf, gguf or trtllm")
    checkpoint.validate(path)
    return checkpoint
