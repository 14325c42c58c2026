"""Write the Triton model repository from the templates in kiln/triton_repo/templates."""
from __future__ import annotations

import os
from pathlib import Path
from string import Template

from kiln import constants as names
from kiln import triton_repo
from kiln.builder.config import BuildConfig

TEMPLATES = Path(triton_repo.__file__).parent / "templates"

# model -> (config template, module holding its TritonPythonModel or None for the ensemble)
MODELS = {
    names.MODEL_PREPROCESSING: ("preprocessing.pbtxt", "kiln.triton_repo.preprocessing"),
    names.MODEL_ENGINE: ("engine.pbtxt", "kiln.triton_repo.engine_model"),
    names.MODEL_POSTPROCESSING: ("postprocessing.pbtxt", "kiln.triton_repo.postprocessing"),
    names.MODEL_ENSEMBLE: ("ensemble.pbtxt", None),
}


def _values(config: BuildConfig, repo_dir: Path, engine_dir: Path) -> dict[str, str]:
    engine_rel = os.path.relpath(engine_dir, repo_dir)
    return {
        "preprocessing": names.MODEL_PREPROCESSING,
        "engine": names.MODEL_ENGINE,
        "postprocessing": names.MODEL_POSTPROCESSING,
        "ensemble": names.MODEL_ENSEMBLE,
        "max_batch_size": str(config.build.max_batch_size),
        "instances": str(config.triton.instances),
        "engine_dir_parameter": names.ENGINE_DIR_PARAMETER,
        "tokenizer_dir_parameter": names.TOKENIZER_DIR_PARAMETER,
        "engine_dir": engine_rel,
        "tokenizer_dir": os.path.join(engine_rel, names.TOKENIZER_DIR),
        "text_input": names.TEXT_INPUT,
        "max_tokens": names.MAX_TOKENS,
        "stream": names.STREAM,
        "temperature": names.TEMPERATURE,
        "top_k": names.TOP_K,
        "top_p": names.TOP_P,
        "seed": names.SEED,
        "end_id": names.END_ID,
        "text_output": names.TEXT_OUTPUT,
        "input_ids": names.INPUT_IDS,
        "input_lengths": names.INPUT_LENGTHS,
        "request_output_len": names.REQUEST_OUTPUT_LEN,
        "streaming": names.STREAMING,
        "runtime_top_k": names.RUNTIME_TOP_K,
        "runtime_top_p": names.RUNTIME_TOP_P,
        "random_seed": names.RANDOM_SEED,
        "output_ids": names.OUTPUT_IDS,
        "sequence_length": names.SEQUENCE_LENGTH,
        "prefix_ids": names.PREFIX_IDS,
        "tokens_batch": names.TOKENS_BATCH,
        "prefix_batch": names.PREFIX_BATCH,
    }


def write_triton_repo(config: BuildConfig, repo_dir: Path, engine_dir: Path, write_to: Path | None = None) -> None:
    """Render every model into `write_to` (default repo_dir). Relative paths inside are computed
    for the final locations (repo_dir, engine_dir), so a staging folder can be renamed later."""
    values = _values(config, repo_dir, engine_dir)
    target = write_to or repo_dir
    model_py = Template((TEMPLATES / "model.py").read_text())
    for model, (config_template, module) in MODELS.items():
        folder = target / model
        (folder / "1").mkdir(parents=True)
        text = Template((TEMPLATES / config_template).read_text()).substitute(values)
        (folder / "config.pbtxt").write_text(text)
        if module:
            (folder / "1" / "model.py").write_text(model_py.substitute(model_name=model, module=module))
