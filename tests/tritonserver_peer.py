"""NVIDIA's tritonserver 2.51, as the nvidia-pytriton wheel ships it, started on a model
repository for the parity tests: the same requests go to it and to us, and the answers are
compared. Runs on CPU; the wheel lives in a venv of its own (it pins numpy<2), found at
$JUPYTER_TRITON_PYTRITON_VENV (./dev test installs it) or ~/.cache/jupyter-triton-bench/.

What it takes to run that tritonserver outside PyTriton (facts of these machines):
* its python backend's stub is shipped per Python version and must sit next to
  libtriton_python.so; the server's libraries are found through LD_LIBRARY_PATH, the
  stub's libpython through the venv interpreter's LIBDIR;
* the stub's embedded interpreter ignores PYTHONPATH and finds its site-packages from
  the first ``python3`` on PATH: the venv's must come first, or the stub imports the
  machine's numpy 2, with which Triton 2.51's python backend returns empty outputs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

VENV = Path(os.environ.get("JUPYTER_TRITON_PYTRITON_VENV")
            or Path.home() / ".cache" / "jupyter-triton-bench" / "pytriton-venv")


def _venv_python_info() -> tuple[str, str, Path] | None:
    python = VENV / "bin" / "python"
    if not python.exists():
        return None
    try:
        out = subprocess.run(
            [str(python), "-c", "import sys, sysconfig, pytriton; print(f'{sys.version_info[0]}."
             "{sys.version_info[1]}'); print(sysconfig.get_config_var('LIBDIR') or ''); "
             "print(pytriton.__file__)"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    version, libdir, module = out.stdout.split("\n")[:3]
    return version, libdir, Path(module).parent


def tritonserver_dist() -> tuple[Path, str, str]:
    """(the wheel's tritonserver directory, the venv's Python version, its LIBDIR), or
    skip the calling test with the reason."""
    info = _venv_python_info()
    if info is None:
        pytest.skip(f"nvidia-pytriton (tritonserver 2.51) is not installed in {VENV} "
                    "(./dev test installs it; JUPYTER_TRITON_PYTRITON_VENV points elsewhere)")
    version, libdir, module = info
    dist = module / "tritonserver"
    if not (dist / "bin" / "tritonserver").exists():
        pytest.skip(f"{dist} has no bin/tritonserver")
    if not (dist / "python_backend_stubs" / version / "triton_python_backend_stub").exists():
        pytest.skip(f"nvidia-pytriton ships no python backend stub for Python {version}")
    return dist, version, libdir



class TritonServer:
    """One tritonserver process on 127.0.0.1 (explicit model control)."""

    def __init__(self, repository: Path, workdir: Path, load: list[str] | tuple[str, ...] = (),
                 extra_args: list[str] | tuple[str, ...] = (), control: str = "explicit",
                 packages: list[Path] | tuple[Path, ...] = ()) -> None:
        """``packages``: modules a Triton image would have pip-installed (cloudpickle for
        notebook callables); the stub's sys.path ends with its working directory, where
        they are linked."""
        dist, version, libdir = tritonserver_dist()
        backends = workdir / "backends"
        python_dir = backends / "python"
        if not python_dir.exists():
            python_dir.mkdir(parents=True)
            for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
                shutil.copy(dist / "backends" / "python" / name, python_dir / name)
            shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub",
                        python_dir / "triton_python_backend_stub")
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        env = dict(os.environ)
        libs = dist.parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), libdir, env.get("LD_LIBRARY_PATH"))
                                          if p)
        env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
        cwd = workdir / "packages"
        cwd.mkdir(exist_ok=True)
        for package in packages:
            if not (cwd / package.name).exists():
                (cwd / package.name).symlink_to(package)
        args = [str(dist / "bin" / "tritonserver"), f"--model-repository={repository}",
                f"--backend-directory={backends}", f"--cache-directory={dist / 'caches'}",
                "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
                f"--model-control-mode={control}", "--exit-timeout-secs=5",
                *[f"--load-model={m}" for m in load], *extra_args]
        self.log = workdir / "tritonserver.log"
        self._log_file = open(self.log, "wb")
        self.process = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        env=env, cwd=cwd, start_new_session=True)
        self._wait_ready(120.0)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}):\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.url}/v2/health/live", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"tritonserver not live within {seconds:g} s:\n"
                           f"{self.log.read_text(errors='replace')[-3000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log_file.close()


def call(base: str, method: str, path: str, body: object | None = None) -> tuple[int, object]:
    """(status, decoded JSON body or None) of one raw HTTP call; ``base`` is host:port."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"http://{base}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")
