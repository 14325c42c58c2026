"""The client side: requests to a kiln (or TensorRT-LLM) ensemble / BLS model with tritonclient."""
from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator

import numpy as np

from kiln import constants as names
from kiln.errors import KilnError
from kiln.triton_repo.model_configs import TEXT_INPUTS

NUMPY_TYPES = {"STRING": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64,
               "FP32": np.float32, "FP16": np.float16}


def ensemble_inputs(prompt: str, max_tokens: int, stream: bool, module=None, **options):
    """The input tensors of one request (tritonclient.grpc or .http InferInput). `options` are
    any of the ensemble's inputs by name (top_k=..., stop_words=[...], return_log_probs=True);
    None leaves one out."""
    if module is None:
        import tritonclient.grpc as module
    specs = {spec.name: spec for spec in TEXT_INPUTS}
    values = {names.TEXT_INPUT: prompt, names.MAX_TOKENS: max_tokens, names.STREAM: stream, **options}
    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name not in specs:
            raise KilnError(f"{name!r} is not an input of the ensemble (see docs/triton.md)")
        spec = specs[name]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if spec.dtype == "STRING":
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
        array = np.array([items], dtype=NUMPY_TYPES[spec.dtype])
        tensor = module.InferInput(name, list(array.shape), "BYTES" if spec.dtype == "STRING" else spec.dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def cancel_stream(client) -> None:
    """Cancel a tritonclient.grpc client's stream and end its requests. tritonclient's
    `stop_stream(cancel_requests=True)` cancels the responses but never ends the iterator gRPC
    reads requests from, so gRPC's request thread waits for good: one thread (and its call) per
    cancelled stream stays in the process. The end-of-requests marker lets it return."""
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=True)
    requests = getattr(stream, "_request_queue", None)
    if requests is not None:
        requests.put(None)


def connect(url: str):
    """A tritonclient.grpc client for url, checked to answer: KilnError saying so when nothing
    serves there (instead of the stream's own error, which names no address)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        client.is_server_live(client_timeout=10)
    except InferenceServerException as exc:
        client.close()
        raise KilnError(f"cannot connect to {url} (is `kiln serve` running?): {exc.message()}") from None
    return client


def stream_responses(url: str, prompt: str, max_tokens: int = 64, model: str = names.MODEL_ENSEMBLE,
                     timeout: float = 600.0, request_id: str | None = None, stream: bool = True,
                     **options) -> Iterator:
    """Yield each response (tritonclient.grpc InferResult) of one request, over a gRPC stream
    (stream=False: the ensemble answers once, with everything)."""
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    client = connect(url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, ensemble_inputs(prompt, max_tokens, stream, **options),
                                  request_id=request_id or uuid.uuid4().hex, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise KilnError(f"no response from {url} within {timeout:.0f}s") from None
            if error is not None:
                raise KilnError(f"server error: {error.message() if isinstance(error, InferenceServerException) else error}")
            if result.get_response().parameters["triton_final_response"].bool_param:
                if result.as_numpy(names.TEXT_OUTPUT) is not None:
                    yield result
                return
            yield result
    finally:
        client.stop_stream()
        client.close()


def stream_generate(url: str, prompt: str, max_tokens: int = 64, model: str = names.MODEL_ENSEMBLE,
                    timeout: float = 600.0, **options) -> Iterator[str]:
    """Yield text chunks as the server streams them (gRPC bidirectional stream)."""
    for result in stream_responses(url, prompt, max_tokens, model, timeout, **options):
        text = result.as_numpy(names.TEXT_OUTPUT)
        if text is not None and text.size:
            yield text.reshape(-1)[0].decode("utf-8")
