"""Bad build configs: exit code 2, an error naming the key, the value and what is allowed,
and nothing written."""
import pytest
import yaml

from kiln.builder.cli import main
from kiln.builder.config import parse_config
from kiln.errors import ConfigError


def run(tmp_path, config, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    out = tmp_path / "out"
    code = main(["--config", str(path), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert not out.exists() or not any(out.iterdir()), "a failed build left files behind"
    return " ".join(err.split())  # rich wraps long lines


def base(checkpoint):
    return {"model": {"checkpoint": str(checkpoint)}}


def test_unknown_key(tmp_path, capsys, tiny_models):
    config = base(tiny_models["llama"]) | {"build": {"max_batch_sise": 8}}
    err = run(tmp_path, config, capsys)
    assert "build.max_batch_sise" in err and "unknown key" in err


def test_unknown_section(tmp_path, capsys, tiny_models):
    err = run(tmp_path, base(tiny_models["llama"]) | {"serving": {}}, capsys)
    assert "serving" in err and "unknown key" in err


def test_wrong_type(tmp_path, capsys, tiny_models):
    err = run(tmp_path, base(tiny_models["llama"]) | {"build": {"max_input_len": "long"}}, capsys)
    assert "build.max_input_len" in err and "'long'" in err and "integer" in err


def test_bad_choice(tmp_path, capsys, tiny_models):
    config = {"model": {"checkpoint": str(tiny_models["llama"]), "dtype": "float13"}}
    err = run(tmp_path, config, capsys)
    assert "model.dtype" in err and "'float13'" in err and "'float32'" in err and "'bfloat16'" in err


def test_max_seq_len_below_max_input_len(tmp_path, capsys, tiny_models):
    config = base(tiny_models["llama"]) | {"build": {"max_input_len": 512, "max_seq_len": 256}}
    err = run(tmp_path, config, capsys)
    assert "max_seq_len (256)" in err and "max_input_len (512)" in err


def test_out_of_range_value(tmp_path, capsys, tiny_models):
    err = run(tmp_path, base(tiny_models["llama"]) | {"build": {"max_batch_size": 0}}, capsys)
    assert "build.max_batch_size" in err and "greater than or equal to 1" in err and "(got 0)" in err


def test_missing_checkpoint(tmp_path, capsys):
    err = run(tmp_path, base(tmp_path / "nowhere"), capsys)
    assert "model.checkpoint" in err and "does not exist" in err and "nowhere" in err


def test_missing_model_section(tmp_path, capsys):
    err = run(tmp_path, {"build": {}}, capsys)
    assert "model" in err and "Field required" in err


def test_seq_len_over_model_limit(tmp_path, capsys, tiny_models):
    config = base(tiny_models["llama"]) | {"build": {"max_input_len": 512, "max_seq_len": 4096}}
    err = run(tmp_path, config, capsys)
    assert "build.max_seq_len: 4096 exceeds the model's max_position_embeddings 512" in err


def test_not_yaml(tmp_path, capsys):
    err = run(tmp_path, "model: [unclosed", capsys)
    assert "not valid YAML" in err


def test_python_tags_are_refused_and_not_run(tmp_path, capsys):
    """A YAML tag that would construct a Python object (and run code) is an error, not a call."""
    witness = tmp_path / "ran"
    config = f"model:\n  checkpoint: !!python/object/apply:os.system ['touch {witness}']\n"
    err = run(tmp_path, config, capsys)
    assert "not valid YAML" in err and "python/object/apply" in err
    assert not witness.exists()


def test_generated_models_run_no_dynamic_code(tmp_path, tiny_engines):
    """The repository's Python models (what tritonserver runs) call no eval / exec / compile and
    import no pickle / marshal (an InferenceRequest's .exec() method is Triton's BLS call)."""
    import ast
    from pathlib import Path

    import kiln.triton_repo

    repo = tiny_engines("llama").parent / "triton_repo"
    sources = list(repo.rglob("*.py")) + list(Path(kiln.triton_repo.__file__).parent.glob("*.py"))
    assert len(sources) > 5
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("eval", "exec", "compile", "__import__"):
                found.append(f"{path}:{node.lineno} {node.func.id}()")
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path}:{node.lineno} import {m}" for m in modules if m.split(".")[0] in ("pickle", "marshal", "dill")]
    assert not found, found


def test_bad_kv_cache_memory():
    with pytest.raises(ConfigError, match="runtime.kv_cache_memory"):
        parse_config({"model": {"checkpoint": "x"}, "runtime": {"kv_cache_memory": "lots"}})


def test_defaults_resolve():
    config = parse_config({"model": {"checkpoint": "x"}, "runtime": {"kv_cache_memory": "512MiB"}})
    from kiln.runtime.options import RuntimeOptions

    options = RuntimeOptions.from_engine(config.runtime.model_dump())
    assert config.build.kv_block_size == 32 and options.kv_cache_bytes() == 512 * 2**20


def test_prefill_budget_options_reach_the_scheduler_and_bad_ones_are_refused():
    from kiln.runtime.options import RuntimeOptions

    config = parse_config({"model": {"checkpoint": "x"},
                           "runtime": {"prefill_per_decode": 1.5, "prefill_max_wait": 4}})
    assert config.runtime.prefill_per_decode_from == 8  # the default
    options = RuntimeOptions.from_engine(config.runtime.model_dump(), prefill_max_wait=2.5, prefill_per_decode_from=12)
    assert (options.prefill_per_decode, options.prefill_max_wait, options.prefill_per_decode_from) == (1.5, 2.5, 12)
    for key, bad in (("prefill_per_decode", -1), ("prefill_per_decode", float("inf")), ("prefill_max_wait", -0.5),
                     ("prefill_per_decode_from", 0), ("prefill_per_decode_from", 2.5)):
        with pytest.raises(ConfigError, match=f"runtime.{key}"):
            parse_config({"model": {"checkpoint": "x"}, "runtime": {key: bad}})
        with pytest.raises(ValueError, match=key):
            RuntimeOptions(**{key: bad})


def test_stream_interval_is_a_run_time_option_and_bad_ones_are_refused():
    from kiln.runtime.options import RuntimeOptions

    config = parse_config({"model": {"checkpoint": "x"}, "runtime": {"stream_interval": 4}})
    assert RuntimeOptions.from_engine(config.runtime.model_dump()).stream_interval == 4
    assert RuntimeOptions.from_engine(config.runtime.model_dump(), stream_interval=2).stream_interval == 2
    assert parse_config({"model": {"checkpoint": "x"}}).runtime.stream_interval == 1  # the default
    for bad in (0, -3, 2.5, "4", True):
        with pytest.raises(ConfigError, match="runtime.stream_interval"):
            parse_config({"model": {"checkpoint": "x"}, "runtime": {"stream_interval": bad}})


def test_group_size_is_auto_or_a_multiple_of_32_and_bad_ones_are_refused():
    """Groups of any multiple of 32 up to 1,024 (SmolLM2's 576 inputs: 192, three groups a row);
    anything else is refused naming the key and what it takes."""
    def config(group):
        return {"model": {"checkpoint": "x"}, "quantization": {"algo": "w4a8_awq", "group_size": group}}

    for good in ("auto", 32, 96, 192, 1024):
        assert parse_config(config(good)).quantization.group_size == good
    for bad in (0, 16, 100, 2048, -64, True, "192", 64.0):
        with pytest.raises(ConfigError, match="quantization.group_size: expected auto or a multiple of 32") as e:
            parse_config(config(bad))
        assert f"(got {bad!r})" in str(e.value)


@pytest.mark.parametrize("path", sorted((__import__("pathlib").Path(__file__).parents[2] / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    from kiln.builder.config import load_config, resolve_checkpoint

    config = load_config(path)
    assert resolve_checkpoint(config.model.checkpoint, path.parent).exists()
