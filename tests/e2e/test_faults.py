"""The served repository under faults, in the real tritonserver: a start that fails, a backend
process that dies with streams in flight. Whatever happens, no process and no shared memory of
the server stays behind, and clients get errors instead of hanging."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln import constants as names
from kiln.errors import KilnError
from kiln.triton_repo.client import stream_generate
from kiln.triton_repo.serve import TritonServer, group_members
from tests.helpers import metric, wait_for_running

pytestmark = pytest.mark.slow


def assert_nothing_left(server):
    assert group_members(server.process.pid) == {}  # every process of the server ended and reaped
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_a_failed_start_says_why_and_leaves_nothing(tiny_engines):
    repo = tiny_engines("llama").parent / "triton_repo"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = TritonServer(repo, http_port=taken.getsockname()[1])
        with pytest.raises(KilnError, match="already in use"):
            server.start(timeout=120)
    assert_nothing_left(server)


def test_kiln_serve_stopped_while_starting_leaves_nothing(tiny_engines):
    """SIGTERM while tritonserver loads the models (a supervisor giving up on a slow start):
    kiln serve stops the server it started, its backend stubs included, and exits 130."""
    from kiln.triton_repo.serve import _proc_stat, free_ports

    repo = tiny_engines("llama").parent / "triton_repo"
    ports = [str(port) for port in free_ports(3)]
    process = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(repo), "--grpc-port", ports[0],
                                "--http-port", ports[1], "--metrics-port", ports[2]], stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stderr.readline().startswith("starting tritonserver")
        deadline, server = time.monotonic() + 60, None
        while server is None and time.monotonic() < deadline:  # kiln serve's child, in a group of its own
            server = next((int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()
                           and (_proc_stat(int(entry.name)) or ("", 0, 0))[1] == process.pid), None)
            time.sleep(0.05)
        assert server is not None, "kiln serve started no server"
        process.send_signal(signal.SIGTERM)  # the models take seconds to load: before 'ready:'
        code, said = process.wait(60), process.stderr.read()
        assert code == 130, said
        assert "stopped before the server was ready" in said and "ready:" not in said, said
    finally:
        if process.poll() is None:
            process.kill()
    assert group_members(server) == {}  # the server and its stubs ended and reaped


def test_a_signal_while_the_server_process_is_being_started_stops_it(tiny_engines, monkeypatch):
    """SIGTERM landing inside the call that starts tritonserver (the process exists, the call has
    not returned: the race a supervisor's early SIGTERM can hit): kiln serve still stops that
    server and exits 130. (A handler that raised there left the server running, unrecorded.)"""
    from kiln import cli

    repo = tiny_engines("llama").parent / "triton_repo"
    started, real_popen = [], subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        process = real_popen(*args, **kwargs)
        started.append(process)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this call returns
        time.sleep(0.2)
        return process

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(subprocess, "Popen", popen_then_signal)
    try:
        code = cli.main(["serve", str(repo)])
        left = {process.pid: group_members(process.pid) for process in started}
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        monkeypatch.undo()
        for process in started:  # (left running only where the test fails)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert code == 130 and len(started) == 1
    assert left == {started[0].pid: {}}, left  # the server and its stubs ended and reaped


def test_a_dead_engine_process_is_noticed_and_its_streams_get_errors(smollm2_engines):
    repo = smollm2_engines("float32").parent / "triton_repo"
    server = TritonServer(repo).start()
    try:
        outcomes, started = {}, threading.Semaphore(0)

        def stream(i):
            try:
                for j, _ in enumerate(stream_generate(server.grpc_url, f"Count to a thousand: {i}", 400,
                                                      end_id=-1, timeout=60)):  # never ends early
                    if j == 0:
                        started.release()
                outcomes[i] = "finished"
            except KilnError as exc:
                outcomes[i] = f"error: {exc}"
                started.release()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        (engine_pid,) = [pid for pid, model in server.stubs.items() if model == "kiln"]
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        problem = server.watch(interval=0.2)
        assert "'kiln'" in problem and time.monotonic() - killed < 5
        server.stop(timeout=1)  # what kiln serve does then
        for t in threads:
            t.join(timeout=max(0.1, killed + 5 - time.monotonic()))
        assert not any(t.is_alive() for t in threads)  # every stream got its error within 5 s
        assert all(outcome.startswith("error") for outcome in outcomes.values()), outcomes
    finally:
        server.stop()
    assert_nothing_left(server)


class InProcessBlsServer(TritonServer):
    """A server whose BLS model is not told the server's gRPC address: as in a tritonserver
    started by hand, it calls the engine model in process (Triton's decoupled BLS calls)."""

    def environment(self):
        env = super().environment()
        del env[names.SERVER_GRPC_URL_ENV]
        return env


def http_generate(server, model: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())["text_output"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("server_kind", [TritonServer, InProcessBlsServer], ids=["bls_over_grpc", "bls_in_process"])
def test_a_full_queue_is_unavailable_and_the_rest_are_served(smollm2_engines, server_kind):
    """Overload: with room for one queued request, a burst of requests past the engine's batch
    gets a 'busy' refusal from the ensemble and the BLS model alike, the others their text.
    (The engine says UNAVAILABLE; Triton 2.51's generate endpoint answers 400 for any model
    error, a later one may say 503.) Afterwards both serve the same text as before."""
    repo = smollm2_engines("float32").parent / "triton_repo"
    body = {"text_input": "Write a long story about a dragon.", "max_tokens": 48, "end_id": -1}
    with server_kind(repo, runtime={"max_queue_size": 1}) as server:
        for model in ("ensemble", "kiln_bls"):  # a burst each: the engine's 16 slots + 1 queued + 7
            with ThreadPoolExecutor(24) as pool:
                outcomes = list(pool.map(lambda _: http_generate(server, model, body), range(24)))
            codes = sorted(code for code, _ in outcomes)
            assert 200 in codes and set(codes) - {200} and set(codes) - {200} <= {400, 503}, (model, codes)
            refused = [text for code, text in outcomes if code != 200]
            assert all("busy" in text for text in refused), refused[:3]
        calm = {**body, "max_tokens": 8}
        assert http_generate(server, "kiln_bls", calm) == http_generate(server, "ensemble", calm)
        assert http_generate(server, "kiln_bls", calm)[0] == 200


def test_cancelled_engine_streams_leave_no_thread_behind(smollm2_engines, monkeypatch):
    """The BLS model's gRPC stream from the engine model (GrpcEngine), its client cancelling
    mid-stream three times: the stream carries a `stop` and ends, every thread it started ends,
    and the engine request with it. (tritonclient's cancelling stop_stream, kept for an engine
    that does not stop in time, left gRPC's request thread waiting for good: a thread and about
    30 KB stayed in the BLS process per cancelled stream.)"""
    from kiln.triton_repo import client
    from kiln.triton_repo.engine_calls import GrpcEngine
    from kiln.triton_repo.openai_engine import EngineRequest

    cut = []  # the streams are stopped (TensorRT-LLM's `stop`), not cut: Triton 2.51 can crash on a cut
    monkeypatch.setattr(client, "cancel_stream", lambda grpc_client: cut.append(grpc_client))
    repo = smollm2_engines("float32").parent / "triton_repo"
    with TritonServer(repo) as server:
        engine = GrpcEngine(server.grpc_url, names.MODEL_NAME_SETS["kiln"][names.ROLE_ENGINE])
        inputs = EngineRequest(prompt_ids=[1, 2, 3, 4, 5], max_tokens=800, ignore_eos=True).tensors()
        before = {t.ident: t.name for t in threading.enumerate()}
        for i in range(3):
            cancelled = threading.Event()
            stream = engine.stream(inputs, f"cancelled-{i}", cancelled.is_set)
            assert names.OUTPUT_IDS in next(stream)
            cancelled.set()
            for _ in stream:  # what was already on its way may still arrive; then the stream ends
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = {t.ident: t.name for t in threading.enumerate() if t.ident not in before}
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"threads left behind by cancelled streams: {sorted(left.values())}"
        assert wait_for_running(server, 0) == 0
        assert cut == []


@pytest.mark.parametrize("server_kind", [TritonServer, InProcessBlsServer], ids=["bls_over_grpc", "bls_in_process"])
def test_a_cancelled_bls_stream_ends_its_engine_request(smollm2_engines, server_kind):
    import queue

    import tritonclient.grpc as grpcclient

    from kiln.triton_repo.client import ensemble_inputs

    repo = smollm2_engines("float32").parent / "triton_repo"
    with server_kind(repo) as server:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("kiln_bls", ensemble_inputs("Count to a thousand:", 800, True, end_id=-1))
        result, error = results.get(timeout=120)
        assert error is None
        assert wait_for_running(server, 1) == 1
        client.stop_stream(cancel_requests=True)
        client.close()
        assert wait_for_running(server, 0) == 0
        assert http_generate(server, "kiln_bls", {"text_input": "Hello", "max_tokens": 4})[0] == 200


def test_request_timeout_bounds_an_abandoned_ensemble_stream(smollm2_engines):
    """Triton 2.51 does not tell an ensemble's steps that their client went away: a cancelled
    ensemble stream runs on in the engine. kiln serve --request-timeout ends it (and frees its KV
    blocks) that long after it arrived; a request that finishes in time is untouched."""
    import queue

    import tritonclient.grpc as grpcclient

    from kiln.triton_repo.client import ensemble_inputs

    repo = smollm2_engines("float32").parent / "triton_repo"
    timeout = 4.0
    with TritonServer(repo, runtime={"request_timeout": timeout}) as server:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        arrived = time.monotonic()
        client.async_stream_infer("ensemble", ensemble_inputs("Count to a thousand:", 900, True, end_id=-1))
        assert results.get(timeout=120)[1] is None
        assert wait_for_running(server, 1) == 1
        client.stop_stream(cancel_requests=True)
        client.close()
        assert wait_for_running(server, 0, timeout=timeout + 10) == 0
        ended = time.monotonic() - arrived
        assert ended < timeout + 5, ended  # 900 tokens would take the float32 engine far longer
        time.sleep(0.6)  # the gauges refresh every 0.5 s
        assert metric(server, names.METRIC_KV_BLOCKS, "used") == 0
        assert http_generate(server, "ensemble", {"text_input": "Hello", "max_tokens": 4})[0] == 200


@pytest.mark.parametrize("scheduler", ["max_utilization", "guaranteed_no_evict"])
def test_a_kv_pool_too_small_for_the_load_preempts_or_queues_and_serves_everyone(smollm2_engines, scheduler,
                                                                                 tmp_path):
    """16 requests of ~200 tokens at once against a KV pool of 68 blocks (room for about four of
    them): max_utilization admits what fits and preempts (recomputes) when blocks run out,
    guaranteed_no_evict admits only what it can finish; either way every request gets its
    full-length text and the pool ends empty. The served engine's step log (runtime.step_log)
    shows the steps batched and every generated token decoded but each request's first and
    those after a preemption."""
    import json

    from pydoc_data.topics import topics

    repo = smollm2_engines("float32").parent / "triton_repo"
    text = " ".join(topics["assert"].split())[:600]
    step_log = tmp_path / "steps.jsonl"
    with TritonServer(repo, runtime={"kv_cache_memory": "48MiB", "scheduler": scheduler,
                                     "step_log": str(step_log)}) as server:
        def one(i):
            return http_generate(server, "ensemble", {"text_input": f"Request {i}. {text}", "max_tokens": 64,
                                                      "end_id": -1})

        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, range(16)))
        assert [code for code, _ in outcomes] == [200] * 16, outcomes[:2]
        assert all(len(out) > 64 for _, out in outcomes), [out[:80] for _, out in outcomes]
        preemptions = metric(server, names.METRIC_PREEMPTIONS)
        if scheduler == "max_utilization":
            assert preemptions > 0
        else:
            assert preemptions == 0
        time.sleep(1)  # the gauges refresh every 0.5 s
        assert wait_for_running(server, 0) == 0
        assert metric(server, names.METRIC_KV_BLOCKS, "used") == 0
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert max(step["sequences"] for step in steps) > 1
    # a preempted sequence's next token comes from its recomputation, not a decode step
    decoded = sum(step["decode_tokens"] for step in steps)
    assert 16 * 63 - preemptions <= decoded <= 16 * 63, (decoded, preemptions, len(steps))
