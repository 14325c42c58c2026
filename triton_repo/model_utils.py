"""Helpers for the Python-backend models (imported inside tritonserver's stub only)."""
from __future__ import annotations

import json
import os

import numpy as np


def parameter(args: dict, key: str) -> str:
    return json.loads(args["model_config"])["parameters"][key]["string_value"]


def repo_path(args: dict, relative: str) -> str:
    """Paths in the generated configs are relative to the repository folder, so the whole
    build output can move."""
    repo_root = os.path.dirname(os.path.abspath(args["model_repository"]))
    return os.path.normpath(os.path.join(repo_root, relative))


def engine_tokenizer(args: dict):
    """The engine's tokenizer, found through the model's tokenizer_dir parameter."""
    from tokenizers import Tokenizer

    from kiln import constants as names

    folder = repo_path(args, parameter(args, names.TOKENIZER_DIR_PARAMETER))
    return Tokenizer.from_file(os.path.join(folder, names.TOKENIZER_JSON))


def input_array(request, name: str) -> np.ndarray | None:
    """A request's input tensor by name, or None when the client did not send it."""
    import triton_python_backend_utils as pb_utils

    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def optional_scalar(request, name: str, default=None):
    array = input_array(request, name)
    return default if array is None else array.reshape(-1)[0].item()


def error_response(message: str):
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
