"""kiln serve's launcher, without starting a server: the Python backend folder it assembles."""
import os
import sys

from kiln.triton_repo import serve


def fake_pytriton(root):
    """The files of an nvidia-pytriton install that the backend folder links to."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    (root / "backends" / "python").mkdir(parents=True)
    (root / "python_backend_stubs" / version).mkdir(parents=True)
    for path in (root / "backends" / "python" / "libtriton_python.so",
                 root / "backends" / "python" / "triton_python_backend_utils.py",
                 root / "python_backend_stubs" / version / "triton_python_backend_stub"):
        path.write_text(str(root))
    return root


def test_each_environment_gets_its_own_backend_folder_and_none_changes(tmp_path, monkeypatch):
    """A server from another environment (another pytriton) must not re-point the links a running
    server uses: each install gets a folder of its own, made once."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_TRITON_BACKENDS", raising=False)
    first_env, second_env = fake_pytriton(tmp_path / "env1"), fake_pytriton(tmp_path / "env2")
    monkeypatch.setattr(serve, "_pytriton_root", lambda: first_env)
    first = serve.backend_directory()
    links = {p.name: os.readlink(p) for p in (first / "python").iterdir()}
    assert all(target.startswith(str(first_env)) for target in links.values())
    monkeypatch.setattr(serve, "_pytriton_root", lambda: second_env)
    second = serve.backend_directory()
    assert second != first
    assert all(os.readlink(p).startswith(str(second_env)) for p in (second / "python").iterdir())
    assert {p.name: os.readlink(p) for p in (first / "python").iterdir()} == links  # untouched
    monkeypatch.setattr(serve, "_pytriton_root", lambda: first_env)
    assert serve.backend_directory() == first


def test_cpu_seconds_grows_with_work_and_is_none_for_a_process_gone():
    import subprocess
    import time

    before = serve.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # 0.2 s of this process's CPU time
        pass
    after = serve.cpu_seconds(os.getpid())
    assert 0.15 <= after - before <= 5.0, (before, after)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited and reaped: /proc has it no more
    assert serve.cpu_seconds(child.pid) is None
