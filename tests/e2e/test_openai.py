"""The OpenAI-compatible frontend in front of the real tritonserver, called with the official
`openai` Python client: the same greedy text as `kiln generate` (the ensemble), usage counts,
stop sequences, log probabilities, errors in OpenAI's shape, and a dropped stream that frees its
engine request."""
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln import constants as names
from kiln.triton_repo.client import stream_generate
from kiln.triton_repo.openai_engine import ServedModel
from kiln.triton_repo.openai_server import OpenAIServer
from kiln.triton_repo.serve import TritonServer
from tests.helpers import metric, wait_for_running

pytestmark = pytest.mark.slow

MODEL = "smollm2-openai"
PROMPTS = ["The capital of France is", "Write the word 'hello' in Japanese and add an emoji:"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def repo(smollm2_engines):
    # float32: greedy tokens do not depend on the batch, so texts compare exactly
    return smollm2_engines("float32").parent / "triton_repo"


@pytest.fixture(scope="module")
def served(repo):
    return ServedModel.from_repo(repo, MODEL)


@pytest.fixture(scope="module")
def server(repo, served, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    # room for one queued request: a burst past the engine's 16 slots meets a full queue
    with TritonServer(repo, log_file=log, runtime={"max_queue_size": 1}) as triton:
        frontend = OpenAIServer(served, triton.grpc_url, port=0).start()
        triton.openai = frontend
        try:
            yield triton
        finally:
            frontend.stop()


@pytest.fixture(autouse=True)
def the_server_stays_up(request):
    """After each test on the shared server: it and its backend processes still run (else the
    test errors with the exit code and the server's last words, for the tests after it)."""
    yield
    if "server" in request.fixturenames:
        problem = request.getfixturevalue("server").health()
        assert problem is None, problem


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.openai.url, api_key="unused", max_retries=0, timeout=300)


def kiln_generate(server, prompt: str, max_tokens: int) -> str:
    return "".join(stream_generate(server.grpc_url, prompt, max_tokens))


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.openai.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_kiln_generate(server, client, prompt):
    expected = kiln_generate(server, prompt, 24)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def test_chat_equals_kiln_generate_on_the_rendered_conversation(server, client, served):
    rendered = served.chat_template.render(QUESTION)
    expected = kiln_generate(server, rendered, 24)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(served.encode(rendered, special_tokens=False))
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_max_tokens_ends_with_length_and_usage_counts_tokens(client, served):
    prompt = "Count from one to one hundred: one, two,"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens == len(served.encode(prompt))
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


def test_a_stop_sequence_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle of the answer
    assert len(stop) == 3, text
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                           stop=[stop, "\u2603never"], stream=stream)
        if stream:
            chunks = list(result)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = result.choices[0].text, result.choices[0].finish_reason
        assert got == text[:text.index(stop)] and reason == "stop", (stream, stop, got)


def test_log_probabilities_come_with_their_tokens(client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1)
    logprobs = result.choices[0].logprobs
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert len(logprobs.token_logprobs) == result.usage.completion_tokens == 12
    assert all(p <= 0 for p in logprobs.token_logprobs) and any(p < 0 for p in logprobs.token_logprobs)
    assert [list(top.values())[0] for top in logprobs.top_logprobs] == logprobs.token_logprobs
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens > 0
    assert all(entry.logprob <= 0 for entry in entries)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert b"".join(bytes(entry.bytes) for entry in entries).decode() == text


def test_seeded_sampling_is_repeatable(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         top_p=0.95, seed=seed).choices[0].text

    assert sample(11) == sample(11)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with urllib.request.urlopen(server.openai.url.removesuffix("/v1") + "/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok"}


