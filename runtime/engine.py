"""Loading an engine directory: version check, checksums, plugins, weights, tokenizer."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kiln import constants as names
from kiln.errors import EngineError
from kiln.plugins import ops
from kiln.plugins.host import cpu_model
from kiln.runtime.linear import tactics_from_json
from kiln.runtime.model import LlamaModel
from kiln.runtime.spec import ModelSpec
from kiln.runtime.weight_arena import apart, place_weights, return_freed_memory

log = logging.getLogger("kiln.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HUGEPAGE_MIN_BYTES = 1 << 20  # without the weight arena: smaller tensors stay where safetensors put them


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    kv_block_size: int


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _engine_file_json(engine_dir: Path, name: str, missing: str):
    """An engine file's JSON; EngineError saying `missing` or that it is damaged."""
    path = engine_dir / name
    if not path.is_file():
        raise EngineError(missing)
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise EngineError(f"{path} is not valid JSON ({exc}); rebuild the engine") from None


def read_engine_json(engine_dir: Path) -> dict:
    meta = _engine_file_json(engine_dir, names.ENGINE_JSON,
                             f"{engine_dir} is not a kiln engine: {names.ENGINE_JSON} is missing")
    version = meta.get("format_version")
    if version != names.ENGINE_FORMAT_VERSION:
        raise EngineError(
            f"{engine_dir} has engine format version {version!r}, but this kiln reads version "
            f"{names.ENGINE_FORMAT_VERSION}: rebuild it with this kiln "
            f"(build-engine --config {engine_dir / names.RESOLVED_CONFIG_FILE})"
        )
    return meta


def verify_manifest(engine_dir: Path) -> None:
    manifest = _engine_file_json(engine_dir, names.MANIFEST_FILE,
                                 f"{engine_dir}: {names.MANIFEST_FILE} is missing; rebuild the engine")
    try:
        files = dict(manifest["files"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{engine_dir / names.MANIFEST_FILE} is not a valid manifest ({exc}); "
                          f"rebuild the engine") from None
    root = engine_dir.resolve()
    for rel, expected in files.items():
        file = (engine_dir / rel).resolve()
        if not file.is_relative_to(root):  # a manifest names files of the engine, nothing else
            raise EngineError(f"{engine_dir}: {names.MANIFEST_FILE} names {rel!r}, outside the engine folder; "
                              f"the engine was tampered with: rebuild it")
        if not file.is_file():
            raise EngineError(f"{engine_dir}: {rel} is missing; rebuild the engine")
        if sha256_file(file) != expected:
            raise EngineError(
                f"{engine_dir}: {rel} does not match its checksum in {names.MANIFEST_FILE} "
                f"(truncated or changed after the build); rebuild the engine"
            )


class Engine:
    """An engine directory loaded for serving: model, tokenizer, limits."""

    def __init__(self, engine_dir: str | Path, weight_arena: bool = True):
        """weight_arena False: each large weight in 2 MB pages of its own instead of one arena
        (runtime/weight_arena.py), for benchmarks to compare the two."""
        self.dir = Path(engine_dir).resolve()
        self.meta = read_engine_json(self.dir)
        verify_manifest(self.dir)
        try:
            ops.load_library(self.dir / self.meta["plugins"]["file"])
        except RuntimeError as exc:
            raise EngineError(f"{self.dir}: {exc}; rebuild the engine") from None
        self.isa = ops.active_isa()  # int4 / int8 weights are laid out for it below (runtime/linear.py)
        log.info("%s: kernels for %s (built on a %s host)", self.dir, self.isa, self.meta["target"]["isa"])
        self.spec = ModelSpec.from_json(self.meta["model"])
        self.limits = Limits(**self.meta["limits"])
        self.dtype = DTYPES[self.meta["dtype"]]
        try:
            weights = load_file(self.dir / names.WEIGHTS_FILE)
        except (SafetensorError, OSError) as exc:
            raise EngineError(f"{self.dir}: cannot read weights ({exc}); rebuild the engine") from exc
        if weight_arena:  # small tensors copied out of the file's mapping (the arena takes the large
            # ones), so it is unmapped after loading instead of the file's pages counting as this process's
            weights = {name: t if t.nbytes >= HUGEPAGE_MIN_BYTES else t.clone() for name, t in weights.items()}
        else:  # every large tensor in 2 MB pages of its own (ops.to_hugepages)
            weights = {name: ops.to_hugepages(t) if t.nbytes >= HUGEPAGE_MIN_BYTES else t
                       for name, t in weights.items()}
        self.model = LlamaModel(self.spec, weights, self.limits.max_seq_len, self.meta.get("quantization"))
        del weights
        self.tactics = self.apply_tactics()
        if weight_arena:  # decode streams the weights each step: one block of 2 MB pages, in step order
            arena = place_weights(self.model)
            log.info("%s: %.1f MB of weights in one arena of 2 MB pages", self.dir, arena / 1e6)
        else:
            apart(self.model)
        return_freed_memory()
        self.tokenizer = Tokenizer.from_file(
            str(self.dir / names.TOKENIZER_DIR / names.TOKENIZER_JSON)
        )

    def apply_tactics(self) -> str:
        """The build's tactics (engine.json), where this host runs the kernels they were timed on;
        says which routes the linears take."""
        tactics = self.meta.get(names.TACTICS)
        if not tactics:
            return "defaults (the engine has no tactics)"
        if tactics["isa"] != self.isa:
            log.warning("%s: tactics were timed on %s kernels (%s); this host runs %s kernels, so each linear "
                        "takes its kind's default route (rebuild the engine here to time them)", self.dir,
                        tactics["isa"], tactics["cpu"], self.isa)
            return f"defaults (tactics timed on {tactics['isa']} kernels, this host runs {self.isa})"
        try:
            taken = self.model.apply_tactics(tactics_from_json(tactics)) if tactics["linears"] else 0
            prefetch = self.apply_prefetch(tactics.get(names.TACTIC_PREFETCH))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.dir}: engine.json's tactics are malformed ({exc}); rebuild the engine") from None
        host = cpu_model()
        if tactics["cpu"] != host:
            log.info("%s: tactics timed on %s, this host is %s (the same kernels)", self.dir, tactics["cpu"], host)
        return f"tactics of {tactics['cpu']} ({tactics['mode']}) for {taken} linears{prefetch}"

    @staticmethod
    def apply_prefetch(tactic: dict | None) -> str:
        """The GEMVs' software prefetch distance the build chose (engines built before it have
        none), unless KILN_PREFETCH_BYTES sets it; what was done, for apply_tactics' line. The
        distance is the plugin library's, for every engine of the process: the last one loaded
        sets it."""
        if tactic is None:
            return ""
        nbytes = tactic["bytes"]
        if type(nbytes) is not int:
            raise TypeError(f"prefetch bytes {nbytes!r} is not an integer")
        if os.environ.get(names.PREFETCH_BYTES_ENV) is not None:
            return f"; weight prefetch as {names.PREFETCH_BYTES_ENV} sets it (the build chose {nbytes} bytes)"
        try:
            ops.set_prefetch(nbytes)
        except RuntimeError as exc:  # out of the library's range
            raise ValueError(str(exc).splitlines()[0]) from None
        return f"; weight prefetch {nbytes} bytes ahead"
