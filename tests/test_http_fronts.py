"""What an HTTP/1.1 client meets on either skin of the standalone server (the httptools front
and the tornado one): keep-alive, pipelining, chunked and compressed bodies, Expect:
100-continue, HEAD, the body cap, bytes in flight, a body deadline, and the in-kernel
server's guards (credentials, Host, Content-Type). Raw sockets where the wire is the point."""
from __future__ import annotations

import gzip
import http.client
import json
import socket
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BOTH_FRONTS, W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import INFERENCE_SCOPE, AccessPolicy
from jupyter_triton.standalone import start_in_thread
from server_waits import wait_until

GOOD = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                               "data": [0.5] * 16}]}).encode()
EXPECTED = (np.full((1, 16), 0.5, np.float32) @ W).ravel()


@pytest.fixture(params=BOTH_FRONTS)
def http_front(request) -> str:
    return request.param


def start(model_repo, http_front, **keywords):
    return start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="none",
                                         max_input_size=64 * 1024),
                           host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                           http_front=http_front, **keywords)


@pytest.fixture
def server(model_repo, http_front):
    s = start(model_repo, http_front, max_inflight_bytes=50_000)
    yield s
    s.close()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=20)


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response from ``sock`` (Content-Length framed); leftovers stay in ``buffer``."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {bytes(buffer)!r}")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        rest += chunk
    buffer[:] = rest[length:]
    return status, headers, rest[:length]


def post(path: str, body: bytes, extra: str = "", port: int = 0) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def test_keep_alive_and_pipelined_requests_answered_in_order(server):
    sock = connect(server)
    buffer = bytearray()
    # Three requests in one write: each answered, in order, on the same connection.
    sock.sendall(post("/v2/models/linear/infer", GOOD, port=server.http_port)
                 + f"GET /v2/models/nope HTTP/1.1\r\nHost: 127.0.0.1:{server.http_port}\r\n\r\n".encode()
                 + f"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1:{server.http_port}\r\n\r\n".encode())
    status, _, body = read_response(sock, buffer)
    assert status == 200
    np.testing.assert_allclose(json.loads(body)["outputs"][0]["data"], EXPECTED, rtol=1e-5)
    status, headers, body = read_response(sock, buffer)
    assert status == 404 and "nope" in json.loads(body)["error"]
    assert headers["content-type"] == "application/json"
    assert read_response(sock, buffer)[0] == 200
    for _ in range(3):                      # and the connection still serves afterwards
        sock.sendall(post("/v2/models/linear/infer", GOOD, port=server.http_port))
        assert read_response(sock, buffer)[0] == 200
    sock.close()


def test_http10_closes_and_head_has_no_body(server):
    sock = connect(server)
    sock.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200")
    sock.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("HEAD", "/v2")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b""
    assert int(resp.getheader("Content-Length")) > 0    # the size GET would send
    conn.close()


