"""The client side: stream a generation from a kiln ensemble over tritonclient gRPC."""
from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator

import numpy as np

from kiln import constants as names
from kiln.errors import KilnError


def ensemble_inputs(prompt: str, max_tokens: int, stream: bool, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    end_id: int | None = None, module=None):
    """The ensemble's input tensors for one request (tritonclient.grpc or .http InferInput)."""
    if module is None:
        import tritonclient.grpc as module

    def tensor(name: str, value, dtype: str, np_dtype):
        t = module.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    inputs = [
        tensor(names.TEXT_INPUT, prompt.encode("utf-8"), "BYTES", np.object_),
        tensor(names.MAX_TOKENS, max_tokens, "INT32", np.int32),
        tensor(names.STREAM, stream, "BOOL", np.bool_),
    ]
    optional = [(names.TEMPERATURE, temperature, "FP32", np.float32), (names.TOP_K, top_k, "INT32", np.int32),
                (names.TOP_P, top_p, "FP32", np.float32), (names.SEED, seed, "UINT64", np.uint64),
                (names.END_ID, end_id, "INT32", np.int32)]
    inputs += [tensor(n, v, d, npd) for n, v, d, npd in optional if v is not None]
    return inputs


def stream_generate(url: str, prompt: str, max_tokens: int = 64, model: str = names.MODEL_ENSEMBLE,
                    timeout: float = 600.0, **sampling) -> Iterator[str]:
    """Yield text chunks as the server streams them (gRPC bidirectional stream)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(
            model, ensemble_inputs(prompt, max_tokens, True, **sampling),
            request_id=uuid.uuid4().hex, enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise KilnError(f"no response from {url} within {timeout:.0f}s") from None
            if error is not None:
                raise KilnError(f"server error: {error.message() if isinstance(error, InferenceServerException) else error}")
            text = result.as_numpy(names.TEXT_OUTPUT)
            if text is not None and text.size:
                yield text.reshape(-1)[0].decode("utf-8")
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()
