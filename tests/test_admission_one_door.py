"""Every listener asks one function, ``Admission.admit``, before it serves a request: the
standalone server's HTTP port (either skin), its metrics port, gRPC and gRPC's health
service; on a Jupyter server, the fast lane and the tornado routes on Jupyter's port, the
data port and gRPC. Each request below is recorded at that function with its door's kind."""
from __future__ import annotations

import asyncio
import functools
import socket

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import BOTH_FRONTS, INFER_KEY, TOKEN, in_thread
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends import fasthttp
from jupyter_triton.frontends import http as http_skin
from jupyter_triton.frontends.admission import Admission, Door
from jupyter_triton.frontends.limits import HTTP1Limits, HTTP2Limits
from jupyter_triton.protocol.errors import TritonError
from jupyter_triton.standalone import start_in_thread
from server_waits import wait_until

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


@pytest.fixture
def connects(monkeypatch) -> list[tuple[Door, int]]:
    """(door, 0 or the refusal's status) of every connection the admission was asked about."""
    seen: list[tuple[Door, int]] = []
    connect = Admission.connect

    def recorded(self, door, *args, **kwargs):
        try:
            slot = connect(self, door, *args, **kwargs)
        except TritonError as err:
            seen.append((door, err.status))
            raise
        seen.append((door, 0))
        return slot
    monkeypatch.setattr(Admission, "connect", recorded)
    return seen


def refused(connects: list[tuple[Door, int]]) -> list[tuple[str, int]]:
    return [(door.kind, status) for door, status in connects if status]


def read_to_close(s: socket.socket) -> bytes:
    s.settimeout(10)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("front", BOTH_FRONTS)
def test_a_listener_past_its_connection_cap_is_refused_by_the_admission(
        model_repo, monkeypatch, connects, front):
    """The standalone HTTP port (the fast front, and tornado's server with the tornado skin)
    built with ``max_connections=2``: two raw connections take its door's slots; a third is
    refused by the admission's count (503, then a close); one of the two closes, its slot
    comes back, and a new connection is served."""
    for module in (fasthttp, http_skin):
        monkeypatch.setattr(module, "HTTP1Limits", functools.partial(HTTP1Limits, max_connections=2))
    server = start_in_thread(EngineOptions(model_repository=model_repo), host="127.0.0.1",
                             http_port=0, metrics_port=None, grpc_port=None, http_front=front)
    try:
        past_the_cap(("127.0.0.1", server.http_port), server.plane.door, connects,
                     b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    finally:
        server.close()


def test_the_metrics_port_past_its_connection_cap_is_refused_by_the_admission(
        model_repo, monkeypatch, connects):
    """The standalone metrics port (tornado's server) asks the admission for its
    connections' slots too: past ``max_connections`` a 503 and a close, then served again."""
    monkeypatch.setattr(http_skin, "HTTP1Limits", functools.partial(HTTP1Limits, max_connections=2))
    server = start_in_thread(EngineOptions(model_repository=model_repo), host="127.0.0.1",
                             http_port=0, metrics_port=0, grpc_port=None, http_front="fast")
    try:
        address = ("127.0.0.1", server.metrics_port)
        with socket.create_connection(address, timeout=10):
            (door,) = wait_until(lambda: [d for d, _ in connects if d.kind == "metrics"],
                                 "the metrics connection asked its slot")
        wait_until(lambda: door.connected == 0, "the closed connection's slot given back")
        past_the_cap(address, door, connects, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                              b"Connection: close\r\n\r\n")
    finally:
        server.close()


def past_the_cap(address: tuple[str, int], door: Door, connects, request: bytes) -> None:
    """Two connections held take the door's two slots; a third is refused (503, a close);
    once one of the two closes, ``request`` on a new connection is served (200)."""
    held = []
    try:
        held += [socket.create_connection(address, timeout=10) for _ in range(2)]
        wait_until(lambda: door.connected == 2, "two connections counted at the door")
        with socket.create_connection(address, timeout=10) as extra:
            answer = read_to_close(extra)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:80]
        assert b"maximum of 2 HTTP connections" in answer
        assert refused(connects) == [(door.kind, 503)] and door.connected == 2
        held.pop().close()
        wait_until(lambda: door.connected == 1, "the closed connection's slot given back")
        with socket.create_connection(address, timeout=10) as again:
            again.sendall(request)
            assert read_to_close(again).startswith(b"HTTP/1.1 200 ")
        assert refused(connects) == [(door.kind, 503)]
        wait_until(lambda: door.connected == 1, "the served connection's slot given back")
    finally:
        for s in held:
            s.close()


def test_the_grpc_port_past_its_connection_cap_is_refused_by_the_admission(model_repo, connects):
    """gRPC's port built with ``max_connections=1``: one raw connection takes the slot, the
    next is closed at once by the admission's count; once the first closes, a client is
    served."""
    server = start_in_thread(EngineOptions(model_repository=model_repo), host="127.0.0.1",
                             http_port=0, metrics_port=None, grpc_port=0,
                             grpc_limits=HTTP2Limits(max_connections=1))
    address = ("127.0.0.1", server.grpc_port)
    try:
        with socket.create_connection(address, timeout=10) as first:
            (door,) = wait_until(lambda: [d for d, _ in connects if d.kind == "grpc"],
                                 "the gRPC connection asked its slot")
            assert door.connected == 1
            with socket.create_connection(address, timeout=10) as extra:
                try:
                    assert read_to_close(extra) == b"", "refused, yet answered"
                except ConnectionResetError:
                    pass                # closed at once: an abort may reach the peer as a reset
            assert refused(connects) == [("grpc", 503)] and door.connected == 1
        wait_until(lambda: door.connected == 0, "the closed connection's slot given back")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            assert client.is_server_live()
        finally:
            client.close()
        assert refused(connects) == [("grpc", 503)]
    finally:
        server.close()


def test_a_connection_slot_is_given_back_once():
    admission, door = Admission(), Door("grpc", max_connections=1)
    slot = admission.connect(door)
    with pytest.raises(TritonError, match="maximum of 1 gRPC connections"):
        admission.connect(door)
    slot.release()
    slot.release()          # a listener may release on more than one path: counted once
    assert door.connected == 0
    admission.connect(door)
    assert door.connected == 1
