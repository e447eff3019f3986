"""A graceful stop of `jupyter-triton serve --shutdown-drain-secs N`, as a load balancer and a
Kubernetes probe see it: on SIGTERM readiness turns 503 (HTTP) and NOT_SERVING / ready false
(gRPC) at once while requests are still served for N seconds; then the listeners close, the
requests in flight finish and the process exits within N + --exit-timeout-secs."""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ports import free_port

EXE = str(Path(sys.executable).parent / "jupyter-triton")
DRAIN_S = 10.0          # long enough for the checks below on a busy machine
EXIT_TIMEOUT_S = 10.0

# X >= 1: a "slow" request: it says it started (a file named after X), then waits until the
# test creates `release`. Any other X answers at once. Y = 2 X.
GATE_MODEL_PY = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.dir = args["model_repository"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] >= 1:
                open(os.path.join(self.dir, "started-%d" % int(x[0])), "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(self.dir, "release")):
                    if time.monotonic() > deadline:
                        raise RuntimeError("never released")
                    time.sleep(0.01)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
'''


def gate_model(root: Path) -> Path:
    model = root / "gate"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(GATE_MODEL_PY)
    # three instances: two slow requests hold two, the third serves the new ones
    (model / "config.pbtxt").write_text('''
name: "gate"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 3 } ]
parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }
''')
    return model


def start(repo: Path, *flags: str) -> tuple[subprocess.Popen, int, int]:
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [EXE, "serve", "--model-repository", str(repo), "--http-address", "127.0.0.1",
         "--http-port", str(http_port), "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--allow-metrics", "false", "--model-control-mode", "explicit", "--load-model", "gate",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while status(http_port, "v2/health/ready")[0] != 200:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "jupyter-triton serve was not ready in 60 s"
        time.sleep(0.1)
    return proc, http_port, grpc_port


def status(port: int, path: str) -> tuple[int | None, dict]:
    """(HTTP status, JSON body) of GET /path; (None, {}) while nothing listens. A connection
    the kernel had queued for the listener when it closed is reset, not refused: the same
    answer, nothing listens (a reset while the listener is open fails the checks below)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/" + path)
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else {}
    except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected):
        return None, {}
    finally:
        conn.close()


def x(value: float, client=httpclient):
    inp = client.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([value], np.float32))
    return [inp]


def health(grpc_port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=30).status


def wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear in {seconds:g} s"
        time.sleep(0.02)


def test_sigterm_drains_then_closes_then_finishes_what_is_in_flight(tmp_path: Path):
    model = gate_model(tmp_path)
    proc, http_port, grpc_port = start(tmp_path, "--shutdown-drain-secs", str(DRAIN_S),
                                       "--exit-timeout-secs", str(EXIT_TIMEOUT_S))
    timeline: list[tuple[float, str]] = []
    answers: dict = {}
    try:
        # a slow request over each protocol, running in the model when the signal comes
        http_slow = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=120,
                                                     connection_timeout=120)
        grpc_slow = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        slow_http = threading.Thread(target=lambda: answers.__setitem__(
            "http", http_slow.infer("gate", x(1.0)).as_numpy("Y")))
        slow_http.start()
        grpc_slow.async_infer("gate", x(2.0, grpcclient),
                              lambda result, error: answers.__setitem__("grpc", (result, error)),
                              client_timeout=120)
        wait_for(model / "started-1")
        wait_for(model / "started-2")
        assert status(http_port, "v2/health/ready")[0] == 200

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        timeline.append((0.0, "SIGTERM (2 slow requests in the model)"))
        deadline = t0 + 30
        while (seen := status(http_port, "v2/health/ready"))[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        timeline.append((time.monotonic() - t0, "v2/health/ready answers 503"))
        assert seen == (503, {"ready": False, "error": "Server exiting"})
        assert status(http_port, "v2/health/live") == (200, {"live": True})
        assert status(http_port, "v2/models/gate/ready")[0] == 503
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert grpc_client.is_server_ready() is False
        assert grpc_client.is_model_ready("gate") is False
        assert grpc_client.is_server_live() is True
        assert health(grpc_port, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(grpc_port, "gate") == health_pb2.HealthCheckResponse.NOT_SERVING
        timeline.append((time.monotonic() - t0, "gRPC ServerReady false, health NOT_SERVING"))

        # a new request in the window is served, over a new connection of each protocol
        fresh = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=60)
        np.testing.assert_array_equal(fresh.infer("gate", x(0.5)).as_numpy("Y"), [1.0])
        fresh.close()
        np.testing.assert_array_equal(grpc_client.infer("gate", x(0.25, grpcclient),
                                                        client_timeout=60).as_numpy("Y"), [0.5])
        grpc_client.close()
        timeline.append((time.monotonic() - t0, "new HTTP and gRPC requests served (200)"))
        assert time.monotonic() - t0 < DRAIN_S, "the checks outlasted the window: raise DRAIN_S"

        # the window ends: the listeners close while the slow requests are still in the model
        deadline = t0 + DRAIN_S + 30
        while status(http_port, "v2/health/live")[0] is not None:
            assert time.monotonic() < deadline, "the HTTP listener did not close"
            time.sleep(0.05)
        closed = time.monotonic() - t0
        timeline.append((closed, "HTTP listener closed (connection refused)"))
        assert closed >= DRAIN_S
        with pytest.raises(ConnectionRefusedError):
            import socket
            socket.create_connection(("127.0.0.1", grpc_port), timeout=10).close()
        assert slow_http.is_alive() and "grpc" not in answers

        (model / "release").touch()
        timeline.append((time.monotonic() - t0, "slow requests released"))
        slow_http.join(60)
        np.testing.assert_array_equal(answers["http"], [2.0])
        deadline = time.monotonic() + 60
        while "grpc" not in answers:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        result, error = answers["grpc"]
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("Y"), [4.0])
        timeline.append((time.monotonic() - t0, "both slow requests answered 200 / OK"))
        http_slow.close()
        grpc_slow.close()

        out, _ = proc.communicate(timeout=DRAIN_S + EXIT_TIMEOUT_S + 60)
        exited = time.monotonic() - t0
        timeline.append((exited, f"process exited, code {proc.returncode}"))
        assert proc.returncode == 0, out.decode()[-3000:]
        assert exited <= DRAIN_S + EXIT_TIMEOUT_S
        log = out.decode()
        assert "draining: not ready, still serving for 10 s" in log
        assert "drained: closing the listeners" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        print("\ndrain timeline (s after SIGTERM; --shutdown-drain-secs %g, --exit-timeout-secs %g):"
              % (DRAIN_S, EXIT_TIMEOUT_S))
        for when, what in timeline:
            print(f"  {when:6.2f}  {what}")


def test_a_second_signal_ends_the_window(tmp_path: Path):
    gate_model(tmp_path)
    proc, http_port, _ = start(tmp_path, "--shutdown-drain-secs", "600", "--exit-timeout-secs", "5")
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        deadline = t0 + 30
        while status(http_port, "v2/health/ready")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        assert time.monotonic() - t0 < 120         # not the 600 s window
        assert "cut short by a second signal" in out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_without_the_flag_a_signal_stops_at_once(tmp_path: Path):
    """Today's behaviour: no window (readiness is never seen 503; the port closes)."""
    gate_model(tmp_path)
    proc, _, _ = start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "draining" not in out.decode()


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_drain_value_is_refused_naming_the_flag(tmp_path: Path, value: str):
    done = subprocess.run([EXE, "serve", "--model-repository", str(tmp_path),
                           "--shutdown-drain-secs", value], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--shutdown-drain-secs" in done.stderr, done.stderr


def test_the_jupyter_trait_is_checked():
    from traitlets import TraitError
    from jupyter_triton.serverext import JupyterTriton
    app = JupyterTriton()
    assert app.shutdown_drain_secs == 0
    for value in (-1.0, float("nan"), float("inf")):
        with pytest.raises(TraitError, match="shutdown_drain_secs must be a number of seconds"):
            app.shutdown_drain_secs = value
    with pytest.raises(TraitError):
        app.shutdown_drain_secs = "soon"


def test_a_jupyter_server_drains_its_grpc_port(tmp_path: Path):
    """c.JupyterTriton.shutdown_drain_secs: Jupyter closes its own port first; the gRPC port
    answers NOT_SERVING and still serves through the window, then the server exits."""
    from conftest import TOKEN, W
    from onnx_models import linear
    from test_jupyter_options import _jupyter
    repo = tmp_path / "models"
    linear(W, repo / "linear" / "1" / "model.onnx")
    (tmp_path / "config").mkdir()
    proc, info = _jupyter(tmp_path, "server", "--JupyterTriton.grpc_port=0",
                          f"--JupyterTriton.model_repository={repo}",
                          f"--JupyterTriton.shutdown_drain_secs={DRAIN_S}")
    metadata = (("authorization", f"token {TOKEN}"),)
    try:
        port = info["grpc_port"]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while not client.is_model_ready("linear", headers=dict(metadata)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            request = health_pb2.HealthCheckRequest(service="")
            while check(request, metadata=metadata, timeout=30).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() - t0 < 30
                time.sleep(0.02)
        assert client.is_server_ready(headers=dict(metadata)) is False
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        out = client.infer("linear", [inp], headers=dict(metadata), client_timeout=60)
        np.testing.assert_allclose(out.as_numpy("OUTPUT0"), np.ones((1, 16), np.float32) @ W,
                                   rtol=1e-5)
        assert time.monotonic() - t0 < DRAIN_S, "the checks outlasted the window: raise DRAIN_S"
        client.close()
        out, _ = proc.communicate(timeout=DRAIN_S + 120)
        assert proc.returncode == 0, out.decode()[-3000:]
        assert time.monotonic() - t0 >= DRAIN_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
