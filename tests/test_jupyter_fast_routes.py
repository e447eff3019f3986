"""The fast routes on the Jupyter server's own port (jupyter_triton/fast_routes.py): a token-
authenticated v2 API call is served by the fast HTTP front with Jupyter's credentials, Host
check, default headers and metric; every other request, from the first one on its connection,
is Jupyter's, byte for byte (keep-alive, pipelining, websockets)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tornado.httpclient import HTTPClientError
from tornado.websocket import websocket_connect

from conftest import INFER_KEY, TOKEN, W, in_thread

AUTH = {"Authorization": f"token {TOKEN}"}
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]}).encode()


def lane_of(app):
    return app.extension_manager.extension_apps["jupyter_triton"].copy().pop()._fast_routes


def request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    return int(status_line.split()[1]), headers, body


async def exchange(port: int, *requests: bytes, together: bool = False):
    """Send ``requests`` on one keep-alive connection (all in one write when ``together``:
    pipelined) and read one response each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answers = []
        if together:
            writer.write(b"".join(requests))
            for _ in requests:
                answers.append(await read_response(reader))
        else:
            for data in requests:
                writer.write(data)
                answers.append(await read_response(reader))
        return answers
    finally:
        writer.close()


async def test_tritonclient_is_served_by_the_fast_routes(jp_triton, jp_http_port, jp_base_url):
    lane = lane_of(jp_triton)
    assert lane is not None
    x = np.arange(32, dtype=np.float32).reshape(2, 16)

    def use() -> tuple[list[np.ndarray], dict]:
        # tritonclient.http is gevent-based: made and used in one thread. (It adds to the
        # headers dict it is given: a copy each time.)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}")
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        outs = [client.infer("linear", [inp], headers=dict(AUTH)).as_numpy("OUTPUT0") for _ in range(3)]
        outs.append(client.infer("linear", [inp], headers={"Authorization": f"Bearer {INFER_KEY}"})
                    .as_numpy("OUTPUT0"))       # an inference key is taken too, within its scope
        meta = client.get_model_metadata("linear", headers=dict(AUTH))
        client.close()
        return outs, meta

    before = lane.handed_off
    outs, meta = await in_thread(use)
    for out in outs:
        np.testing.assert_allclose(out, x @ W, rtol=1e-5)
    assert meta["name"] == "linear"
    assert lane.handed_off == before          # nothing of that went through tornado


async def test_replies_carry_jupyters_headers_and_errors_are_tritons(jp_triton, jp_http_port,
                                                                     jp_base_url):
    lane = lane_of(jp_triton)
    base = jp_base_url
    before = lane.handed_off
    (status, headers, body), (bad, _, error) = await exchange(
        jp_http_port, request("POST", f"{base}v2/models/linear/infer", AUTH, ROW),
        request("POST", f"{base}v2/models/missing/infer", AUTH, ROW))
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["name"] == "OUTPUT0"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["content-security-policy"].startswith("frame-ancestors 'self'")
    assert headers["server"].startswith("TornadoServer/")
    assert bad == 404 and "missing" in json.loads(error)["error"]
    assert lane.handed_off == before


async def test_other_requests_on_the_same_connection_are_jupyters(jp_triton, jp_http_port,
                                                                  jp_base_url):
    lane = lane_of(jp_triton)
    base = jp_base_url
    infer = request("POST", f"{base}v2/models/linear/infer", AUTH, ROW)
    status_req = request("GET", f"{base}api/status", AUTH)
    for together in (False, True):
        before = lane.handed_off
        answers = await exchange(jp_http_port, infer, infer, status_req, infer, together=together)
        assert [a[0] for a in answers] == [200, 200, 200, 200]
        assert "started" in json.loads(answers[2][2])         # Jupyter's own api/status
        assert json.loads(answers[3][2])["outputs"][0]["name"] == "OUTPUT0"   # tornado's v2 route
        assert lane.handed_off == before + 1


@pytest.mark.parametrize("extra", [{"Cookie": "x=1"}, {"Origin": "http://127.0.0.1"}])
async def test_browser_requests_are_jupyters(jp_triton, jp_http_port, jp_base_url, extra):
    lane = lane_of(jp_triton)
    before = lane.handed_off
    [(status, headers, body)] = await exchange(
        jp_http_port, request("POST", f"{jp_base_url}v2/models/linear/infer", {**AUTH, **extra}, ROW))
    assert status == 200 and json.loads(body)["outputs"][0]["name"] == "OUTPUT0"
    assert lane.handed_off == before + 1
    if "Origin" in extra:           # Jupyter's CORS answer for a token-authenticated call
        assert headers["access-control-allow-origin"] == "http://127.0.0.1"


async def test_what_jupyter_refuses_is_refused_by_jupyter(jp_triton, jp_http_port, jp_base_url):
    lane = lane_of(jp_triton)
    base = jp_base_url
    before = lane.handed_off
    # A foreign Host (DNS rebinding): Jupyter's check refuses it.
    foreign = request("GET", f"{base}v2/models/linear", AUTH).replace(b"Host: 127.0.0.1",
                                                                      b"Host: evil.example")
    [(status, _, _)] = await exchange(jp_http_port, foreign)
    assert status == 403
    # A wrong token, and an inference key outside its scope: Jupyter's answers.
    [(wrong, _, _)] = await exchange(jp_http_port, request(
        "POST", f"{base}v2/models/linear/infer", {"Authorization": "token nope"}, ROW))
    assert wrong == 403
    [(scoped, _, body)] = await exchange(jp_http_port, request(
        "POST", f"{base}v2/repository/models/linear/unload",
        {"Authorization": f"Bearer {INFER_KEY}"}, b"{}"))
    assert scoped == 403 and b"never reach load/unload" in body
    assert lane.handed_off == before + 3
    assert jp_triton.web_app.settings["jupyter_triton"].engine.model_ready("linear")