def test_chunked_gzip_and_expect_continue_bodies(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("POST", "/v2/models/linear/infer", body=iter([GOOD[:10], GOOD[10:]]),
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    np.testing.assert_allclose(json.loads(resp.read())["outputs"][0]["data"], EXPECTED, rtol=1e-5)
    conn.request("POST", "/v2/models/linear/infer", body=gzip.compress(GOOD),
                 headers={"Content-Encoding": "gzip"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["outputs"]
    conn.close()
    sock = connect(server)
    sock.sendall(f"POST /v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Content-Length: {len(GOOD)}\r\nExpect: 100-continue\r\n\r\n".encode())
    assert sock.recv(65536).startswith(b"HTTP/1.1 100")
    sock.sendall(GOOD)
    assert read_response(sock, bytearray())[0] == 200
    sock.close()


def test_body_cap_announced_or_chunked(server, http_front):
    big = b'{"pad": "' + b"x" * (100 * 1024) + b'"}'
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("POST", "/v2/models/linear/infer", body=big)
    resp = conn.getresponse()
    assert resp.status == 400
    assert "maximum input size of 65536 bytes" in json.loads(resp.read())["error"]
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    try:
        conn.request("POST", "/v2/models/linear/infer", body=iter([big[:40000], big[40000:]]),
                     encode_chunked=True)
        assert conn.getresponse().status == 400
    except ConnectionResetError:
        # tornado's HTTP/1 closes at once on a chunked body past its cap, without draining
        # what the client still sends: on a loaded machine the reset can overtake the 400
        # (fasthttp half-closes and lingers, so there it must always be the 400)
        if http_front != "tornado":
            raise
    conn.close()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert client.is_server_live()
    client.close()


def test_malformed_requests_get_400_and_server_keeps_serving(server):
    for garbage in [b"NOT-HTTP\r\n\r\n", b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"]:
        sock = connect(server)
        sock.sendall(garbage)
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 400"), data
        sock.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("POST", "/v2/models/linear/infer", body=GOOD)
    assert conn.getresponse().status == 200
    conn.close()


def test_bytes_in_flight_are_bounded(server):
    assert server.plane.budget.limit == 50_000
    slow = connect(server)     # 40 kB announced, 10 received: the rest is still to come
    slow.sendall(post("/v2/models/linear/infer", b"", port=server.http_port)
                 .replace(b"Content-Length: 0", b"Content-Length: 40000") + b"x" * 10)
    wait_until(lambda: server.plane.budget.held == 40_000, "the slow body's bytes held")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("POST", "/v2/models/linear/infer", body=GOOD + b" " * 20_000)
    resp = conn.getresponse()
    assert resp.status == 503
    assert "in flight" in json.loads(resp.read())["error"]
    conn.close()
    slow.close()
    wait_until(lambda: server.plane.budget.held == 0, "the hung-up body's bytes given back")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=20)
    conn.request("POST", "/v2/models/linear/infer", body=GOOD + b" " * 20_000)
    assert conn.getresponse().status == 200
    conn.close()
    assert server.plane.budget.held == 0


def test_a_trickling_body_is_cut_at_the_deadline(model_repo):
    server = start(model_repo, "fast")
    try:
        server._servers[0].body_timeout = 0.5
        sock = connect(server)
        sock.sendall(post("/v2/models/linear/infer", b"", port=server.http_port)
                     .replace(b"Content-Length: 0", b"Content-Length: 500") + b"{")
        t0 = time.monotonic()
        status, headers, body = read_response(sock, bytearray())
        assert status == 408 and "not received within 0.5 s" in json.loads(body)["error"]
        assert time.monotonic() - t0 < 5
        assert headers.get("connection") == "close"
        assert sock.recv(100) == b""
        sock.close()
        assert server.plane.budget.held == 0
    finally:
        server.close()


def test_in_kernel_guards_token_host_and_content_type(model_repo, http_front):
    token = "kernel-secret"
    policy = AccessPolicy(tokens={token: INFERENCE_SCOPE | {"model-repository"}})
    server = start(model_repo, http_front, access=policy, check_host=True, strict_content_type=True)
    port = server.http_port
    try:
        auth = {"Authorization": f"Bearer {token}"}
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as err:
            client.get_model_repository_index()
        assert err.value.status() == "401"
        assert client.is_server_live(headers=dict(auth))
        assert {m["name"] for m in client.get_model_repository_index(headers=dict(auth))} >= {"linear"}
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.full((1, 16), 0.5, np.float32))
        np.testing.assert_allclose(client.infer("linear", [inp], headers=dict(auth)).as_numpy("OUTPUT0").ravel(),
                                   EXPECTED, rtol=1e-5)
        client.close()

        def raw(headers: dict) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
            conn.request("POST", "/v2/repository/index", body=b"{}", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            return resp.status, json.loads(body) if body else {}

        # A web page: text/plain needs no CORS preflight; refused before anything runs.
        status, body = raw({**auth, "Content-Type": "text/plain"})
        assert status == 415 and "text/plain" in body["error"]
        # DNS rebinding: the browser sends the attacker's name as Host.
        status, body = raw({**auth, "Host": f"evil.example:{port}"})
        assert status == 403 and "evil.example" in body["error"]
        status, body = raw({**auth, "Host": f"localhost:{port + 1}"})
        assert status == 403
        status, body = raw({"Content-Type": "application/json"})
        assert status == 401 and set(body) == {"error"}
        status, _ = raw({**auth, "Host": f"localhost:{port}", "Content-Type": "application/json"})
        assert status == 200
    finally:
        server.close()


def test_grpc_access_and_grpc_host_reach_the_grpc_port(model_repo):
    import tritonclient.grpc as grpcclient
    policy = AccessPolicy(tokens={"g-token": INFERENCE_SCOPE})
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="none"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                             grpc_access=policy, grpc_host="127.0.0.1")
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        with pytest.raises(InferenceServerException) as err:
            client.is_server_live()
        assert "UNAUTHENTICATED" in str(err.value.status())
        assert client.is_server_live(headers={"authorization": "Bearer g-token"})
        client.close()
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert http.is_server_live()              # access=None: the HTTP port stays open
        http.close()
    finally:
        server.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(model_repo):
    server = start(model_repo, "fast")
    try:
        server._servers[0].idle_timeout = 0.5
        sock = connect(server)
        t0 = time.monotonic()                   # the idle time counts from the answer, after
        sock.sendall(f"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1:{server.http_port}\r\n\r\n".encode())
        assert read_response(sock, bytearray())[0] == 200
        assert sock.recv(100) == b""            # closed by the server, not by us
        assert 0.3 < time.monotonic() - t0 < 10
        sock.close()
    finally:
        server.close()
