"""Triton's generate extension (generate, generate_stream) with raw HTTP, as curl sends it,
on both HTTP skins of the standalone server and on the Jupyter server's routes: the JSON
fields <-> tensors/parameters mapping, server-sent events from a decoupled model, errors as
Triton's (before the stream: a JSON error with its status; during it: an event), a client
that disconnects mid-stream cancelling its request."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from conftest import BOTH_FRONTS, INFER_KEY, TOKEN
from decoupled_models import write_echo, write_words
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

TIMEOUT_S = 30


@pytest.fixture(scope="module", params=BOTH_FRONTS)
def server(request, tmp_path_factory):
    repo = write_echo(write_words(tmp_path_factory.mktemp("models")))
    served = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                             http_front=request.param)
    yield served
    served.close()


def _post(port: int, path: str, body, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response, response.read(), conn


def _events(raw: bytes) -> list:
    """The ``data:`` payloads of a text/event-stream body, in order."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            out.append(json.loads(block[len("data: "):]))
    return out


def test_generate_stream_sends_one_event_per_response(server):
    response, raw, conn = _post(server.http_port, "/v2/models/words/generate_stream",
                                {"text_input": "the quick fox"})
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    assert response.getheader("Transfer-Encoding") == "chunked"
    assert _events(raw) == [{"model_name": "words", "model_version": "1", "text_output": w}
                            for w in ("the", "quick", "fox")]
    # the connection stays usable after a stream
    conn.request("POST", "/v2/models/words/versions/1/generate_stream",
                 json.dumps({"text_input": "again"}))
    again = conn.getresponse()
    assert [e["text_output"] for e in _events(again.read())] == ["again"]
    conn.close()


def test_generate_maps_fields_to_inputs_and_parameters(server):
    response, raw, _ = _post(server.http_port, "/v2/models/echo/generate",
                             {"text_input": "hello", "temperature": 0.5,
                              "parameters": {"max_tokens": 3, "stream": False}})
    assert response.status == 200
    assert response.getheader("Content-Type") == "application/json"
    body = json.loads(raw)
    assert body["model_name"] == "echo" and body["model_version"] == "1"
    assert body["text_output"] == "HELLO"
    # fields that are no input of the model reach it as request parameters
    assert json.loads(body["parameters_seen"]) == {"temperature": 0.5, "max_tokens": 3,
                                                   "stream": False}


def test_generate_echoes_the_id_and_takes_inputs_from_parameters(server):
    # Triton's generate extension: "id" comes back on every response; a key of "parameters"
    # that names a model input is that input, the others stay request parameters
    response, raw, _ = _post(server.http_port, "/v2/models/echo/generate",
                             {"id": "req-7", "parameters": {"text_input": "from params",
                                                            "top_k": 2}})
    assert response.status == 200, raw
    body = json.loads(raw)
    assert body["id"] == "req-7" and body["text_output"] == "FROM PARAMS"
    assert json.loads(body["parameters_seen"]) == {"top_k": 2}
    # a field beats a parameter of the same name; no id asked, none answered
    response, raw, _ = _post(server.http_port, "/v2/models/echo/generate",
                             {"text_input": "field", "parameters": {"text_input": "param"}})
    body = json.loads(raw)
    assert body["text_output"] == "FIELD" and "id" not in body
    response, raw, _ = _post(server.http_port, "/v2/models/words/generate_stream",
                             {"id": "s1", "parameters": {"text_input": "a b"}})
    assert [(e["id"], e["text_output"]) for e in _events(raw)] == [("s1", "a"), ("s1", "b")]
    response, raw, _ = _post(server.http_port, "/v2/models/echo/generate",
                             {"id": 5, "text_input": "x"})
    assert response.status == 400 and "'id' must be a string" in json.loads(raw)["error"]


def test_generate_stream_on_a_model_that_is_not_decoupled(server):
    response, raw, _ = _post(server.http_port, "/v2/models/echo/generate_stream",
                             {"text_input": "once"})
    assert response.status == 200
    assert [e["text_output"] for e in _events(raw)] == ["ONCE"]


def test_generate_on_a_decoupled_model_with_one_response(server):
    response, raw, _ = _post(server.http_port, "/v2/models/words/generate", {"text_input": "solo"})
    assert response.status == 200
    assert json.loads(raw)["text_output"] == "solo"
    response, raw, _ = _post(server.http_port, "/v2/models/words/generate",
                             {"text_input": "two words"})
    assert response.status == 400       # (Triton 2.51: the same words with status 200)
    assert json.loads(raw)["error"].startswith(
        "generate expects model to produce exactly 1 response, use generate stream")
    response, raw, _ = _post(server.http_port, "/v2/models/words/generate", {"text_input": ""})
    assert response.status == 400 and "exactly 1 response" in json.loads(raw)["error"]


@pytest.mark.parametrize("body, status, text", [
    ({"text_input": "x"}, 404, "unknown"),                          # (model 'nope')
    ({}, 400, "text_input"),                                        # the input is missing
    ({"text_input": {"a": 1}}, 400, "text_input"),                  # not a string
    ({"text_input": "x", "parameters": {"p": [1, 2]}}, 400, "parameter 'p'"),
    ({"text_input": "x", "parameters": {"triton_x": 1}}, 400, "reserved"),
    (b"{not json", 400, "JSON"),
])
def test_a_request_refused_before_inference_is_a_json_error(server, body, status, text):
    model = "nope" if status == 404 else "words"
    for route in ("generate", "generate_stream"):
        response, raw, _ = _post(server.http_port, f"/v2/models/{model}/{route}", body)
        assert response.status == status, raw
        assert response.getheader("Content-Type") == "application/json"
        assert text.lower() in json.loads(raw)["error"].lower()