async def test_websockets_after_a_fast_request(jp_triton, jp_http_port, jp_base_url, jp_fetch):
    """A kernel-channel-like upgrade is handed over whole: Jupyter's event stream answers."""
    url = f"ws://127.0.0.1:{jp_http_port}{jp_base_url}api/events/subscribe"
    ws = await websocket_connect(httpclient_request(url))
    await jp_fetch("api", "events", method="POST", headers=AUTH, body=json.dumps({
        "schema_id": "https://events.jupyter.org/jupyter_server/contents_service/v1",
        "version": "1", "data": {"action": "get", "path": "x"}}))
    message = json.loads(await asyncio.wait_for(ws.read_message(), 10))
    assert message["action"] == "get"
    ws.close()


def httpclient_request(url: str):
    from tornado.httpclient import HTTPRequest
    return HTTPRequest(url, headers=AUTH)


async def test_jupyters_request_metric_counts_fast_requests(jp_triton, jp_http_port, jp_base_url,
                                                            jp_fetch):
    await exchange(jp_http_port, *[request("POST", f"{jp_base_url}v2/models/linear/infer", AUTH,
                                           ROW)] * 3)
    text = (await jp_fetch("metrics", headers=AUTH)).body.decode()
    line = next(l for l in text.splitlines() if l.startswith("http_request_duration_seconds_count")
                and 'handler="jupyter_triton.frontends.http.ModelInfer"' in l
                and 'status_code="200"' in l)
    assert float(line.rsplit(" ", 1)[1]) >= 3



async def test_latency_histograms_are_on_by_default_in_the_extension(jp_triton, jp_http_port,
                                                                     jp_base_url, jp_fetch):
    # the dashboard's p50/p99 come from them; tritonserver's default (off) stays on its command line
    await exchange(jp_http_port, request("POST", f"{jp_base_url}v2/models/linear/infer", AUTH, ROW))
    text = (await jp_fetch("metrics", headers=AUTH)).body.decode()
    assert 'nv_inference_request_histogram_ms_bucket{' in text and 'model="linear"' in text

@pytest.fixture
def jp_server_config(jp_server_config, request):
    if getattr(request, "param", None) == "off":
        return {**jp_server_config, "JupyterTriton": {**jp_server_config["JupyterTriton"],
                                                      "fast_routes": False}}
    return jp_server_config


@pytest.mark.parametrize("jp_server_config", ["off"], indirect=True)
async def test_fast_routes_off(jp_triton, jp_http_port, jp_base_url):
    assert lane_of(jp_triton) is None
    [(status, _, body)] = await exchange(
        jp_http_port, request("POST", f"{jp_base_url}v2/models/linear/infer", AUTH, ROW))
    assert status == 200 and json.loads(body)["outputs"][0]["name"] == "OUTPUT0"


async def test_malformed_requests_are_refused_as_jupyter_refuses_them(jp_triton, jp_http_port,
                                                                      jp_base_url):
    async def raw(data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", jp_http_port)
        writer.write(data)
        try:
            return await asyncio.wait_for(reader.read(65536), 10)
        finally:
            writer.close()

    lane = lane_of(jp_triton)
    before = lane.handed_off
    assert (await raw(b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.1 400")
    # A head that never ends: past 64 KiB it is tornado's, which ends the connection at once
    # (the bytes held for it reach it in one read, so it needs none from the client).
    assert await raw(b"POST /" + b"a" * 70000) == b""
    # Content-Length and Transfer-Encoding together (smuggling): never ours.
    both = request("POST", f"{jp_base_url}v2/models/linear/infer", {**AUTH, "Transfer-Encoding": "chunked"},
                   ROW)
    assert (await raw(both)).startswith(b"HTTP/1.1 400")
    assert lane.handed_off >= before + 3
    [(status, _, _)] = await exchange(jp_http_port, request(
        "POST", f"{jp_base_url}v2/models/linear/infer", AUTH, ROW))
    assert status == 200            # and the server serves on


async def test_foreign_hosts_leave_nothing_behind(jp_triton, jp_http_port, jp_base_url):
    """Each new Host is asked of Jupyter's check through a probe handler; a client choosing
    Host values must not grow the server's per-class records."""
    from jupyter_triton.jupyter_auth import CACHE_KEY
    cache = jp_triton.web_app.settings[CACHE_KEY]
    foreign = request("GET", f"{jp_base_url}v2/models/linear", AUTH)
    await exchange(jp_http_port, foreign.replace(b"Host: 127.0.0.1", b"Host: a.example"))
    before = len(cache["defaults"])
    for i in range(20):
        [(status, _, _)] = await exchange(
            jp_http_port, foreign.replace(b"Host: 127.0.0.1", f"Host: h{i}.example".encode()))
        assert status == 403
    assert len(cache["defaults"]) == before and len(cache["hosts"]) <= 2
