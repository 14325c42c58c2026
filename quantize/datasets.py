"""Text for calibration and for the accuracy report.

`builtin` is English prose shipped with Python (pydoc_data.topics: the documentation's
topics, sorted by name): calibration uses all but the last 12 topics, the accuracy report
(and docs/benchmarks.md) the last 12, so calibration text never overlaps evaluation text.
Files: .txt (the whole file) or .jsonl (a `text` field per line)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from kiln.errors import ConfigError

HELD_OUT_TOPICS = 12


def builtin_texts() -> tuple[str, str]:
    """(calibration text, held-out evaluation text)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return ("\n\n".join(topics[k] for k in keys[:-HELD_OUT_TOPICS]),
            "\n\n".join(topics[k] for k in keys[-HELD_OUT_TOPICS:]))


def read_text(spec: str, base: Path | None = None) -> list[str]:
    """The documents of a dataset spec: builtin (calibration part), a .txt or a .jsonl file."""
    if spec == "builtin":
        return [builtin_texts()[0]]
    path = Path(spec) if base is None or Path(spec).is_absolute() else base / spec
    if not path.is_file():
        raise ConfigError(f"quantization dataset {spec!r}: no such file ({path})")
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError(f"{path}:{number}: each line needs a string `text` field")
        documents.append(record["text"])
    if not documents:
        raise ConfigError(f"{path}: no documents")
    return documents


def calibration_sequences(tokenizer, spec: str, samples: int, seq_len: int, seed: int = 0,
                          base: Path | None = None) -> list[list[int]]:
    """`samples` windows of `seq_len` tokens at random places in the dataset (fewer if it is short)."""
    ids: list[int] = []
    for document in read_text(spec, base):
        ids += tokenizer.encode(document).ids
    if len(ids) < seq_len:
        raise ConfigError(f"quantization dataset {spec!r} has {len(ids)} tokens, fewer than one "
                          f"calibration sequence (seq_len {seq_len})")
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(len(ids) - seq_len + 1), min(samples, len(ids) - seq_len + 1)))
    return [ids[s : s + seq_len] for s in starts]


def evaluation_ids(tokenizer, spec: str, tokens: int, base: Path | None = None) -> list[int]:
    """The first `tokens` tokens of the accuracy text (builtin: the held-out topics)."""
    text = builtin_texts()[1] if spec == "builtin" else "\n\n".join(read_text(spec, base))
    return tokenizer.encode(text).ids[:tokens]
