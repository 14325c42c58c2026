"""The generated repository in the real tritonserver, called with the real tritonclient."""
import json
import os
import urllib.request

import pytest

from kiln import constants as names
from kiln.errors import KilnError
from kiln.triton_repo.client import stream_generate
from kiln.triton_repo.serve import TritonServer

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write the word 'hello' in Japanese and add an emoji:"]


@pytest.fixture(scope="module")
def engine_dir(smollm2_engines):
    # float32: its greedy tokens do not depend on what else is in the batch, so concurrent
    # requests can be compared token for token with requests run alone
    return smollm2_engines("float32")


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    with TritonServer(engine_dir.parent / "triton_repo", log_file=log) as running:
        yield running
    assert running.process.poll() is not None  # the test always stops it
    with pytest.raises(ProcessLookupError):  # and its Python backend stubs
        os.killpg(running.process.pid, 0)


@pytest.fixture(scope="module")
def llm(engine_dir, llm_for):
    return llm_for(engine_dir)


def http_post(server, path, body):
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read().decode()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_equals_llm_generate(server, llm, prompt):
    chunks = list(stream_generate(server.grpc_url, prompt, max_tokens=40))
    assert len(chunks) > 1  # streamed, not one blob
    assert "".join(chunks) == llm.generate(prompt, max_tokens=40).text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_http_generate_stream_equals_llm_generate(server, llm, prompt):
    body = http_post(server, "/v2/models/ensemble/generate_stream",
                     {"text_input": prompt, "max_tokens": 40, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == llm.generate(prompt, max_tokens=40).text


def test_http_generate_non_streaming(server, llm):
    """As in TensorRT-LLM, a non-streamed answer starts with the prompt unless
    exclude_input_in_output is set."""
    body = json.loads(http_post(server, "/v2/models/ensemble/generate",
                                {"text_input": PROMPTS[0], "max_tokens": 20}))
    assert body["text_output"] == PROMPTS[0] + llm.generate(PROMPTS[0], max_tokens=20).text


def test_seeded_sampling_over_grpc_is_repeatable(server):
    sampled = ["".join(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=16, temperature=1.0,
                                       top_p=0.9, seed=1234)) for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_request_over_the_limits_gets_an_error_and_the_server_stays_up(server, llm):
    too_long = "word " * 600  # over max_input_len 512
    with pytest.raises(KilnError, match="max_input_len 512"):
        list(stream_generate(server.grpc_url, too_long, max_tokens=4))
    with pytest.raises(KilnError, match="max_seq_len 1024"):
        list(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=2000))
    with pytest.raises(KilnError, match="max_tokens must be >= 1"):
        list(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=0))
    with pytest.raises(KilnError, match="top_p must be in"):
        list(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=4, top_p=1.5))
    assert "".join(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=8)) == llm.generate(PROMPTS[0], max_tokens=8).text


def test_concurrent_grpc_streams_equal_one_at_a_time(server, llm):
    """16 streams at once are batched in flight and give the same text as each alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{start} {topic}" for start in ("Tell me about", "A short poem on", "Facts about", "Why do we love")
               for topic in ("the sea", "mountains", "cats", "bread")]
    alone = [llm.generate(p, max_tokens=24).text for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: "".join(stream_generate(server.grpc_url, p, max_tokens=24)), prompts))
    assert together == alone


def test_cpu_seconds_account_for_the_server_and_each_model(server):
    """What benchmarks/serving.py reports as where the cores went: a stream costs the engine model
    CPU time, and every model of the repository is accounted for."""
    before = server.cpu_seconds()
    chunks = list(stream_generate(server.grpc_url, PROMPTS[0], max_tokens=40))
    after = server.cpu_seconds()
    assert len(chunks) > 1
    models = names.MODEL_NAME_SETS["kiln"]
    engine = models[names.ROLE_ENGINE]
    assert {"tritonserver", engine, models[names.ROLE_PREPROCESSING], models[names.ROLE_POSTPROCESSING]} <= set(after)
    assert after[engine] - before[engine] >= 0.01, (before, after)  # 40 float32 decode steps: over a tick
    assert all(after[name] >= before[name] for name in before), (before, after)


def test_stream_interval_sends_fewer_responses_with_the_same_text(engine_dir, llm, tmp_path):
    """runtime.stream_interval 4 (kiln serve --stream-interval 4), 8 streams at once over gRPC:
    each gets the text it gets alone, in at most 7 text chunks for 24 tokens (the first token
    alone, then 4 a response, the rest with the end) where a response a token gives one a token."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{start} {topic}" for start in ("Tell me about", "Facts about") for topic in
               ("the sea", "mountains", "cats", "bread")]
    alone = [llm.generate(p, max_tokens=24, end_id=-1).text for p in prompts]
    with TritonServer(engine_dir.parent / "triton_repo", log_file=tmp_path / "tritonserver.log",
                      runtime={"stream_interval": 4}) as running:
        with ThreadPoolExecutor(8) as pool:
            chunks = list(pool.map(lambda p: list(stream_generate(running.grpc_url, p, max_tokens=24,
                                                                   end_id=-1)), prompts))
    assert ["".join(c) for c in chunks] == alone
    assert all(len(c) <= 2 + (24 - 2) // 4 for c in chunks), [len(c) for c in chunks]
    assert all(len(c) >= 2 for c in chunks), [len(c) for c in chunks]
