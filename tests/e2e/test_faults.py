"""The served repository under faults, in the real tritonserver: a start that fails, a backend
process that dies with streams in flight. Whatever happens, no process and no shared memory of
the server stays behind, and clients get errors instead of hanging."""
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.triton_repo.client import stream_generate
from kiln.triton_repo.serve import TritonServer, group_members

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
