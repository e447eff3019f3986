"""A refusal never breaks the connection it came on: the reply either leaves it usable for the
next request or says ``Connection: close`` and closes it. A proxy (JupyterHub's
configurable-http-proxy) reuses a kept-alive connection for another user's request; a
connection closed without saying so made it answer 503 "socket hang up" for requests that were
fine. The infer route reads its body after the head's checks, so a refusal on the head is the
case tornado closed silently."""
from __future__ import annotations

import json
import socket

import pytest

from conftest import BOTH_FRONTS, TOKEN, in_thread
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import INFERENCE_SCOPE, AccessPolicy

ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]}).encode()


def _request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
            "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a reply: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a reply"
        rest += chunk
    return status, headers, rest[:length]


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def refusals(port: int, path: str) -> list[str]:
    """Each refused request, sent as a proxy sends it, then a valid one where the refused
    reply kept the connection; returns what went wrong."""
    wrong: list[str] = []
    valid = {"Authorization": f"token {TOKEN}"}
    for label, headers in (("no credential", {}), ("wrong token", {"Authorization": "token nope"}),
                           ("unknown key", {"Authorization": "Bearer nope"})):
        for whole in (True, False):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            with sock:
                if whole:       # head and body in one write, as a proxy forwards a small POST
                    sock.sendall(_request(path, ROW, headers) + ROW)
                else:           # the head, then its body: a server may answer in between
                    sock.sendall(_request(path, ROW, headers))
                    try:
                        sock.sendall(ROW)
                    except OSError:         # answered and closed before the body: fine if said
                        pass
                status, reply, _ = _read_reply(sock)
                if status not in (401, 403):
                    wrong.append(f"{label}: {status}")
                    continue
                if reply.get("connection", "").lower() == "close":
                    if not _closed(sock):
                        wrong.append(f"{label}: said close but kept the connection")
                    continue
                sock.sendall(_request(path, ROW, valid) + ROW)
                status, _, body = _read_reply(sock)
                if status != 200:
                    wrong.append(f"{label}: the next request on the kept connection got {status} {body!r}")
    return wrong


@pytest.fixture
def jp_server_config(jp_server_config):
    # only the infer route's tornado path: the token-header fast path never sees a refused call
    return {**jp_server_config,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "fast_routes": False}}


async def test_a_refused_infer_keeps_or_closes_its_connection_honestly(jp_triton, jp_http_port,
                                                                       jp_base_url):
    wrong = await in_thread(refusals, jp_http_port, f"{jp_base_url}v2/models/linear/infer")
    assert wrong == []


@pytest.mark.parametrize("http_front", BOTH_FRONTS)
def test_a_refused_infer_on_the_standalone_server(model_repo, http_front):
    from jupyter_triton.standalone import start_in_thread
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit", load_models=["linear"]),
                             http_port=0, metrics_port=None, http_front=http_front,
                             access=AccessPolicy(tokens={TOKEN: INFERENCE_SCOPE}))
    try:
        assert refusals(server.http_port, "/v2/models/linear/infer") == []
    finally:
        server.close()
