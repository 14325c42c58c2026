"""Write the Triton model repository: config.pbtxt files rendered from
kiln.triton_repo.model_configs, and a model.py per Python model (templates/model.py)."""
from __future__ import annotations

import os
from pathlib import Path
from string import Template

from kiln import constants as names
from kiln import triton_repo
from kiln.builder.config import BuildConfig
from kiln.triton_repo import model_configs as mc

TEMPLATES = Path(triton_repo.__file__).parent / "templates"

MODULES = {  # role -> module holding its TritonPythonModel
    names.ROLE_PREPROCESSING: "kiln.triton_repo.preprocessing",
    names.ROLE_ENGINE: "kiln.triton_repo.engine_model",
    names.ROLE_POSTPROCESSING: "kiln.triton_repo.postprocessing",
    names.ROLE_BLS: "kiln.triton_repo.bls",
}


def model_names(config: BuildConfig) -> dict[str, str]:
    """role -> model name, for the configured `triton.model_names`."""
    return names.MODEL_NAME_SETS[config.triton.model_names]


def render_configs(config: BuildConfig, repo_dir: Path, engine_dir: Path) -> dict[str, str]:
    """model name -> config.pbtxt text."""
    models = model_names(config)
    engine_rel = os.path.relpath(engine_dir, repo_dir)
    tokenizer = {names.TOKENIZER_DIR_PARAMETER: os.path.join(engine_rel, names.TOKENIZER_DIR)}
    batch = config.build.max_batch_size
    instances = config.triton.instances
    return {
        models[names.ROLE_PREPROCESSING]: mc.python_model(
            models[names.ROLE_PREPROCESSING], batch, mc.PREPROCESSING_INPUTS, mc.PREPROCESSING_OUTPUTS, tokenizer,
            instances),
        models[names.ROLE_ENGINE]: mc.python_model(
            models[names.ROLE_ENGINE], batch, mc.ENGINE_INPUTS, mc.ENGINE_OUTPUTS,
            {names.ENGINE_DIR_PARAMETER: engine_rel}, decoupled=True),
        models[names.ROLE_POSTPROCESSING]: mc.python_model(
            models[names.ROLE_POSTPROCESSING], batch, mc.POSTPROCESSING_INPUTS, mc.POSTPROCESSING_OUTPUTS,
            tokenizer, instances, dynamic_batching=True),  # a call per streamed response: batched under load
        models[names.ROLE_BLS]: mc.python_model(
            models[names.ROLE_BLS], batch, mc.TEXT_INPUTS, mc.TEXT_OUTPUTS,
            {**tokenizer, names.PREPROCESSING_MODEL_PARAMETER: models[names.ROLE_PREPROCESSING],
             names.ENGINE_MODEL_PARAMETER: models[names.ROLE_ENGINE],
             names.POSTPROCESSING_MODEL_PARAMETER: models[names.ROLE_POSTPROCESSING]},
            decoupled=True),
        models[names.ROLE_ENSEMBLE]: mc.ensemble(models, batch),
    }


def write_triton_repo(config: BuildConfig, repo_dir: Path, engine_dir: Path, write_to: Path | None = None) -> None:
    """Render every model into `write_to` (default repo_dir). Relative paths inside are computed
    for the final locations (repo_dir, engine_dir), so a staging folder can be renamed later."""
    target = write_to or repo_dir
    model_py = Template((TEMPLATES / "model.py").read_text())
    roles = {name: role for role, name in model_names(config).items()}
    for model, text in render_configs(config, repo_dir, engine_dir).items():
        folder = target / model
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(text)
        module = MODULES.get(roles[model])
        if module:
            (folder / "1" / "model.py").write_text(model_py.substitute(model_name=model, module=module))
