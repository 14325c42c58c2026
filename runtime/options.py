"""Run-time options: defaults come from the engine (its build config's `runtime:` section);
LLM(...) and the Triton model may override them."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_bytes(text: str) -> int:
    match = _BYTES.match(text)
    if not match:
        raise ValueError(f"expected a size like '2GiB' or '512MiB', got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit])


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def _at_least_one(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({what}), got {value!r}")


@dataclass(frozen=True)
class RuntimeOptions:
    kv_cache_memory: str | float = "2GiB"  # bytes, or a fraction of the memory available once the weights are loaded
    kv_cache_reserve: bool = True  # write every page of the pool at load: resident from the start
    scheduler: str = "max_utilization"
    enable_prefix_reuse: bool = True
    max_queue_size: int = 256
    request_timeout: float = 0.0  # seconds from arrival after which a request ends ("timeout"); 0: never
    max_prefill_share: float = 0.25  # of max_num_tokens, for prefill chunks in a step that also decodes
    prefill_per_decode: float = 0.0  # prefill tokens a step may take per decoding stream (0: only the share)
    prefill_max_wait: float = 4.0  # seconds a prompt waits under prefill_per_decode before the share applies
    prefill_per_decode_from: int = 8  # decoding streams from which prefill_per_decode applies (below: the share)
    batch_invariant: bool = True  # every linear one route at every row count (LlamaModel.make_batch_invariant)
    stream_interval: int = 1  # generated tokens a response carries (the first token alone, at once; the last with the end)
    # run-time only (a deployment's path, not in the build config): a file each engine step
    # appends a JSON line to (constants.STEP_LOG_FIELDS); empty: none
    step_log: str = ""

    def __post_init__(self):
        if not (self.request_timeout >= 0 and self.request_timeout != float("inf")):
            raise ValueError(f"request_timeout must be a finite number of seconds >= 0 (0: none), "
                             f"got {self.request_timeout}")
        if not 0 < self.max_prefill_share <= 1:
            raise ValueError(f"max_prefill_share must be in (0, 1], got {self.max_prefill_share}")
        if not (self.prefill_per_decode >= 0 and self.prefill_per_decode != float("inf")):
            raise ValueError(f"prefill_per_decode must be a finite number >= 0 (0: off), got {self.prefill_per_decode}")
        if not (self.prefill_max_wait >= 0 and self.prefill_max_wait != float("inf")):
            raise ValueError(f"prefill_max_wait must be a finite number of seconds >= 0, got {self.prefill_max_wait}")
        _at_least_one("prefill_per_decode_from", self.prefill_per_decode_from, "decoding streams")
        _at_least_one("stream_interval", self.stream_interval, "tokens a response")
        if not isinstance(self.step_log, str):
            raise ValueError(f"step_log must be a file path (a string; empty: none), got {self.step_log!r}")

    def kv_cache_bytes(self) -> int:
        if isinstance(self.kv_cache_memory, str):
            return parse_bytes(self.kv_cache_memory)
        if not 0 < self.kv_cache_memory <= 1:
            raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {self.kv_cache_memory}")
        return int(self.kv_cache_memory * available_memory())

    @classmethod
    def from_engine(cls, section: dict, **overrides) -> "RuntimeOptions":
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown runtime options {sorted(unknown)}; known: {sorted(known)}")
        values = {k: v for k, v in section.items() if k in known}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
