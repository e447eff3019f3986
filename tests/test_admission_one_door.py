"""Every listener asks one function, ``Admission.admit``, before it serves a request: the
standalone server's HTTP port (either skin), its metrics port, gRPC and gRPC's health
service; on a Jupyter server, the fast lane and the tornado routes on Jupyter's port, the
data port and gRPC. Each request below is recorded at that function with its door's kind."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import BOTH_FRONTS, INFER_KEY, TOKEN, in_thread
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import Admission
from jupyter_triton.standalone import start_in_thread

KEY = {"Authorization": f"Bearer {INFER_KEY}"}


@pytest.fixture
def doors(monkeypatch) -> list[tuple[str, str]]:
    """(door kind, API group) of every request the admission is asked about."""
    seen: list[tuple[str, str]] = []
    admit = Admission.admit

    def recorded(self, door, group, *args, **kwargs):
        seen.append((door.kind, group))
        return admit(self, door, group, *args, **kwargs)
    monkeypatch.setattr(Admission, "admit", recorded)
    return seen


def grpc_calls(port: int, metadata: tuple = ()) -> None:
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        assert g.is_server_live(headers=dict(metadata))
    finally:
        g.close()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def metrics(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
        head = s.recv(64)
    return int(head.split()[1])


@pytest.mark.parametrize("front", BOTH_FRONTS)
def test_every_standalone_listener_asks_the_one_admission(model_repo, doors, front):
    server = start_in_thread(EngineOptions(model_repository=model_repo), host="127.0.0.1",
                             http_port=0, metrics_port=0, grpc_port=0, http_front=front,
                             check_host=True)
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        try:
            assert c.is_server_ready()
        finally:
            c.close()
        assert metrics(server.metrics_port) == 200
        grpc_calls(server.grpc_port)
    finally:
        server.close()
    assert set(doors) == {("http", "health"), ("metrics", "statistics"), ("grpc", "health")}
    # ServerLive and Health/Check: both gRPC calls were admitted there
    assert doors.count(("grpc", "health")) == 2


async def raw_get(port: int, path: str, headers: dict[str, str]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{lines}\r\n".encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
    finally:
        writer.close()
    return int(head.split()[1])


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config, "JupyterTriton": {**jp_server_config["JupyterTriton"],
                                                  "grpc_port": 0, "http_data_port": 0}}


async def test_every_listener_of_the_jupyter_server_asks_the_one_admission(
        jp_triton, jp_fetch, jp_http_port, jp_base_url, doors):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    # a header credential alone: the fast lane's; with a query: Jupyter's own handlers'
    assert await raw_get(jp_http_port, f"{jp_base_url}v2/health/ready", KEY) == 200
    assert (await jp_fetch("v2/health/ready", params={"via": "tornado"},
                           headers={"Authorization": f"token {TOKEN}"})).code == 200
    # a request with no credential at all is refused at the same function, on Jupyter's door
    assert await raw_get(jp_http_port, f"{jp_base_url}v2/models/stats?x=1", {}) == 403

    def data_port() -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{ext.bound_http_data_port}")
        try:
            assert c.is_server_ready(headers=dict(KEY))
        finally:
            c.close()
    await in_thread(data_port)
    await in_thread(grpc_calls, ext.bound_grpc_port, (("authorization", f"Bearer {INFER_KEY}"),))
    assert set(doors) == {("fast-lane", "health"), ("jupyter", "health"), ("jupyter", "statistics"),
                          ("data", "health"), ("grpc", "health")}
