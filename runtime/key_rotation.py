"""Which key rotation an engine's KV cache uses (engine.json's quantization.key_rotation), as
paged attention's key_hadamard argument. The transform itself, and why it helps an FP8 cache,
are in plugins/formats.py. Measured on SmolLM2 (4,096 held-out tokens, float32 model, FP8
cache, per-channel scales as kiln calibrates them; benchmarks/ablations/kv_rotation.py): KL to
the unquantized model 0.0130 without the rotation, 0.0056 with it; the keys' error dominates
(0.0129 with K alone quantized, 0.0007 with V alone)."""
from __future__ import annotations

from kiln import constants as names
from kiln.plugins.formats import hadamard_block

KEY_ROTATIONS = (names.KEY_ROTATION_NONE, names.KEY_ROTATION_HADAMARD)


def key_hadamard(key_rotation: str, head_dim: int) -> int:
    """paged_attention's key_hadamard argument for engine.json's quantization.key_rotation."""
    if key_rotation not in KEY_ROTATIONS:
        raise KeyError(f"unknown key_rotation {key_rotation!r}; expected {', '.join(KEY_ROTATIONS)}")
    return hadamard_block(head_dim) if key_rotation == names.KEY_ROTATION_HADAMARD else 0
