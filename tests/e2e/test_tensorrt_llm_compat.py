"""A repository built with `triton.model_names: tensorrt_llm`, in the real tritonserver, called
the way TensorRT-LLM's inflight_batcher_llm clients call it (tritonclient gRPC streaming, HTTP
generate / generate_stream with its JSON bodies). Every TensorRT-LLM input is exercised."""
import json
import os
import queue
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import yaml

from kiln import constants as names
from kiln.builder.config import parse_config
from kiln.builder.triton_writer import write_triton_repo
from kiln.errors import KilnError
from kiln.triton_repo.client import ensemble_inputs, stream_generate, stream_responses
from kiln.triton_repo.serve import TritonServer
from tests.helpers import wait_for_running

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CJK_PROMPT = "猫🐱 犬🐶 猫🐱 犬🐶 猫🐱 犬🐶 猫🐱 犬🐶 猫🐱"
TRT = names.MODEL_NAME_SETS["tensorrt_llm"]


@pytest.fixture(scope="module")
def engine_dir(smollm2_engines):
    return smollm2_engines("float32")  # greedy tokens independent of the batch


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("trt_names")
    config = parse_config(yaml.safe_load((engine_dir / names.RESOLVED_CONFIG_FILE).read_text()))
    config = config.model_copy(update={"triton": config.triton.model_copy(update={"model_names": "tensorrt_llm"})})
    write_triton_repo(config, root / "triton_repo", engine_dir)
    with TritonServer(root / "triton_repo", log_file=root / "tritonserver.log") as running:
        yield running
    with pytest.raises(ProcessLookupError):  # no Python backend stub outlives the server
        os.killpg(running.process.pid, 0)


@pytest.fixture(scope="module")
def llm(engine_dir, llm_for):
    return llm_for(engine_dir)


def generate(server, body, model="ensemble", stream=False):
    path = f"/v2/models/{model}/generate" + ("_stream" if stream else "")
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        raise KilnError(exc.read().decode()) from None
    if stream:
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            raise KilnError(errors[0])
        return events
    return json.loads(text)


def text_of(server, model="ensemble", **body):
    body = {"text_input": PROMPT, "max_tokens": 16, "exclude_input_in_output": True, **body}
    return generate(server, body, model)["text_output"]


def token_id(llm, text):
    ids = llm.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, ids
    return ids[0]


def test_model_names_are_tensorrt_llms(server):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/repository/index", data=b"{}") as response:
        models = {m["name"]: m["state"] for m in json.loads(response.read())}
    assert models == {name: "READY" for name in
                      ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")}


# TensorRT-LLM's declarations (triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt)
TRT_ENSEMBLE_INPUTS = {
    "text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]), "bad_words": ("TYPE_STRING", [-1]),
    "stop_words": ("TYPE_STRING", [-1]), "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]), "top_k": ("TYPE_INT32", [1]),
    "top_p": ("TYPE_FP32", [1]), "temperature": ("TYPE_FP32", [1]), "length_penalty": ("TYPE_FP32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]), "min_tokens": ("TYPE_INT32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]), "frequency_penalty": ("TYPE_FP32", [1]), "seed": ("TYPE_UINT64", [1]),
    "return_log_probs": ("TYPE_BOOL", [1]), "return_context_logits": ("TYPE_BOOL", [1]),
    "return_generation_logits": ("TYPE_BOOL", [1]), "beam_width": ("TYPE_INT32", [1]), "stream": ("TYPE_BOOL", [1]),
    "num_return_sequences": ("TYPE_INT32", [1]), "embedding_bias_words": ("TYPE_STRING", [-1]),
    "embedding_bias_weights": ("TYPE_FP32", [-1]), "lora_task_id": ("TYPE_UINT64", [1]),
}
TRT_OUTPUTS = {"text_output": ("TYPE_STRING", [-1]), "cum_log_probs": ("TYPE_FP32", [-1]),
               "output_log_probs": ("TYPE_FP32", [-1, -1]), "context_logits": ("TYPE_FP32", [-1, -1]),
               "generation_logits": ("TYPE_FP32", [-1, -1, -1])}
