"""The engine model's dispatcher under faults Triton cannot be made to produce on demand: a
response sender whose is_cancelled raises, and a response that cannot be made. The model runs
outside tritonserver with a stand-in for the Python backend's `triton_python_backend_utils`
(only the names the engine model uses) and a real engine; each fault must end its own request
and no other."""
import json
import sys
import threading
import types

import pytest

from kiln.runtime.sampling import SamplingParams

FINAL = 1
WAIT_S = 60.0


def stand_in_backend_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError:
        INTERNAL, UNAVAILABLE, INVALID_ARG = "INTERNAL", "UNAVAILABLE", "INVALID_ARG"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class Gauge:
        def set(self, value):
            self.value = value

    class MetricFamily:
        GAUGE = "gauge"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):  # noqa: N802 (the backend's own name)
            return Gauge()

    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, InferenceResponse, TritonError
    module.MetricFamily = MetricFamily
    return module


class Sender:
    """Records what the model sends; `broken`: is_cancelled raises, as a sender whose request the
    backend lost might."""

    def __init__(self, broken: bool = False):
        self.broken, self.sent, self.done = broken, [], threading.Event()

    def send(self, response=None, flags=0):
        self.sent.append(response)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        if self.broken:
            raise RuntimeError("the backend lost this request")
        return False

    def errors(self):
        return [r.error.message for r in self.sent if r is not None and r.error is not None]

    def tokens(self):
        from kiln import constants as names

        return [int(t) for r in self.sent if r is not None and r.error is None
                for tensor in r.output_tensors if tensor.name == names.OUTPUT_IDS for t in tensor.array.reshape(-1)]


@pytest.fixture
def model(tiny_engines, monkeypatch):
    from kiln import constants as names

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in_backend_utils())
    from kiln.triton_repo.engine_model import TritonPythonModel

    engine = tiny_engines("llama")
    config = {"parameters": {names.ENGINE_DIR_PARAMETER: {"string_value": engine.name}}}
    model = TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(engine.parent / "kiln"),
                      "model_name": "kiln"})
    yield model
    model.finalize()


def submit(model, sender: Sender, triton_id: str, max_tokens: int = 24) -> int:
    from kiln.runtime.llm import ChunkAssembler
    from kiln.triton_repo.engine_model import Active
    from kiln.triton_repo.engine_request import OutputOptions

    prompt = [1, 17, 250, 33, 99, 5]
    state = Active(sender, triton_id, prompt, OutputOptions(streaming=True),
                   ChunkAssembler(model.llm.tokenizer, prompt, model.token_bytes))
    with model.lock:
        request_id = model.executor.enqueue(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        model.active[request_id] = state
    return request_id


def test_a_sender_that_cannot_say_whether_it_was_cancelled_ends_its_request_only(model):
    healthy, broken = Sender(), Sender(broken=True)
    submit(model, broken, "broken", max_tokens=400)
    submit(model, healthy, "healthy")
    assert healthy.done.wait(WAIT_S) and broken.done.wait(WAIT_S)
    assert len(healthy.tokens()) == 24 and not healthy.errors()
    assert len(broken.tokens()) < 400  # ended early by the dispatcher, not run to its end
    assert model.dispatcher.is_alive()
    assert model.executor.stats()["running"] == 0


def test_a_response_that_cannot_be_made_fails_its_request_only(model, monkeypatch):
    from kiln.triton_repo import engine_model

    made = engine_model.output_arrays

    def output_arrays(active, *args, **kwargs):
        if active.triton_id == "faulty":
            raise ValueError("cannot make this output")
        return made(active, *args, **kwargs)

    monkeypatch.setattr(engine_model, "output_arrays", output_arrays)
    healthy, faulty = Sender(), Sender()
    submit(model, faulty, "faulty", max_tokens=400)
    submit(model, healthy, "healthy")
    assert healthy.done.wait(WAIT_S) and faulty.done.wait(WAIT_S)
    assert len(healthy.tokens()) == 24 and not healthy.errors()
    assert faulty.errors() == ["internal error making the response: cannot make this output"]
    assert model.dispatcher.is_alive()
    # the faulty request no longer runs, and the model serves the next one
    again = Sender()
    submit(model, again, "again")
    assert again.done.wait(WAIT_S) and len(again.tokens()) == 24
    assert model.executor.stats()["running"] == 0
