"""`jupyter-triton serve` with tritonserver's restricted-API flags, as an operator runs it:
the repository API (load runs code) behind a header, inference left open; --grpc-address
honoured; a loud warning when the repository API is open on a non-loopback address."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import W
from jupyter_triton.cli import build_parser, warn_open_repository
from onnx_models import linear
from ports import free_port

ADMIN = {"admin-key": "s3cret"}


def start(model_repo: Path, *flags: str) -> tuple[subprocess.Popen, int, int]:
    http, grpc_port = free_port(), free_port()
    exe = str(Path(sys.executable).parent / "jupyter-triton")
    proc = subprocess.Popen(
        [exe, "serve", "--model-repository", str(model_repo), "--http-address", "127.0.0.1",
         "--grpc-address", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc_port),
         "--allow-metrics", "false", "--model-control-mode", "explicit", "--load-model", "linear",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                if client.is_server_ready():
                    return proc, http, grpc_port
            except Exception:  # not listening yet
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
    finally:
        client.close()
    stop(proc)
    raise AssertionError("jupyter-triton serve did not become ready in 60 s")


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.decode()


def one_row(module) -> list:
    inp = module.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [inp]


def test_restricted_repository_api_over_http_and_grpc(model_repo: Path):
    proc, http, grpc_port = start(model_repo, "--http-restricted-api", "model-repository:admin-key=s3cret",
                                  "--grpc-restricted-protocol", "model-repository:admin-key=s3cret")
    config = json.dumps({"name": "copy", "backend": "onnxruntime", "max_batch_size": 8})
    files = {"file:1/model.onnx": linear(W)}
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        with pytest.raises(InferenceServerException) as err:
            c.load_model("copy", config=config, files=files)
        assert err.value.status() == "403"
        assert "This API is restricted, expecting header 'admin-key'" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            c.load_model("copy", config=config, files=files, headers={"admin-key": "wrong"})
        assert err.value.status() == "403"
        assert not (model_repo / "copy").exists()                     # nothing was written
        c.load_model("copy", config=config, files=files, headers=dict(ADMIN))
        assert c.is_model_ready("copy")
        np.testing.assert_allclose(c.infer("copy", one_row(httpclient)).as_numpy("OUTPUT0"),
                                   np.ones((1, 16), np.float32) @ W, rtol=1e-5)
        assert c.get_inference_statistics("linear")["model_stats"]      # statistics: not restricted
        c.close()

        g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException) as err:
            g.unload_model("copy")
        assert err.value.status() == str(grpc.StatusCode.PERMISSION_DENIED)
        np.testing.assert_allclose(g.infer("linear", one_row(grpcclient)).as_numpy("OUTPUT0"),
                                   np.ones((1, 16), np.float32) @ W, rtol=1e-5)
        g.unload_model("copy", headers=dict(ADMIN))
        assert not g.is_model_ready("copy")
        g.close()
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert "model-repository API" not in out             # loopback only: no warning


def test_grpc_address_is_the_address_grpc_binds(model_repo: Path):
    proc, _, grpc_port = start(model_repo, "--grpc-address", "127.0.0.2")
    try:
        g = grpcclient.InferenceServerClient(f"127.0.0.2:{grpc_port}")
        assert g.is_model_ready("linear")
        g.close()
        refused = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException):
            refused.is_server_live(client_timeout=5)
        refused.close()
    finally:
        stop(proc)


@pytest.mark.parametrize("taken_one", ["http", "grpc"])
def test_a_taken_port_fails_the_start_and_frees_the_others(model_repo: Path, taken_one: str):
    """A start whose HTTP or gRPC port is taken fails with the bind's error, and the other
    port is let go (the kernel fallback starts again in the same process)."""
    import socket
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = {"http": free_port(), "grpc": free_port(), taken_one: taken.getsockname()[1]}
    try:
        with pytest.raises(OSError):
            start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit"),
                            http_port=ports["http"], metrics_port=None, grpc_port=ports["grpc"])
        other = ports["grpc" if taken_one == "http" else "http"]
        again = socket.socket()
        again.bind(("127.0.0.1", other))          # raises while anything still holds it
        again.close()
    finally:
        taken.close()


def test_an_open_repository_api_on_a_public_address_is_announced(capsys):
    def warned(*argv: str) -> list[str]:
        args = build_parser().parse_args(["serve", "--model-repository", "/m", *argv])
        return warn_open_repository(args)

    lines = warned("--model-control-mode", "explicit")      # tritonserver's 0.0.0.0 defaults
    assert len(lines) == 2 and "HTTP 0.0.0.0" in lines[0] and "gRPC 0.0.0.0" in lines[1]
    assert all("--http-restricted-api" in lines[0] and "model-repository" in line for line in lines)
    assert lines[0] in capsys.readouterr().err
    assert len(warned("--model-control-mode", "explicit",
                      "--http-restricted-api", "model-repository,inference:k=v")) == 1
    assert warned("--model-control-mode", "explicit", "--http-address", "127.0.0.1",
                  "--grpc-address", "::1") == []
    assert warned("--model-control-mode", "none") == []       # load/unload refused anyway
    assert warned("--model-control-mode", "explicit", "--http-address", "localhost",
                  "--allow-grpc", "false") == []


@pytest.mark.parametrize("flag", ["--http-restricted-api", "--grpc-restricted-protocol"])
@pytest.mark.parametrize("spec", ["model-repository", "nonsense:k=v", "inference:=v"])
def test_a_malformed_restriction_is_a_usage_error(flag, spec):
    proc = subprocess.run([sys.executable, "-m", "jupyter_triton.cli", "serve", "--model-repository",
                           "/nonexistent", flag, spec], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert proc.returncode == 2 and f"argument {flag}" in proc.stderr, proc.stderr