@pytest.mark.parametrize("path, body, status, words", [
    ("/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "maximum context length"),
    ("/completions", {"model": MODEL, "prompt": "hi " * 600}, 400, "maximum input"),
    ("/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n=2"),
    ("/completions", {"model": MODEL, "prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    ("/completions", {"model": MODEL}, 400, "prompt is required"),
    ("/completions", b"{not json", 400, "not JSON"),
    ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [{"type": "function"}]}, 400, "tools"),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, client, path, body, status, words):
    code, answer = post(server, path, body)
    assert code == status and words in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_a_full_queue_answers_503_and_the_rest_are_served(server):
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 48, "ignore_eos": True}
    with ThreadPoolExecutor(24) as pool:  # the engine's 16 slots + 1 queued + 7 over
        outcomes = list(pool.map(lambda _: post(server, "/completions", body), range(24)))
    codes = sorted(code for code, _ in outcomes)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    assert all(answer["usage"]["completion_tokens"] == 48 for code, answer in outcomes if code == 200)
    assert all("busy" in answer["error"]["message"] and answer["error"]["type"] == "server_error"
               for code, answer in outcomes if code == 503)


def test_a_dropped_stream_frees_its_engine_request(server, client):
    stream = client.completions.create(model=MODEL, prompt="Count to a thousand:", max_tokens=800, stream=True,
                                       extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 3:
            break
    assert wait_for_running(server, 1) == 1
    stream.close()  # the client goes away mid-stream
    assert wait_for_running(server, 0) == 0
    assert metric(server, names.METRIC_KV_BLOCKS, "used") == 0
    # a non-streamed request whose client gives up is ended too
    import openai

    impatient = openai.OpenAI(base_url=server.openai.url, api_key="unused", max_retries=0, timeout=2.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="Count to a thousand:", max_tokens=800,
                                     extra_body={"ignore_eos": True})
    assert wait_for_running(server, 0) == 0
    assert metric(server, names.METRIC_KV_BLOCKS, "used") == 0


@pytest.mark.parametrize("read_to_the_end", [True, False], ids=["stopped", "abandoned"])
def test_an_engine_call_ended_early_is_stopped_not_cut(server, served, read_to_the_end):
    """A stop sequence (stop(), the rest read by chunks()) or a client gone (abandon()): the engine
    ends the request on TensorRT-LLM's `stop` and frees its blocks, and the gRPC call ends with
    status OK, never cancelled (Triton 2.51's handling of cancelled calls can take it down)."""
    import asyncio

    import grpc
    import tritonclient.grpc.aio as grpcaio

    from kiln.triton_repo.openai_engine import EngineCall, EngineRequest

    async def run():
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            call = EngineCall(client, served, EngineRequest(served.encode("Count to a thousand:"), 800,
                                                            ignore_eos=True))
            chunks, got = call.chunks(), 0
            async for _ in chunks:
                got += 1
                if got == 3:
                    break
            started = time.monotonic()
            if read_to_the_end:
                call.stop()
                async for _ in chunks:
                    got += 1
            else:
                call.abandon()
            status = await asyncio.wait_for(call.status(), 30)
            await call.stopping
            return status, got, time.monotonic() - started, call.cancelled
        finally:
            await client.close()

    status, got, took, cut = asyncio.run(run())
    assert status == grpc.StatusCode.OK and not cut, (status, cut)
    assert took < 5 and got < 100, (took, got)  # ended by the stop, long before its 800 tokens
    assert wait_for_running(server, 0) == 0
    assert metric(server, names.METRIC_KV_BLOCKS, "used") == 0


def test_kiln_serve_says_when_the_openai_port_is_taken(repo):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(repo), "--openai-port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert time.monotonic() - started < 60  # refused before tritonserver is started


def _start(command: list[str], timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """A kiln CLI process, once it printed its 'ready:' line (that line)."""
    process = subprocess.Popen([sys.executable, "-m", "kiln.cli", *command], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        lines.append(line)
        if line.startswith("ready:"):
            return process, line
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"{command} did not become ready: {''.join(lines)}")


def _chat(base_url: str, model: str) -> str:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                          temperature=0).choices[0].message.content


def test_kiln_openai_beside_a_running_server(server, served, repo):
    from kiln.triton_repo.serve import free_port

    port = free_port()
    process, ready = _start(["openai", "--url", server.grpc_url, "--repo", str(repo), "--port", str(port),
                             "--served-model-name", MODEL])
    try:
        assert f"http://127.0.0.1:{port}/v1" in ready
        expected = kiln_generate(server, served.chat_template.render(QUESTION), 8)
        assert _chat(f"http://127.0.0.1:{port}/v1", MODEL) == expected
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


def test_kiln_serve_with_an_openai_port(repo, served):
    from kiln.triton_repo.serve import free_port

    ports = [free_port() for _ in range(4)]
    process, ready = _start(["serve", str(repo), "--grpc-port", str(ports[0]), "--http-port", str(ports[1]),
                             "--metrics-port", str(ports[2]), "--openai-port", str(ports[3])])
    try:
        assert f"OpenAI http://127.0.0.1:{ports[3]}/v1" in ready
        # the default model id: the build output folder's name
        expected = "".join(stream_generate(f"127.0.0.1:{ports[0]}", served.chat_template.render(QUESTION), 8))
        assert _chat(f"http://127.0.0.1:{ports[3]}/v1", repo.parent.name) == expected
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
