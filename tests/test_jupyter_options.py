"""The server extension's options, set as a user sets them: traits of ``c.JupyterTriton``
(the engine's lifecycle options and the HTTP bounds), and the gRPC port of a real
``jupyter server`` / ``jupyter lab`` command, found where the extension says it is."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tornado.httpclient import HTTPClientError
from traitlets import TraitError
from tritonclient.utils import InferenceServerException

from conftest import TOKEN, W, in_thread
from jupyter_triton.frontends.http import SETTINGS_KEY
from jupyter_triton.serverext import JupyterTriton
from onnx_models import linear
from server_waits import until

AUTH = {"Authorization": f"token {TOKEN}"}
COPY_CONFIG = json.dumps({"name": "copy", "backend": "onnxruntime", "max_batch_size": 8})


@pytest.fixture
def jp_server_config(jp_server_config, model_repo: Path):
    (model_repo / "broken" / "1").mkdir(parents=True)
    (model_repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    return {**jp_server_config,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "strict_readiness": False,
                              "keep_versions": 1, "max_output_size": 8, "body_timeout": 1.0,
                              "max_inflight_bytes": 50_000}}


def client(port: int, base: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{port}{base.rstrip('/')}", network_timeout=60)


async def test_lifecycle_traits_reach_the_engine(jp_triton, jp_http_port, jp_base_url, model_repo):
    def story() -> None:
        c = client(jp_http_port, jp_base_url)
        try:
            # strict_readiness False: ready although 'broken' (asked for by load_models) failed
            assert not c.is_model_ready("broken", headers=dict(AUTH))
            assert c.is_server_ready(headers=dict(AUTH))
            # keep_versions 1: after two uploads only the newest version stays on disk
            for scale in (1.0, 2.0):
                c.load_model("copy", config=COPY_CONFIG, headers=dict(AUTH),
                             files={"file:1/model.onnx": linear(W * scale)})
            assert sorted(p.name for p in (model_repo / "copy").iterdir() if p.name.isdigit()) == ["2"]
            # max_output_size 8: a 1x4 FP32 output (16 bytes) is refused
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            with pytest.raises(InferenceServerException) as err:
                c.infer("linear", [inp], headers=dict(AUTH))
            assert err.value.status() == "503" and "max_output_size" in err.value.message()
        finally:
            c.close()

    await in_thread(story)


def _open_body(port: int, base: str, length: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(f"POST {base}v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                 f"Authorization: token {TOKEN}\r\nContent-Length: {length}\r\n\r\n".encode() + first)
    return sock


async def test_body_timeout_and_max_inflight_bytes_traits(jp_triton, jp_fetch, jp_http_port, jp_base_url):
    slow = _open_body(jp_http_port, jp_base_url, 40_000, b"{")       # holds 40,000 of 50,000
    t0 = time.monotonic()
    budget = jp_triton.web_app.settings[SETTINGS_KEY].plane.budget
    await until(lambda: budget.held == 40_000, "the slow body's bytes held")
    big = b" " * 20_000
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=big, headers=AUTH)
    assert err.value.code == 503
    assert "limit of 50000 bytes in flight" in json.loads(err.value.response.body)["error"]
    data = b""
    while chunk := await asyncio.to_thread(slow.recv, 65536):       # then the 1 s deadline cuts it
        data += chunk
    slow.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert "not received within 1 s" in json.loads(body)["error"]
    assert time.monotonic() - t0 < 10


def test_negative_bounds_are_refused():
    for trait in ("exit_timeout_secs", "unload_timeout_secs", "max_output_size", "keep_versions",
                  "body_timeout", "max_inflight_bytes"):
        with pytest.raises(TraitError, match=f"{trait} must be 0 or more"):
            JupyterTriton(**{trait: -1})


# ---- the gRPC port of a real command line ----------------------------------------------------

def _jupyter(tmp_path: Path, app: str, *args: str) -> tuple[subprocess.Popen, dict]:
    """``jupyter <app>`` with its own config and runtime dirs; returns it and the runtime
    file the extension wrote."""
    runtime = tmp_path / "runtime"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(runtime))
    exe = str(Path(sys.executable).parent / "jupyter")
    proc = subprocess.Popen([exe, app, "--no-browser", "--port=0", f"--IdentityProvider.token={TOKEN}",
                             "--allow-root", *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for path in runtime.glob("jupyter_triton-*.json"):
            try:
                return proc, json.loads(path.read_text())
            except ValueError:        # being written
                pass
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        time.sleep(0.2)
    _stop(proc)
    raise AssertionError(f"jupyter {app} wrote no jupyter_triton runtime file in 90 s")


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.decode()


@pytest.mark.parametrize("how", ["server-command-line", "lab-config-file", "lab-defaults"])
def test_the_grpc_port_of_a_real_jupyter_command(tmp_path: Path, how: str):
    repo = tmp_path / "models"
    linear(W, repo / "linear" / "1" / "model.onnx")
    (tmp_path / "config").mkdir()
    if how == "server-command-line":
        proc, info = _jupyter(tmp_path, "server", "--JupyterTriton.grpc_port=0",
                              f"--JupyterTriton.model_repository={repo}")
    elif how == "lab-config-file":
        # JupyterLab loads jupyter_lab_config.py when it links, after this extension did
        (tmp_path / "config" / "jupyter_lab_config.py").write_text(
            f"c.JupyterTriton.grpc_port = 0\nc.JupyterTriton.model_repository = {str(repo)!r}\n")
        proc, info = _jupyter(tmp_path, "lab")
    elif how == "lab-defaults":
        # what `./dev lab` starts: gRPC served with nothing configured (the notebooks' gRPC cells)
        proc, info = _jupyter(tmp_path, "lab", f"--JupyterTriton.model_repository={repo}")
    try:
        assert info["model_repository"] == str(repo)
        assert isinstance(info["grpc_port"], int) and info["grpc_port"] > 0, info
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{info['grpc_port']}")
        try:
            with pytest.raises(InferenceServerException):
                g.is_server_live()                                     # no credential
            assert g.is_model_ready("linear", headers={"authorization": f"token {TOKEN}"})
        finally:
            g.close()
    finally:
        out = _stop(proc)
    assert f"gRPC on 127.0.0.1:{info['grpc_port']}" in out
