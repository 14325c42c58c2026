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


def special_token_text(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json hold it: the text, or an
    AddedToken saved as a dict with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def engine_tokenizer(args: dict):
    """The engine's tokenizer, found through the model's tokenizer_dir parameter."""
    from tokenizers import Tokenizer

    from kiln import constants as names

    path = os.path.join(repo_path(args, parameter(args, names.TOKENIZER_DIR_PARAMETER)), names.TOKENIZER_JSON)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the engine's tokenizer {path} is missing: rebuild the engine (build-engine) "
                                f"or point the repository at a complete one")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own error type, naming no file
        raise ValueError(f"cannot read the tokenizer {path}: {exc}; rebuild the engine") from None


def input_array(request, name: str) -> np.ndarray | None:
    """A request's input tensor by name, or None when the client did not send it."""
    import triton_python_backend_utils as pb_utils

    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def optional_scalar(request, name: str, default=None):
    array = input_array(request, name)
    return default if array is None else array.reshape(-1)[0].item()


def error_response(message: str, code: str = "INTERNAL", coded: bool = False):
    """A response carrying an error with a Triton status code: INVALID_ARG for what the client
    sent (HTTP 400), UNAVAILABLE for a full queue (HTTP 503: retry later), INTERNAL otherwise.
    `coded`: the message also starts with the code's name (for a caller that asked for it with
    CODED_ERRORS_PARAMETER: a gRPC stream passes on an error's message only)."""
    import triton_python_backend_utils as pb_utils

    from kiln import constants as names

    if coded:
        message = f"{code}{names.ERROR_CODE_SEPARATOR}{message}"
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def wants_coded_errors(request) -> bool:
    """Whether the request's parameters ask for coded error messages (see error_response)."""
    from kiln import constants as names

    try:
        given = json.loads(request.parameters() or "{}")
    except ValueError:
        return False
    return given.get(names.CODED_ERRORS_PARAMETER) is True


# request parameters Triton reserves (a client may send them beside the inputs, as kiln's own)
TRITON_PARAMETERS = frozenset({"priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                               "binary_data_output", "triton_enable_empty_final_response"})


def refuse_unknown_parameters(request, inputs) -> None:
    """Raise ValueError naming a request parameter kiln does not know. Triton's HTTP generate
    endpoint passes every JSON key that is not one of the model's inputs on as a parameter, so a
    misspelled input (`temprature`, `max_token`) would otherwise be dropped without a word."""
    from kiln import constants as names

    try:
        given = json.loads(request.parameters() or "{}")
    except ValueError:
        return
    unknown = sorted(set(given) - TRITON_PARAMETERS - {names.CODED_ERRORS_PARAMETER})
    if unknown:
        raise ValueError(f"unknown input {unknown[0]!r}" + (f" (and {unknown[1:]})" if unknown[1:] else "")
                         + f"; the inputs are {sorted(inputs)}")


ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "NOT_FOUND", "UNSUPPORTED", "INTERNAL")


def split_coded(message: str) -> tuple[str, str]:
    """(code, message) of a coded error message; ("INTERNAL", message) for any other."""
    from kiln import constants as names

    code, separator, rest = message.partition(names.ERROR_CODE_SEPARATOR)
    if separator and code in ERROR_CODES:
        return code, rest
    return "INTERNAL", message


def error_code(error) -> str:
    """The status code name of a pb_utils.TritonError (a response's error from another model)."""
    import triton_python_backend_utils as pb_utils

    code = error.code()
    return next((name for name in ERROR_CODES if getattr(pb_utils.TritonError, name) == code), "INTERNAL")
