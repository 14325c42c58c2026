"""Start the real `tritonserver` on a kiln model repository and wait until it is ready.

On CPU machines the server comes from the `nvidia-pytriton` wheel, which bundles a
tritonserver binary, its Python backend and stubs for each Python version; any other Triton
install can be used by setting KILN_TRITONSERVER (binary) and KILN_TRITON_BACKENDS (a folder
holding python/)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from kiln import constants as names
from kiln.errors import KilnError

READY_TIMEOUT_S = 300.0
# what tritonserver says on every machine without a GPU: harmless, and never the reason it failed
CPU_NOISE = ("CUDA", "Cuda", "NVML", "DCGM", "GPU")


class StartInterrupted(KilnError):
    """TritonServer.start() gave up because request_stop() was called (the server is stopped)."""


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise KilnError(
            "tritonserver not found: pip install nvidia-pytriton (it bundles the CPU server), "
            "or set KILN_TRITONSERVER and KILN_TRITON_BACKENDS"
        )
    return Path(spec.submodule_search_locations[0]) / "tritonserver"


def tritonserver_binary() -> Path:
    env = os.environ.get("KILN_TRITONSERVER")
    return Path(env) if env else _pytriton_root() / "bin" / "tritonserver"


def backend_directory() -> Path:
    """A folder with python/ = libtriton_python.so + utils + the stub for this Python, linked
    from this environment's nvidia-pytriton. The folder is named by what it links to, so servers
    from other environments (other pytriton installs) get folders of their own, and a folder a
    running server uses is never changed."""
    env = os.environ.get("KILN_TRITON_BACKENDS")
    if env:
        return Path(env)
    root = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise KilnError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    sources = [root / "backends" / "python" / "libtriton_python.so",
               root / "backends" / "python" / "triton_python_backend_utils.py", stub]
    key = hashlib.sha256("\n".join(str(p.resolve()) for p in sources).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "triton_backends"
    folder = cache / f"{version}-{key}"
    if (folder / "python").is_dir():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{version}-{key}-", dir=cache))
    (staged / "python").mkdir()
    for source in sources:
        (staged / "python" / source.name).symlink_to(source.resolve())
    try:
        staged.rename(folder)
    except OSError:  # another process made the same folder first
        shutil.rmtree(staged, ignore_errors=True)
    return folder


def server_environment() -> dict[str, str]:
    env = dict(os.environ)
    site_packages = sysconfig.get_paths()["purelib"]
    env["KILN_SITE_PACKAGES"] = site_packages
    # the stub imports numpy before any model: this environment's numpy (<2) must come first
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site_packages, env.get("PYTHONPATH")]))
    libs = []
    try:
        libs.append(str(_pytriton_root().parent.parent / "nvidia_pytriton.libs"))
    except KilnError:
        pass
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        libs.append(libdir)  # libpython for the stub
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs + [env.get("LD_LIBRARY_PATH")]))
    return env


def free_ports(count: int) -> list[int]:
    """count distinct free loopback ports: each socket stays bound until all are picked, so the OS
    cannot hand out one port twice (a server given the same port for HTTP and gRPC refuses to start)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after "pid (comm) " (proc(5)'s third on), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process from /proc, or None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[1]), int(fields[2]))


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, all threads) a process has used so far, from /proc; None when
    it is gone."""
    fields = _stat_fields(pid)  # utime and stime: proc(5)'s fields 14 and 15
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> dict[int, str]:
    """The processes of a process group that are not yet reaped: pid -> state (Z: a zombie)."""
    members = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[2] == pgid:
                members[int(entry.name)] = stat[0]
    return members


def _adopt_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux PR_SET_CHILD_SUBREAPER):
    backend stubs whose server died come to us, so stop() can reap them instead of leaving
    zombies to an init that may never collect them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class TritonServer:
    """A running tritonserver process; use as a context manager so it is always stopped.

    Every way out (a failed start included) ends the server's whole process group, so no Python
    backend stub outlives it, and removes the shared-memory regions its stubs made (named with
    this server's own prefix). `watch()` returns when the server exits or one of its backend
    stubs dies (Triton itself keeps answering ready then), saying which."""

    def __init__(self, repo: str | Path, grpc_port: int | None = None, http_port: int | None = None,
                 metrics_port: int | None = None, log_file: str | Path | None = None, address: str = "127.0.0.1",
                 runtime: dict | None = None):
        """runtime: run-time options for the engine model, over the engine's defaults
        (kv_cache_memory, scheduler, enable_prefix_reuse, max_queue_size, request_timeout, batch_invariant)."""
        self.repo = Path(repo).resolve()
        if not (self.repo / "ensemble").is_dir():
            raise KilnError(f"{self.repo} is not a kiln Triton repository (no ensemble/ folder)")
        picked = iter(free_ports(3))
        self.grpc_port = grpc_port or next(picked)
        self.http_port = http_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self.address = address
        self.runtime = dict(runtime or {})
        self.run_dir = Path(tempfile.mkdtemp(prefix="kiln-serve-"))
        # the server's output always goes to a file, so a failure can say why
        self.log_file = Path(log_file) if log_file else self.run_dir / "tritonserver.log"
        self.shm_prefix = f"kiln{os.getpid()}x{self.grpc_port}_"
        self.process: subprocess.Popen | None = None
        self.stubs: dict[int, str] = {}  # backend stub pid -> its model, seen once the server is ready
        self.failed = False  # set when a start failed or health() found a problem
        # set by request_stop() (a signal handler may call it at any moment): start() and watch()
        # look at it between their steps, so no step (starting the process, a client's request)
        # is cut off halfway, as an exception raised by a signal handler can cut one
        self.stop_requested = threading.Event()

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "::") else self.address

    def command(self) -> list[str]:
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.repo}",
            f"--backend-directory={backend_directory()}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.address}",
            f"--grpc-address={self.address}",
            "--allow-sagemaker=false",
            "--log-verbose=0",
            "--exit-timeout-secs=10",
        ]

    def environment(self) -> dict[str, str]:
        """The server's environment: the serving one, plus what the models read from kiln serve
        (run-time options, and the gRPC address the BLS model streams from the engine through)."""
        env = server_environment()
        if self.runtime:
            env[names.RUNTIME_OPTIONS_ENV] = json.dumps(self.runtime)
        env[names.SERVER_GRPC_URL_ENV] = self.grpc_url
        return env

    def request_stop(self) -> None:
        """Ask start() to give up (it stops the server and raises StartInterrupted) or watch() to
        return None; safe to call from a signal handler."""
        self.stop_requested.set()

    def start(self, timeout: float = READY_TIMEOUT_S) -> "TritonServer":
        _adopt_orphans()
        output = open(self.log_file, "ab")
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        output.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.failed = True
            self.stop()
            raise
        self.stubs = self._find_stubs()
        return self

    def reason(self, lines: int = 6) -> str:
        """The server's own words on what went wrong: its last error lines (or last lines)."""
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        errors = [line for line in text if (line[:1] == "E" and line[1:5].isdigit() or "error" in line.lower())
                  and not any(noise in line for noise in CPU_NOISE)]
        chosen = (errors or text)[-lines:]
        return "\n".join(line.strip() for line in chosen if line.strip()) or "(the server printed nothing)"

    def wait_ready(self, timeout: float) -> None:
        import tritonclient.http as http

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stop_requested.is_set():
                raise StartInterrupted("stopped before the server was ready")
            if self.process.poll() is not None:
                raise KilnError(
                    f"tritonserver exited with code {self.process.returncode} while loading {self.repo}:\n"
                    f"{self.reason()}\n(the whole log: {self.log_file})"
                )
            client = http.InferenceServerClient(self.http_url)
            try:
                if client.is_server_ready():
                    return
            except Exception:  # not listening yet
                pass
            finally:
                client.close()
            time.sleep(0.5)
        raise KilnError(f"tritonserver was not ready after {timeout:.0f}s; its last words:\n{self.reason()}")

    def _find_stubs(self) -> dict[int, str]:
        """The server's Python backend stubs (its children) and the model each serves."""
        stubs = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            stat = _proc_stat(int(entry.name))
            if stat is None or stat[1] != self.process.pid:
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"triton_python_backend_stub") and len(args) > 1:
                stubs[int(entry.name)] = Path(args[1].decode(errors="replace")).parent.parent.name
        return stubs

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the server process ("tritonserver") and by each model's
        backend stub (by model name), for accounting where a benchmark's cores went."""
        used = {"tritonserver": cpu_seconds(self.process.pid) if self.process else None}
        used |= {model: cpu_seconds(pid) for pid, model in self.stubs.items()}
        return {name: seconds for name, seconds in used.items() if seconds is not None}

    def health(self) -> str | None:
        """None while the server and every backend stub it started run; else what stopped."""
        problem = None
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            problem = f"tritonserver exited with code {code}:\n{self.reason()}"
        for pid, model in self.stubs.items():
            stat = _proc_stat(pid)
            if problem is None and (stat is None or stat[0] in "ZX"):
                problem = (f"the Python backend process of model {model!r} (pid {pid}) died; its requests cannot "
                           f"be served and Triton does not restart it")
        self.failed |= problem is not None
        return problem

    def watch(self, interval: float = 1.0, frontend=None) -> str:
        """Block until health() reports a problem, or the frontend beside the server (an
        OpenAIServer) stops; returns what happened (the server is left to stop()), or None once
        request_stop() was called."""
        while not self.stop_requested.is_set():
            problem = self.health()
            if problem is not None:
                return problem
            if frontend is not None and not frontend.alive():
                return "the OpenAI frontend stopped"
            self.stop_requested.wait(interval)
        return None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Python backend stubs still busy with a request when the server gave up waiting
        # (--exit-timeout-secs), or left by a server that died, outlive it in its process group
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 10
        while True:  # every member dead, and reaped where it came to us (_adopt_orphans)
            pending = False
            for pid, state in group_members(self.process.pid).items():
                if state not in "ZX":
                    pending = True
                    continue
                try:  # a zombie leader whose threads are still exiting cannot be reaped yet
                    pending |= os.waitpid(pid, os.WNOHANG)[0] == 0
                except ChildProcessError:  # not ours: its parent (or init) reaps it
                    pass
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        if self.log_file.parent != self.run_dir or not self.failed:  # a failure's log stays to be read
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self):
        return self.start() if self.process is None else self

    def __exit__(self, *exc):
        self.stop()
