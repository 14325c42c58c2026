"""Start the real `tritonserver` on a kiln model repository and wait until it is ready.

On CPU machines the server comes from the `nvidia-pytriton` wheel, which bundles a
tritonserver binary, its Python backend and stubs for each Python version; any other Triton
install can be used by setting KILN_TRITONSERVER (binary) and KILN_TRITON_BACKENDS (a folder
holding python/)."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from kiln.errors import KilnError

READY_TIMEOUT_S = 300.0


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
    """A folder with python/ = libtriton_python.so + utils + the stub for this Python."""
    env = os.environ.get("KILN_TRITON_BACKENDS")
    if env:
        return Path(env)
    root = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise KilnError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    cache = Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln"))
    folder = cache / "triton_backends" / version
    python = folder / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (root / "backends" / "python" / "libtriton_python.so",
                   root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        link = python / source.name
        if not link.exists() or link.resolve() != source.resolve():
            link.unlink(missing_ok=True)
            link.symlink_to(source)
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A running tritonserver process; use as a context manager so it is always stopped."""

    def __init__(self, repo: str | Path, grpc_port: int | None = None, http_port: int | None = None,
                 metrics_port: int | None = None, log_file: str | Path | None = None):
        self.repo = Path(repo).resolve()
        if not (self.repo / "ensemble").is_dir():
            raise KilnError(f"{self.repo} is not a kiln Triton repository (no ensemble/ folder)")
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file = Path(log_file) if log_file else None
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.repo}",
            f"--backend-directory={backend_directory()}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--allow-sagemaker=false",
            "--log-verbose=0",
            "--exit-timeout-secs=10",
        ]

    def start(self, timeout: float = READY_TIMEOUT_S) -> "TritonServer":
        output = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), env=server_environment(), stdout=output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import tritonclient.http as http

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KilnError(
                    f"tritonserver exited with code {self.process.returncode} while loading "
                    f"{self.repo}" + (f"; see {self.log_file}" if self.log_file else "")
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
        self.stop()
        raise KilnError(f"tritonserver was not ready after {timeout:.0f}s")

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
        # (--exit-timeout-secs) outlive it in its process group: end them too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self):
        return self.start() if self.process is None else self

    def __exit__(self, *exc):
        self.stop()

