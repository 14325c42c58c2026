"""The engine loader refuses engines it cannot trust, with errors that say to rebuild."""
import json
import shutil

import pytest

from kiln import constants as names
from kiln.errors import EngineError
from kiln.runtime.engine import Engine


@pytest.fixture
def engine_copy(tiny_engines, tmp_path):
    target = tmp_path / "engine"
    shutil.copytree(tiny_engines("llama"), target)
    return target


def test_engine_loads(engine_copy, caplog):
    from kiln.plugins import ops

    with caplog.at_level("INFO", logger="kiln.engine"):
        engine = Engine(engine_copy)
    assert engine.spec.architecture == "llama"
    assert engine.limits.max_seq_len == 512
    # the loader says which kernels run and what the build host had (engine.json target.isa)
    built_on = json.loads((engine_copy / names.ENGINE_JSON).read_text())["target"]["isa"]
    assert engine.isa == ops.active_isa()
    assert f"kernels for {engine.isa} (built on a {built_on} host)" in caplog.text


def test_truncated_weights_are_refused(engine_copy):
    weights = engine_copy / names.WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match="weights.safetensors does not match its checksum.*rebuild"):
        Engine(engine_copy)


def test_other_format_version_is_refused(engine_copy):
    path = engine_copy / names.ENGINE_JSON
    meta = json.loads(path.read_text())
    meta["format_version"] = names.ENGINE_FORMAT_VERSION + 1
    path.write_text(json.dumps(meta))
    newer, ours = names.ENGINE_FORMAT_VERSION + 1, names.ENGINE_FORMAT_VERSION
    with pytest.raises(EngineError, match=rf"engine format version {newer}, but this kiln reads version {ours}: rebuild"):
        Engine(engine_copy)


def test_missing_file_is_refused(engine_copy):
    (engine_copy / names.TOKENIZER_DIR / names.TOKENIZER_JSON).unlink()
    with pytest.raises(EngineError, match="tokenizer.json is missing"):
        Engine(engine_copy)


def test_not_an_engine(tmp_path):
    with pytest.raises(EngineError, match="not a kiln engine"):
        Engine(tmp_path)


def test_manifest_covers_every_file(engine_copy):
    manifest = json.loads((engine_copy / names.MANIFEST_FILE).read_text())["files"]
    files = {str(p.relative_to(engine_copy)) for p in engine_copy.rglob("*") if p.is_file()}
    assert set(manifest) == files - {names.MANIFEST_FILE}
    assert any(f.startswith(names.PLUGINS_DIR + "/") for f in manifest)


@pytest.mark.parametrize("entry", ["../../../../etc/hostname", "/etc/hostname", "tokenizer/../../outside.txt"])
def test_manifest_entries_outside_the_engine_are_refused(engine_copy, entry):
    """A tampered manifest must not make the loader read (hash) files elsewhere."""
    path = engine_copy / names.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"][entry] = "0" * 64
    path.write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="outside the engine folder"):
        Engine(engine_copy)


def test_a_manifest_that_is_not_one_is_refused(engine_copy):
    (engine_copy / names.MANIFEST_FILE).write_text('{"files": 3}')
    with pytest.raises(EngineError, match="not a valid manifest"):
        Engine(engine_copy)