TRT_ENGINE_INPUTS = {
    "input_ids": ("TYPE_INT32", [-1]), "input_lengths": ("TYPE_INT32", [1]), "request_output_len": ("TYPE_INT32", [1]),
    "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]), "stop_words_list": ("TYPE_INT32", [2, -1]),
    "bad_words_list": ("TYPE_INT32", [2, -1]), "embedding_bias": ("TYPE_FP32", [-1]),
    "runtime_top_k": ("TYPE_INT32", [1]), "runtime_top_p": ("TYPE_FP32", [1]), "len_penalty": ("TYPE_FP32", [1]),
    "min_tokens": ("TYPE_INT32", [1]), "seed": ("TYPE_UINT64", [1]), "stop": ("TYPE_BOOL", [1]),
    "streaming": ("TYPE_BOOL", [1]), "exclude_input_in_output": ("TYPE_BOOL", [1]), "beam_width": ("TYPE_INT32", [1]),
}
TRT_ENGINE_OUTPUTS = {"output_ids": ("TYPE_INT32", [-1, -1]), "sequence_length": ("TYPE_INT32", [-1])}


@pytest.mark.parametrize("model, inputs, outputs", [
    ("ensemble", TRT_ENSEMBLE_INPUTS, TRT_OUTPUTS),
    ("tensorrt_llm_bls", TRT_ENSEMBLE_INPUTS, TRT_OUTPUTS),
    ("tensorrt_llm", TRT_ENGINE_INPUTS, {**TRT_ENGINE_OUTPUTS, **{k: v for k, v in TRT_OUTPUTS.items() if k != "text_output"}}),
])
def test_tensors_have_tensorrt_llms_types_and_dims(server, model, inputs, outputs):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/config") as response:
        config = json.loads(response.read())
    got_in = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]}
    got_out = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in config["output"]}
    assert {k: got_in.get(k) for k in inputs} == inputs
    assert {k: got_out.get(k) for k in outputs} == outputs
    if model != "tensorrt_llm":  # the older names are accepted too
        assert got_in["random_seed"] == ("TYPE_UINT64", [1]) and got_in["min_length"] == ("TYPE_INT32", [1])


def test_postprocessing_takes_the_streamed_responses_that_queued_in_one_call(server):
    """Every streamed response is a postprocessing request: under load, those that queued while
    the instance was busy reach it together (dynamic batching, with no queue delay added); the
    decoupled engine model schedules its own requests."""
    def config_of(model):
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/config") as response:
            return json.loads(response.read())
    batching = config_of("postprocessing").get("dynamic_batching")
    assert batching is not None, "postprocessing has no dynamic_batching"
    assert int(batching.get("max_queue_delay_microseconds", 0)) == 0, batching
    assert "dynamic_batching" not in config_of("tensorrt_llm")


# --- each input changes the result as documented (docs/triton.md) ----------------------
def test_max_tokens_and_token_counts(server):
    out = generate(server, {"text_input": PROMPT, "max_tokens": 7, "return_num_output_tokens": True,
                            "return_num_input_tokens": True})
    assert out["num_output_tokens"] == 7 and out["num_input_tokens"] == 5
    assert "num_output_tokens" not in generate(server, {"text_input": PROMPT, "max_tokens": 7})


def test_exclude_input_in_output(server, llm):
    generated = llm.generate(PROMPT, max_tokens=16).text
    assert text_of(server, exclude_input_in_output=False) == PROMPT + generated
    assert text_of(server) == generated


def test_bad_words(server, llm):
    assert "Paris" in text_of(server)
    without = text_of(server, bad_words=["Paris", " Paris"])
    assert "Paris" not in without
    assert without == llm.generate(PROMPT, max_tokens=16, bad_words=((token_id(llm, " Paris"),),
                                                                     (token_id(llm, "Paris"),))).text


def test_stop_words_end_the_text_after_the_word(server):
    full = text_of(server)  # " Paris.\n\nThe answer is: ..."
    assert text_of(server, stop_words=["."]) == full[: full.index(".") + 1]
    assert text_of(server, stop_words=["\n", "zzz"]) == full[: full.index("\n") + 1]


