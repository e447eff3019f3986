"""Large and slow requests on the Jupyter server's own routes: a 60 MiB JSON infer request
never freezes Jupyter (its decode and encode leave the event loop), a trickling body is cut
at its deadline, and bodies in flight are bounded server-wide."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TOKEN, build_repository
from jupyter_triton.frontends.http import SETTINGS_KEY
from onnx_models import identity
from server_waits import until

AUTH = {"Authorization": f"token {TOKEN}"}
BIG_CONFIG = """\
name: "big"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, 16 ] } ]
"""
# What the test asserts is looser than the 50 ms aim, so that a loaded box (8 agents on 2
# cores: the OS alone then delays a thread by 100s of ms) does not flake; the figures are
# printed (pytest -s). 99% of event-loop stalls and of the polls' answers are under
# STALL_BOUND_S, none over WORST_BOUND_S, and stalls longer than 0.1 s add up to less than a
# tenth of the request's time and one HICCUP_S: one pause of the whole process, as a full
# collection of the decoded document's objects can be (CI once saw 0.53 s in a 3.2 s request).
# A decode or encode on the loop stalls it for seconds, most of the request's time, which each
# of these catches.
STALL_BOUND_S, WORST_BOUND_S, HICCUP_S = 0.25, 2.0, 0.5


@pytest.fixture
def model_repo(tmp_path: Path) -> Path:
    from onnx import TensorProto
    root = build_repository(tmp_path / "models")
    identity(TensorProto.FLOAT, root / "big" / "1" / "model.onnx", dims=16)
    (root / "big" / "config.pbtxt").write_text(BIG_CONFIG)
    return root


def big_request(target_mib: int = 60) -> tuple[bytes, np.ndarray]:
    n = int(target_mib * 1024 * 1024 / 4.5) // 16 * 16     # "1.25," "1.5," ...: 4.5 bytes each
    x = (np.arange(n) % 8 / 4 + 0.25).astype(np.float32).reshape(-1, 16)
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}, separators=(",", ":")).encode()
    return body, x


async def test_jupyter_answers_while_a_60_mib_json_request_is_decoded(jp_triton, jp_fetch, jp_http_port,
                                                                      jp_base_url):
    body, x = big_request()
    assert 58 * 1024 * 1024 <= len(body) < 64 * 1024 * 1024      # under the 64 MiB cap
    result: dict = {}

    def send() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", jp_http_port, timeout=300)
        t0 = time.monotonic()
        conn.request("POST", f"{jp_base_url}v2/models/big/infer", body=body, headers=AUTH)
        resp = conn.getresponse()
        result["status"], result["body"] = resp.status, resp.read()   # parsed later: json.loads holds the GIL
        result["seconds"] = time.monotonic() - t0
        conn.close()

    loop = asyncio.get_running_loop()
    lags: list[float] = []
    answers: dict[str, list[float]] = {"api/status": [], "v2/health/live": []}
    thread = threading.Thread(target=send)

    async def sample_loop_lag() -> None:
        while thread.is_alive():
            t = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t - 0.005)

    thread.start()
    sampler = asyncio.ensure_future(sample_loop_lag())
    deadline = time.monotonic() + 240
    while thread.is_alive() and time.monotonic() < deadline:
        for path in answers:
            t = time.perf_counter()
            resp = await jp_fetch(path, headers=AUTH)
            answers[path].append(time.perf_counter() - t)
            assert resp.code == 200
        await asyncio.sleep(0.01)
    await asyncio.to_thread(thread.join, 60)
    await sampler
    assert result["status"] == 200, result["body"][:300]
    out = json.loads(result["body"])["outputs"][0]
    assert out["shape"] == list(x.shape)
    np.testing.assert_array_equal(np.asarray(out["data"], np.float32), x.ravel())
    worst = {path: max(times) for path, times in answers.items()}
    print(f"\n60 MiB JSON infer took {result['seconds']:.2f} s; {len(answers['api/status'])} polls; "
          f"worst answer api/status {worst['api/status'] * 1000:.0f} ms, v2/health/live "
          f"{worst['v2/health/live'] * 1000:.0f} ms; worst event-loop stall {max(lags) * 1000:.0f} ms; "
          f"p99 stall {sorted(lags)[int(len(lags) * 0.99)] * 1000:.0f} ms; stalls > 0.1 s sum to "
          f"{sum(lag for lag in lags if lag > 0.1):.2f} s")
    assert len(answers["api/status"]) >= 10          # the polls really ran while it was served
    for samples in (lags, *answers.values()):
        assert sorted(samples)[int(len(samples) * 0.99)] < STALL_BOUND_S
        assert max(samples) < WORST_BOUND_S
    assert sum(lag for lag in lags if lag > 0.1) < 0.1 * result["seconds"] + HICCUP_S


def _open_body(port: int, base: str, length: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(f"POST {base}v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                 f"Authorization: token {TOKEN}\r\nContent-Length: {length}\r\n\r\n".encode() + first)
    return sock


async def test_a_trickling_body_is_cut_at_the_deadline(jp_triton, jp_http_port, jp_base_url):
    state = jp_triton.web_app.settings[SETTINGS_KEY]
    state.body_timeout = 1.0
    sock = _open_body(jp_http_port, jp_base_url, 1000, b'{"inputs": ')
    t0 = time.monotonic()
    data = b""
    while True:
        chunk = await asyncio.to_thread(sock.recv, 65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    elapsed = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert "not received within 1 s" in json.loads(body)["error"]
    assert 0.8 < elapsed < 10                   # cut at the deadline, and the connection closed
    assert state.plane.budget.held == 0


async def test_bodies_in_flight_are_bounded_on_the_jupyter_routes(jp_triton, jp_fetch, jp_http_port,
                                                                   jp_base_url):
    state = jp_triton.web_app.settings[SETTINGS_KEY]
    state.plane.budget.limit = 50_000
    slow = _open_body(jp_http_port, jp_base_url, 40_000, b"{")
    await until(lambda: state.plane.budget.held == 40_000, "the slow body's bytes held")
    good = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                   "data": [1.0] * 16}]}).encode() + b" " * 20_000
    from tornado.httpclient import HTTPClientError
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=good, headers=AUTH)
    assert err.value.code == 503
    assert "in flight" in json.loads(err.value.response.body)["error"]
    slow.close()
    await until(lambda: state.plane.budget.held == 0, "the closed body's bytes given back")
    resp = await jp_fetch("v2/models/linear/infer", method="POST", body=good, headers=AUTH)
    assert resp.code == 200
    assert state.plane.budget.held == 0
