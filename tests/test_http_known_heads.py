"""A client that repeats its request head byte for byte (perf_analyzer, tritonclient, a
notebook's loop) is answered as any: each body is its own, each repeat is admitted again
(bytes in flight), and reads that hold more or less than one request are parsed in full. The
fast front skips the parser for such repeats (``_Connection._repeat``); both skins must agree."""
from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from conftest import BOTH_FRONTS, W
from jupyter_triton.frontends import fasthttp
from server_waits import wait_until
from test_http_fronts import connect, read_response, start


@pytest.fixture(params=BOTH_FRONTS)
def server(model_repo, request, monkeypatch):
    s = start(model_repo, request.param, max_inflight_bytes=50_000)
    s.repeats = []              # the fast front's repeats: reads it did not parse
    repeat = fasthttp._Connection._repeat

    def counted(self, known, data):
        s.repeats.append(len(data))
        return repeat(self, known, data)

    monkeypatch.setattr(fasthttp._Connection, "_repeat", counted)
    yield s
    s.close()


def binary_request(x: np.ndarray, port: int, pad: int = 0) -> bytes:
    """An infer request with ``x`` as binary data: the same head for every ``x`` of one shape."""
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]})
    header = header.encode() + b" " * pad
    body = header + x.astype(np.float32).tobytes()
    return (f"POST /v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def answer(sock: socket.socket, buffer: bytearray) -> np.ndarray:
    status, headers, body = read_response(sock, buffer)
    assert status == 200, body
    offset = int(headers["inference-header-content-length"])
    return np.frombuffer(body[offset:], np.float32).reshape(-1, 4)


def test_each_repeat_is_answered_with_its_own_body(server):
    sock = connect(server)
    buffer = bytearray()
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal((2, 16)).astype(np.float32)
        sock.sendall(binary_request(x, server.http_port))
        np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    # Two repeats in one read, then one read with a repeat and the start of the next request.
    xs = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(4)]
    sock.sendall(binary_request(xs[0], server.http_port) + binary_request(xs[1], server.http_port))
    third = binary_request(xs[2], server.http_port)
    sock.sendall(third + binary_request(xs[3], server.http_port)[:50])
    for x in xs[:3]:
        np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    time.sleep(0.1)
    sock.sendall(binary_request(xs[3], server.http_port)[50:])
    np.testing.assert_allclose(answer(sock, buffer), xs[3] @ W, rtol=1e-5)
    # Another shape: another head, answered as well.
    x = rng.standard_normal((1, 16)).astype(np.float32)
    sock.sendall(binary_request(x, server.http_port))
    np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    sock.close()
    if isinstance(server._servers[0], fasthttp.HTTPFront):
        assert len(server.repeats) >= 15        # the repeats the test is about


def test_a_repeat_is_admitted_again(server):
    x = np.ones((1, 16), np.float32)
    request = binary_request(x, server.http_port, pad=20_000)
    sock = connect(server)
    buffer = bytearray()
    sock.sendall(request)
    np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    slow = connect(server)     # 40 kB announced, 10 received: held in flight
    slow.sendall(f"POST /v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1:{server.http_port}"
                 "\r\nContent-Length: 40000\r\n\r\n".encode() + b"x" * 10)
    wait_until(lambda: server.plane.budget.held >= 40_000, "the slow body's bytes held")
    sock.sendall(request)
    status, _, body = read_response(sock, buffer)
    assert status == 503 and "in flight" in json.loads(body)["error"]
    slow.close()
    sock.close()                # (tornado closes after its 503)
    wait_until(lambda: server.plane.budget.held == 0, "the closed body's bytes given back")
    sock = connect(server)
    buffer = bytearray()
    for _ in range(2):
        sock.sendall(request)
        np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    sock.close()
    wait_until(lambda: server.plane.budget.held == 0, "every body's bytes given back")
    if isinstance(server._servers[0], fasthttp.HTTPFront):
        assert len(server.repeats) == 2


def test_a_repeat_meets_the_host_check_again(server):
    x = np.ones((1, 16), np.float32)
    sock = connect(server)
    buffer = bytearray()
    sock.sendall(binary_request(x, server.http_port))
    np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
    server.plane.allowed_hosts = frozenset({"example.com:80"})
    sock.sendall(binary_request(x, server.http_port))
    status, _, body = read_response(sock, buffer)
    assert status == 403 and "Host '127.0.0.1" in json.loads(body)["error"]
    sock.close()


def test_only_the_last_request_of_a_small_head_is_known(server):
    """A repeat is of the request the parser read last (whose HTTP version a streamed reply
    asks of it), and a head past a real client's size is not kept."""
    x = np.ones((1, 16), np.float32)
    a = binary_request(x, server.http_port)
    b = a.replace(b"Host:", b"X-Twice: 1\r\nX-Twice: 2\r\nHost:")     # not kept: a repeated name
    padded = a.replace(b"Host:", b"X-Pad: " + b"p" * 5000 + b"\r\nHost:")
    sock = connect(server)
    buffer = bytearray()
    for request in (a, a, b, a, padded, padded):
        sock.sendall(request)
        np.testing.assert_allclose(answer(sock, buffer), x @ W, rtol=1e-5)
        time.sleep(0.05)        # (each its own read)
    sock.close()
    if isinstance(server._servers[0], fasthttp.HTTPFront):
        assert server.repeats == [len(a)]
