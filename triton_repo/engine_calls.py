"""How the BLS model streams one request from the engine model: through the server's own gRPC
endpoint (what `kiln serve` sets up), or through Triton's in-process BLS calls.

Both yield each engine response's tensors by name, raise RequestFailed with the engine's status
code on an error, and end the engine request when the BLS's client cancels.

Why gRPC first: in Triton 2.51's Python backend, a decoupled BLS call can deadlock the stub under
many concurrent streams. A thread waking in `ResponseIterator.Next` re-takes the GIL while it
holds the iterator's mutex; the stub's response thread holds the iterator map's mutex waiting
for that iterator; a thread starting a new `exec(decoupled=True)` holds the GIL waiting for the
map's mutex. Every BLS stream then stops, and the engine model's sends to it block. Over gRPC
the BLS stub runs no decoupled BLS call at all (its preprocessing call is not decoupled)."""
from __future__ import annotations

import contextlib
import logging
import queue
import time
from typing import Callable, Iterator

import numpy as np

from kiln import constants as names

log = logging.getLogger("kiln.triton.bls")

CANCEL_POLL_S = 0.2  # how often a stream waiting for the engine asks whether its client cancelled
STOP_GRACE_S = 10.0  # a stopped request's engine has this long to end it before its stream is cut

Arrays = dict[str, np.ndarray]


class RequestFailed(Exception):
    """A step (preprocessing, the engine) answered with an error: passed on with its status code."""

    def __init__(self, message: str, code: str = "INTERNAL"):
        super().__init__(message)
        self.code = code


class GrpcEngine:
    """The engine model over the server's gRPC endpoint: one stream per request. When the BLS's
    client cancels, the stream carries TensorRT-LLM's `stop` for the request and is read to the
    engine's final response (the engine frees the request's KV blocks); the stream is cut only
    where that takes longer than STOP_GRACE_S (Triton 2.51's gRPC frontend has races in its
    handling of cancelled calls that can take the whole server down)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def stream(self, inputs: Arrays, request_id: str, cancelled: Callable[[], bool]) -> Iterator[Arrays]:
        import tritonclient.grpc as grpcclient

        from kiln.triton_repo.client import cancel_stream
        from kiln.triton_repo.model_utils import split_coded

        arrived: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(self.url)
        stopped_at = None  # when the stop went out; then the request and the stop each end (2 finals)
        finals = 0
        try:
            client.start_stream(callback=lambda result, error: arrived.put((result, error)))
            client.async_stream_infer(self.model, grpc_inputs(inputs), request_id=request_id,
                                      enable_empty_final_response=True,
                                      parameters={names.CODED_ERRORS_PARAMETER: True})
            while True:
                if stopped_at is None and cancelled():
                    client.async_stream_infer(self.model, grpc_inputs(stop_inputs(inputs)), request_id=request_id,
                                              enable_empty_final_response=True)
                    stopped_at = time.monotonic()
                if stopped_at is not None and time.monotonic() - stopped_at > STOP_GRACE_S:
                    cancel_stream(client)
                    return
                try:
                    result, error = arrived.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    continue
                final = error is not None or result.get_response().parameters["triton_final_response"].bool_param
                if stopped_at is not None:  # nothing more is passed on: the request's end is awaited
                    finals += final
                    if finals == 2:
                        return
                    continue
                if error is not None:
                    code, message = split_coded(error.message())
                    raise RequestFailed(message, code)
                response = result.get_response()
                arrays = {output.name: result.as_numpy(output.name) for output in response.outputs}
                if arrays:
                    yield arrays
                if final:
                    return
        finally:
            with contextlib.suppress(Exception):  # closing a stream the server already ended
                client.stop_stream()
                client.close()


def stop_inputs(inputs: Arrays) -> Arrays:
    """TensorRT-LLM's `stop` for the request these inputs started (the engine model's required
    inputs, and `stop`)."""
    required = {name: inputs[name] for name in (names.INPUT_LENGTHS, names.REQUEST_OUTPUT_LEN)}
    return required | {names.STOP: np.array([[True]])}


def grpc_inputs(inputs: Arrays) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class InProcessEngine:
    """The engine model through Triton's BLS calls (`exec(decoupled=True)`): used when the
    server's gRPC address is not known (a tritonserver started without `kiln serve` and without
    KILN_TRITON_GRPC_URL). Subject to the deadlock above under many concurrent streams."""

    def __init__(self, model: str, outputs: list[str]):
        self.model, self.outputs = model, outputs

    def stream(self, inputs: Arrays, request_id: str, cancelled: Callable[[], bool]) -> Iterator[Arrays]:
        import triton_python_backend_utils as pb_utils

        from kiln.triton_repo.model_utils import error_code

        tensors = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
        responses = pb_utils.InferenceRequest(
            model_name=self.model, requested_output_names=self.outputs, inputs=tensors, request_id=request_id,
        ).exec(decoupled=True)
        stopped = False
        for response in responses:
            # Every response is taken, up to the final one, also after the client cancelled:
            # Triton holds one of its few BLS threads until an inner request's responses are
            # all taken, and a loop that left early leaked one per cancellation.
            if stopped:
                continue
            if response.has_error():
                raise RequestFailed(response.error().message(), error_code(response.error()))
            if cancelled():
                self._stop(request_id, inputs)  # the engine ends it: its final response follows
                stopped = True
                continue
            arrays = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
            if arrays:
                yield arrays

    def _stop(self, request_id: str, inputs: Arrays) -> None:
        """TensorRT-LLM's `stop` for the request with this id."""
        import triton_python_backend_utils as pb_utils

        stop = pb_utils.InferenceRequest(
            model_name=self.model, requested_output_names=[], request_id=request_id,
            inputs=[pb_utils.Tensor(name, array) for name, array in stop_inputs(inputs).items()],
        )
        for _ in stop.exec(decoupled=True):
            pass