def test_an_error_response_mid_stream_is_an_event_and_ends_it(server):
    response, raw, _ = _post(server.http_port, "/v2/models/words/generate_stream",
                             {"text_input": "ok FAIL never"})
    assert response.status == 200
    events = _events(raw)
    assert events[0]["text_output"] == "ok"
    assert "the model failed on FAIL" in events[1]["error"]
    assert len(events) == 2


def test_http_infer_on_a_decoupled_model_is_refused(server):
    response, raw, _ = _post(server.http_port, "/v2/models/words/infer", {"inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]})
    # Triton's status (TRITONSERVER_ERROR_UNSUPPORTED: 501) and words
    assert response.status == 501
    assert json.loads(raw)["error"].startswith(
        "HTTP end point doesn't support models with decoupled transaction policy")


def test_a_client_that_disconnects_mid_stream_cancels_its_request(server, tmp_path):
    marker = tmp_path / f"cancelled-{server.http_port}"
    body = json.dumps({"text_input": " ".join(f"w{i}" for i in range(400)),
                       "parameters": {"delay": 0.05, "cancel_marker": str(marker)}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=TIMEOUT_S)
    sock.sendall(b"POST /v2/models/words/generate_stream HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))
    received = b""
    while b"w1" not in received:            # a couple of events have arrived
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the model never saw is_cancelled() after the client left"


# -- on the Jupyter server's routes ---------------------------------------------------------

@pytest.fixture
def model_repo(tmp_path):
    return write_words(tmp_path / "models")


async def test_generate_on_the_jupyter_server_behind_its_auth(jp_triton, jp_fetch):
    from tornado.httpclient import HTTPClientError
    body = json.dumps({"text_input": "one two"})
    response = await jp_fetch("v2", "models", "words", "generate_stream", method="POST",
                              body=body, headers={"Authorization": f"Bearer {INFER_KEY}"})
    assert response.code == 200
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert [e["text_output"] for e in _events(response.body)] == ["one", "two"]
    response = await jp_fetch("v2", "models", "words", "generate", method="POST",
                              body=json.dumps({"text_input": "one"}),
                              headers={"Authorization": f"token {TOKEN}"})
    assert json.loads(response.body)["text_output"] == "one"
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2", "models", "words", "generate_stream", method="POST", body=body,
                       headers={"Authorization": "Bearer wrong"})
    assert err.value.code == 403


def test_generate_stream_to_an_http10_client(server):
    """No chunked encoding for HTTP/1.0: the events, then the connection ends."""
    body = json.dumps({"text_input": "old client"}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=TIMEOUT_S)
    sock.sendall(b"POST /v2/models/words/generate_stream HTTP/1.0\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    sock.close()
    head, _, events = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
    assert b"chunked" not in head.lower()
    assert [e["text_output"] for e in _events(events)] == ["old", "client"]


async def test_a_jupyter_client_that_disconnects_mid_stream_cancels_its_request(
        jp_triton, jp_base_url, tmp_path):
    import asyncio
    marker = tmp_path / "cancelled-jupyter"
    body = json.dumps({"text_input": " ".join(f"w{i}" for i in range(400)),
                       "parameters": {"delay": 0.05, "cancel_marker": str(marker)}}).encode()
    port = jp_triton.port

    def client() -> bytes:
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        sock.sendall(b"POST %bv2/models/words/generate_stream HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     b"Authorization: Bearer %b\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b"
                     % (jp_base_url.encode(), port, INFER_KEY.encode(), len(body), body))
        received = b""
        while b"w1" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        sock.close()
        return received

    received = await asyncio.to_thread(client)
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert marker.exists(), "the model never saw is_cancelled() after the client left"


def test_generate_carries_sequence_ids_to_a_stateful_model(tmp_path):
    """Fields named as Triton's sequence parameters (sequence_id, sequence_start,
    sequence_end) reach the sequence batcher: two interleaved sequences keep their own sums."""
    from conftest import serve
    from test_sequence import accumulator
    accumulator(tmp_path / "models", "acc")
    server, client = serve(tmp_path / "models", model_control_mode="explicit", load_models=["*"])
    try:
        def add(value: int, sequence: int, **flags) -> int:
            response, raw, _ = _post(server.http_port, "/v2/models/acc/generate",
                                     {"INPUT": value, "sequence_id": sequence, **flags})
            assert response.status == 200, raw
            return json.loads(raw)["OUTPUT"]
        assert add(5, 7, sequence_start=True) == 5
        assert add(100, 8, sequence_start=True) == 100
        assert add(3, 7) == 8
        assert add(1, 8, sequence_end=True) == 101
        assert add(2, 7, sequence_end=True) == 10
        response, raw, _ = _post(server.http_port, "/v2/models/acc/generate",
                                 {"INPUT": 1, "sequence_id": 7})      # ended: a new one must start
        assert response.status == 400, raw
    finally:
        client.close()
        server.close()