def test_end_id_and_pad_id(server, llm):
    full = text_of(server)
    dot = token_id(llm, ".")
    assert text_of(server, end_id=dot) == full[: full.index(".")]  # the end token is not output
    assert text_of(server, end_id=-1, max_tokens=30) == llm.generate(PROMPT, max_tokens=30, ignore_eos=True).text
    assert text_of(server, pad_id=0) == full  # one beam: nothing to pad


def test_min_tokens_and_its_alias(server, llm):
    dot = token_id(llm, ".")
    for key in ("min_tokens", "min_length"):
        out = generate(server, {"text_input": PROMPT, "max_tokens": 16, "end_id": dot, key: 6,
                                "exclude_input_in_output": True, "return_num_output_tokens": True})
        assert out["num_output_tokens"] >= 6
        assert out["text_output"] == llm.generate(PROMPT, max_tokens=16, end_id=dot, min_tokens=6).text


def test_sampling_inputs(server, llm):
    greedy = text_of(server)
    sampled = [text_of(server, temperature=1.0, top_p=0.95, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert text_of(server, temperature=1.0, top_p=0.95, random_seed=1) == sampled[0]  # the alias
    assert text_of(server, temperature=1.5, top_k=1, seed=5) == greedy  # top_k 1 is greedy
    assert text_of(server, temperature=1.0, top_k=5, seed=3) == llm.generate(
        PROMPT, max_tokens=16, temperature=1.0, top_k=5, seed=3).text


@pytest.mark.parametrize("option, value", [("repetition_penalty", 1.6), ("presence_penalty", 1.5),
                                           ("frequency_penalty", 1.0)])
def test_penalties(server, llm, option, value):
    changed = text_of(server, max_tokens=32, **{option: value})
    assert changed != text_of(server, max_tokens=32)
    assert changed == llm.generate(PROMPT, max_tokens=32, **{option: value}).text


def test_length_penalty_is_accepted_and_does_not_change_one_beam(server):
    assert text_of(server, length_penalty=2.0) == text_of(server)


def test_embedding_bias_words(server):
    biased = text_of(server, embedding_bias_words=[" banana"], embedding_bias_weights=[30.0])
    assert biased.count("banana") >= 3


def test_log_probs(server, llm):
    out = generate(server, {"text_input": PROMPT, "max_tokens": 12, "return_log_probs": True})
    want = llm.generate(PROMPT, max_tokens=12, return_log_probs=True).log_probs
    assert out["output_log_probs"] == pytest.approx(want, abs=1e-4)
    assert out["cum_log_probs"] == pytest.approx(sum(want), abs=1e-3)
    assert "cum_log_probs" not in generate(server, {"text_input": PROMPT, "max_tokens": 4})  # not asked


def test_context_and_generation_logits_over_grpc(server, llm):
    results = list(stream_responses(server.grpc_url, PROMPT, 6, stream=False, return_context_logits=True,
                                    return_generation_logits=True))
    assert len(results) == 1
    want = llm.generate(PROMPT, max_tokens=6, return_context_logits=True, return_generation_logits=True)
    context = results[0].as_numpy("context_logits")
    generation = results[0].as_numpy("generation_logits")
    assert context.shape == (1, 5, llm.engine.spec.vocab_size)
    assert np.abs(context[0] - want.context_logits.numpy()).max() < 1e-4
    assert generation.shape == (1, 1, 6, llm.engine.spec.vocab_size)
    assert np.abs(generation[0, 0] - want.generation_logits.numpy()).max() < 1e-4


@pytest.mark.parametrize("body, message", [
    ({"beam_width": 2}, "beam_width 2"),
    ({"num_return_sequences": 3}, "num_return_sequences 3"),
    ({"lora_task_id": 7}, "LoRA adapters are not supported"),
    ({"max_tokens": 5000}, "max_seq_len 1024"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_inputs_kiln_cannot_honour_get_a_clear_error(server, model, body, message):
    with pytest.raises(KilnError, match=message):
        generate(server, {"text_input": PROMPT, "max_tokens": 4, **body}, model)
    assert text_of(server, model, beam_width=1)  # and it keeps serving


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_bad_request_is_a_client_error_over_http(server, model):
    """What the client sent is wrong: HTTP 400 (Triton's INVALID_ARG), not a server error."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                     data=json.dumps({"text_input": PROMPT, "max_tokens": 4, "beam_width": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and "beam_width 2" in caught.value.read().decode()


@pytest.mark.parametrize("missing", ["text_input", "max_tokens"])
@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_request_missing_a_required_input_says_which(server, model, stream, missing):
    body = {"text_input": PROMPT, "max_tokens": 4, "stream": stream}
    del body[missing]
    path = f"/v2/models/{model}/generate" + ("_stream" if stream else "")
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and missing in caught.value.read().decode()


# --- the pipeline, BLS, streaming -------------------------------------------------------
def infer_stream(server, model, inputs, request_id="r"):
    """All responses of one request on a gRPC stream (decoupled models answer only there)."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        out = []
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise KilnError(str(error))
            final = result.get_response().parameters["triton_final_response"].bool_param
            if not final or result.get_response().outputs:
                out.append(result)
            if final:
                return out
    finally:
        client.stop_stream()
        client.close()


def tensor(name, array):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


@pytest.mark.parametrize("exclude", [False, True])
def test_separately_called_pipeline_equals_the_ensemble(server, exclude):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    pre = client.infer("preprocessing", [tensor("QUERY", np.array([[PROMPT.encode()]], dtype=np.object_)),
                                         tensor("REQUEST_OUTPUT_LEN", np.array([[24]], dtype=np.int32))])
    ids, length = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
    assert pre.as_numpy("STOP_WORDS_IDS").shape == (1, 2, 0) or pre.as_numpy("STOP_WORDS_IDS").size == 2
    (engine,) = infer_stream(server, "tensorrt_llm", [
        tensor("input_ids", ids), tensor("input_lengths", length),
        tensor("request_output_len", np.array([[24]], dtype=np.int32)),
        tensor("exclude_input_in_output", np.array([[exclude]]))])
    output_ids = engine.as_numpy("output_ids")
    assert output_ids.shape[:2] == (1, 1)
    assert engine.as_numpy("sequence_length")[0, 0] == output_ids.shape[2]
    post = client.infer("postprocessing", [tensor("TOKENS_BATCH", output_ids),
                                           tensor("SEQUENCE_LENGTH", engine.as_numpy("sequence_length"))])
    text = post.as_numpy("OUTPUT").reshape(-1)[0]
    ensemble = generate(server, {"text_input": PROMPT, "max_tokens": 24, "exclude_input_in_output": exclude})
    assert text == ensemble["text_output"].encode()
    client.close()


def trt_client_run(server, model, streaming, **extra):
    """What TensorRT-LLM's end_to_end_grpc_client.py does, step for step: one stream, no empty
    final response asked for, then each result read as `result.as_numpy('text_output')[0]
    .decode()` (and the other outputs by their first indices)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    arrays = {"text_input": np.array([[PROMPT]]).astype(object), "max_tokens": np.array([[12]], dtype=np.int32),
              "stream": np.array([[streaming]], dtype=bool), "beam_width": np.array([[1]], dtype=np.int32),
              "temperature": np.array([[1.0]], dtype=np.float32), "top_k": np.array([[1]], dtype=np.int32),
              "return_log_probs": np.array([[True]], dtype=bool), **extra}
    inputs = []
    for name, array in arrays.items():
        t = grpcclient.InferInput(name, array.shape, np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(model, inputs, request_id="trt-client")
    client.stop_stream()  # waits for the server to close the stream
    client.close()
    texts, extras = [], []
    while not results.empty():
        result = results.get()
        assert not isinstance(result, InferenceServerException), result
        texts.append(result.as_numpy("text_output")[0].decode("utf-8"))
        extras.append((float(result.as_numpy("cum_log_probs")[0][0]), result.as_numpy("output_log_probs")[0][0],
                       int(result.as_numpy("batch_index")[0][0])))
    return texts, extras


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_outputs_read_the_way_tensorrt_llms_clients_read_them(server, model, streaming):
    texts, extras = trt_client_run(server, model, streaming)
    answer = text_of(server, model, max_tokens=12)  # a streamed answer never repeats the prompt
    assert len(texts) > (1 if streaming else 0) and "".join(texts) == (answer if streaming else PROMPT + answer)
    assert all(batch_index == 0 for _, _, batch_index in extras)
    if not streaming:
        (cum, per_token, _), = extras
        assert cum == pytest.approx(float(per_token.sum()), abs=1e-4)


def test_engine_outputs_read_the_way_tensorrt_llms_clients_read_them(server, llm):
    """inflight_batcher_llm_client.py against the engine model: output_ids[0][0][:sequence_length[0][0]]."""
    ids = np.array([llm.encode(PROMPT)], dtype=np.int32)
    (result,) = infer_stream(server, "tensorrt_llm", [
        tensor("input_ids", ids), tensor("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32)),
        tensor("request_output_len", np.array([[10]], dtype=np.int32)),
        tensor("return_log_probs", np.array([[True]])), tensor("exclude_input_in_output", np.array([[True]]))])
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    tokens = output_ids[0][0][:lengths[0][0]].tolist()
    assert tokens == llm.generate(PROMPT, max_tokens=10).token_ids
    assert result.as_numpy("output_log_probs")[0][0].shape == (len(tokens),)
    assert result.as_numpy("cum_log_probs")[0][0] == pytest.approx(result.as_numpy("output_log_probs")[0][0].sum(),
                                                                   abs=1e-4)
    assert result.as_numpy("batch_index")[0][0] == 0 and result.as_numpy("sequence_index")[0][0] == 0


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_cjk_and_emoji_stream_equals_the_whole_answer_byte_for_byte(server, model):
    whole = generate(server, {"text_input": CJK_PROMPT, "max_tokens": 24, "exclude_input_in_output": True}, model)
    chunks = list(stream_generate(server.grpc_url, CJK_PROMPT, 24, model=model))
    assert "🐶" in whole["text_output"] and "犬" in whole["text_output"]
    assert len(chunks) > 4
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks).encode() == whole["text_output"].encode()


def test_bls_equals_the_ensemble_over_http(server):
    body = {"text_input": PROMPT, "max_tokens": 20, "bad_words": "", "stop_words": "", "return_log_probs": True}
    bls, ensemble = generate(server, body, "tensorrt_llm_bls"), generate(server, body)
    assert bls["text_output"] == ensemble["text_output"]
    assert bls["output_log_probs"] == pytest.approx(ensemble["output_log_probs"])
    streamed = generate(server, {**body, "stream": True}, "tensorrt_llm_bls", stream=True)
    assert len(streamed) > 1
    assert "".join(e["text_output"] for e in streamed) == text_of(server, max_tokens=20)


def test_stop_input_ends_a_running_request(server):
    """TensorRT-LLM's way to end a request: a second request with the same id and stop=True."""
    import tritonclient.grpc as grpcclient

    ids = np.array([[504, 3575, 282, 4649, 314]], dtype=np.int32)
    common = [tensor("input_ids", ids), tensor("input_lengths", np.array([[5]], dtype=np.int32)),
              tensor("request_output_len", np.array([[400]], dtype=np.int32)),
              tensor("end_id", np.array([[-1]], dtype=np.int32)), tensor("streaming", np.array([[True]]))]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("tensorrt_llm", common, request_id="long-one", enable_empty_final_response=True)
    results.get(timeout=120)  # it is running
    stopper = threading.Thread(target=infer_stream, args=(server, "tensorrt_llm", common[1:3] + [
        tensor("stop", np.array([[True]]))], "long-one"))
    stopper.start()
    stopper.join(timeout=60)
    tokens = 1
    while True:
        result, error = results.get(timeout=120)
        assert error is None
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        tokens += result.as_numpy("output_ids").shape[-1]
    client.stop_stream()
    client.close()
    assert tokens < 400
    with pytest.raises(KilnError, match="no running request has the id 'nobody'"):
        infer_stream(server, "tensorrt_llm", common[1:3] + [tensor("stop", np.array([[True]]))], "nobody")


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_cancelling_the_stream_ends_the_engine_request(server, model):
    """Cancelling a gRPC stream reaches the engine when it is called directly or through BLS.
    (Triton checks an ensemble's cancellation only between its steps, so a running engine
    step of an ensemble request is not told; TensorRT-LLM's ensemble has the same limit.)"""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    if model == "tensorrt_llm":
        inputs = [tensor("input_ids", np.array([[504, 3575, 282, 4649, 314]], dtype=np.int32)),
                  tensor("input_lengths", np.array([[5]], dtype=np.int32)),
                  tensor("request_output_len", np.array([[800]], dtype=np.int32)),
                  tensor("end_id", np.array([[-1]], dtype=np.int32)), tensor("streaming", np.array([[True]]))]
    else:
        inputs = ensemble_inputs(PROMPT, 800, True, end_id=-1)
    client.async_stream_infer(model, inputs, request_id="to-cancel")
    results.get(timeout=120)

    assert wait_for_running(server, 1) == 1
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for_running(server, 0) == 0
    assert text_of(server)  # still serving


# --- bad input over gRPC: a specific error naming the input, and the server keeps serving ----
def text_request(**override):
    """An ensemble / BLS request as raw tensors, with any of them replaced (None: left out)."""
    arrays = {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
              "max_tokens": np.array([[4]], dtype=np.int32), "stream": np.array([[True]])}
    arrays.update(override)
    return [tensor(name, array) for name, array in arrays.items() if array is not None]


def engine_request(**override):
    arrays = {"input_ids": np.array([[504, 3575, 282, 4649, 314]], dtype=np.int32),
              "input_lengths": np.array([[5]], dtype=np.int32),
              "request_output_len": np.array([[4]], dtype=np.int32), "streaming": np.array([[True]])}
    arrays.update(override)
    return [tensor(name, array) for name, array in arrays.items() if array is not None]


BAD_TEXT_REQUESTS = {
    "text not UTF-8": (dict(text_input=np.array([[b"caf\xe9 \xff"]], dtype=np.object_)), "UTF-8"),
    "max_tokens as FP32": (dict(max_tokens=np.array([[4.0]], dtype=np.float32)), "max_tokens"),
    "max_tokens of two values": (dict(max_tokens=np.array([[4, 5]], dtype=np.int32)), "max_tokens"),
    "max_tokens zero": (dict(max_tokens=np.array([[0]], dtype=np.int32)), "max_tokens"),
    "temperature negative": (dict(temperature=np.array([[-1.0]], dtype=np.float32)), "temperature"),
    "top_p over 1": (dict(top_p=np.array([[1.5]], dtype=np.float32)), "top_p"),
    "top_k negative": (dict(top_k=np.array([[-3]], dtype=np.int32)), "top_k"),
    "bias weights without words": (dict(embedding_bias_weights=np.array([[1.0, 2.0]], dtype=np.float32)),
                                   "embedding_bias"),
    "unknown input": (dict(prompt_text=np.array([[b"x"]], dtype=np.object_)), "prompt_text"),
}


@pytest.mark.parametrize("case", list(BAD_TEXT_REQUESTS))
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_bad_request_over_grpc_gets_an_error_naming_the_input(server, model, case):
    override, names_it = BAD_TEXT_REQUESTS[case]
    with pytest.raises(KilnError) as caught:
        infer_stream(server, model, text_request(**override))
    assert names_it in str(caught.value), str(caught.value)
    assert infer_stream(server, model, text_request())  # and it keeps serving


BAD_ENGINE_REQUESTS = {
    "no prompt tokens": (dict(input_ids=np.zeros((1, 0), dtype=np.int32),
                              input_lengths=np.array([[0]], dtype=np.int32)), "prompt"),
    "input_ids as FP32": (dict(input_ids=np.array([[504.0, 3575.0]], dtype=np.float32)), "input_ids"),
    "token id over the vocabulary": (dict(input_ids=np.array([[504, 10 ** 6]], dtype=np.int32),
                                          input_lengths=np.array([[2]], dtype=np.int32)), "vocab"),
    "word list offsets past its ids": (dict(bad_words_list=np.array([[[7, 8], [5, -1]]], dtype=np.int32)),
                                       "bad_words_list"),
    "word list of one row": (dict(stop_words_list=np.array([[[7, 8]]], dtype=np.int32)), "stop_words_list"),
    "beam_width 2": (dict(beam_width=np.array([[2]], dtype=np.int32)), "beam_width"),
}


@pytest.mark.parametrize("case", list(BAD_ENGINE_REQUESTS))
def test_a_bad_engine_request_over_grpc_gets_an_error_naming_the_input(server, case):
    override, names_it = BAD_ENGINE_REQUESTS[case]
    with pytest.raises(KilnError) as caught:
        infer_stream(server, "tensorrt_llm", engine_request(**override))
    assert names_it in str(caught.value), str(caught.value)
    assert infer_stream(server, "tensorrt_llm", engine_request())


def test_requests_that_reuse_an_id_are_served_apart(server):
    """Request ids are the client's labels: two streams in flight with the same id each get
    their own, whole answer (the same as alone)."""
    alone = [r.as_numpy("output_ids") for r in infer_stream(server, "tensorrt_llm", engine_request(), "same")]
    both = [None, None]

    def run(i):
        both[i] = [r.as_numpy("output_ids") for r in infer_stream(server, "tensorrt_llm", engine_request(), "same")]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = np.concatenate(alone, axis=-1)
    for got in both:
        assert got is not None and np.array_equal(np.concatenate(got, axis=-1), want)


# --- bad input over HTTP generate / generate_stream: a 400 naming the input, and the server keeps serving
def http_status(server, model: str, body: bytes, stream: bool) -> tuple[int, str]:
    """(HTTP status, the error message) of a generate call with this raw body; an error inside a
    stream (status 200, `data: {"error": ...}`) counts as that error."""
    path = f"/v2/models/{model}/generate" + ("_stream" if stream else "")
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    errors = [line for line in text.splitlines() if line.startswith("data: ") and '"error"' in line]
    return (200, errors[0]) if errors else (200, "")


def body_of(**override) -> bytes:
    fields = {"text_input": PROMPT, "max_tokens": 4, **override}
    return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()


BAD_HTTP_BODIES = {  # kiln's models answer these
    "text not UTF-8": (b'{"text_input": "caf\xe9 \xff", "max_tokens": 4}', "UTF-8"),
    "empty prompt": (body_of(text_input=""), "empty"),
    "max_tokens zero": (body_of(max_tokens=0), "max_tokens"),
    "temperature negative": (body_of(temperature=-1.0), "temperature"),
    "temperature NaN": (b'{"text_input": "Hello", "max_tokens": 4, "temperature": NaN}', "temperature"),
    "top_p over 1": (body_of(top_p=1.5), "top_p"),
    "top_k negative": (body_of(top_k=-3), "top_k"),
    "bias weights without words": (body_of(embedding_bias_weights=[1.0, 2.0]), "embedding_bias"),
    "beam_width 2": (body_of(beam_width=2), "beam_width"),
    "unknown input": (body_of(prompt_text="x"), "unknown input 'prompt_text'"),
    "misspelled input": (body_of(temprature=0.5), "unknown input 'temprature'"),
}


@pytest.mark.parametrize("case", list(BAD_HTTP_BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_bad_request_over_http_gets_a_400_naming_the_input(server, model, stream, case):
    body, names_it = BAD_HTTP_BODIES[case]
    status, message = http_status(server, model, body, stream)
    assert (status, names_it.lower() in message.lower()) == (400, True), (status, message)
    assert http_status(server, model, body_of(), stream) == (200, "")  # and it keeps serving


TRITON_REFUSES = {  # Triton's HTTP frontend answers these itself, before any model runs
    "not JSON": (b'{"text_input": "Hello", "max_tokens": 4', 500, "failed to parse the request JSON"),
    "max_tokens as text": (body_of(max_tokens="four"), 500, "attempt to access JSON non-signed-integer"),
    "max_tokens fractional": (body_of(max_tokens=4.5), 500, "attempt to access JSON non-signed-integer"),
    "stop words not text": (body_of(stop_words=[[1, 2]]), 500, "Unable to parse JSON bytes array"),
    "max_tokens of two values": (body_of(max_tokens=[4, 5]), 400, "batch size does not match"),
}


@pytest.mark.parametrize("case", list(TRITON_REFUSES))
@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_body_tritons_frontend_cannot_parse_is_refused_and_serving_goes_on(server, model, stream, case):
    """What users see for these (docs/triton.md): Triton's own status and message; kiln's models
    never get the request."""
    body, status, message = TRITON_REFUSES[case]
    assert http_status(server, model, body, stream)[0] == status
    assert message in http_status(server, model, body, stream)[1]
    assert http_status(server, model, body_of(), stream) == (200, "")
