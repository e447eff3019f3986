"""Traffic capture of streamed requests (issue 37, item 1): a decoupled model's stream, over
HTTP generate_stream and over a gRPC stream, is one row when it ends, its responses' pieces
joined; an error response in the stream is the row's status; a client that stops reading
leaves a row of what it got."""
from __future__ import annotations

import json
import queue
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from decoupled_models import write_words
from jupyter_triton.engine import EngineOptions
from jupyter_triton.kernel.discovery import Connection
from jupyter_triton.kernel.handle import ServedModel
from jupyter_triton.standalone import start_in_thread

pytest.importorskip("pandas")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(tmp_path: Path):
    write_words(tmp_path)
    server = start_in_thread(EngineOptions(model_repository=tmp_path, model_control_mode="explicit",
                                           load_models=["words"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield server
    server.close()


def generate_stream(server, text: str, request_id: str) -> list[str]:
    body = json.dumps({"id": request_id, "text_input": text}).encode()
    request = urllib.request.Request(f"{server.url}/v2/models/words/generate_stream",
                                     data=body, method="POST")
    words = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "text_output" in event:
                    words.append(event["text_output"])
    return words


def grpc_stream(server, text: str, request_id: str) -> list[str]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        client.async_stream_infer("words", [tensor], request_id=request_id,
                                  enable_empty_final_response=True)
        words = []
        while True:
            result, error = answers.get(timeout=60)
            if error is not None:
                words.append(f"error: {error}")
                continue
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                return words
            words.append(result.as_numpy("text_output")[0].decode())
    finally:
        client.stop_stream()
        client.close()


def test_a_stream_is_one_row_with_its_pieces_joined(server):
    words = ServedModel("words", 1, Connection(server.url))
    words.capture()
    assert generate_stream(server, "one two three", "h1") == ["one", "two", "three"]
    assert grpc_stream(server, "four five", "g1") == ["four", "five"]
    assert grpc_stream(server, "six FAIL seven", "g2")[1].startswith("error: ")

    frame = words.traffic()
    assert frame["id"].tolist() == ["h1", "g1", "g2"]
    assert frame["status"].tolist()[:2] == [200, 200]
    assert frame["status"][2] != 200 and "failed on FAIL" in frame["error"][2]
    assert [w.decode() for w in frame["outputs"][0]["text_output"]] == ["one", "two", "three"]
    assert [w.decode() for w in frame["outputs"][1]["text_output"]] == ["four", "five"]
    assert [w.decode() for w in frame["outputs"][2]["text_output"]] == ["six", "seven"]
    assert frame["inputs"][1]["text_input"].tolist() == [b"four five"]

    words.capture(capture=False)
    assert grpc_stream(server, "eight", "g3") == ["eight"]
    assert words.traffic()["id"].tolist() == ["h1", "g1", "g2"]     # stopped: no new row


def test_a_client_that_stops_reading_leaves_a_row_of_what_it_got(server):
    import http.client
    import time
    words = ServedModel("words", 1, Connection(server.url))
    words.capture()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = json.dumps({"id": "gone", "text_input": "a b c d e f g h i j",
                       "parameters": {"delay": 0.5}})
    connection.request("POST", "/v2/models/words/generate_stream", body=body)
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")      # the first word arrived
    connection.sock.shutdown(2)
    connection.close()
    deadline = time.monotonic() + 60                      # the server notices the hang-up
    while words.traffic().empty:
        assert time.monotonic() < deadline, "no row for the abandoned stream"
        time.sleep(0.1)
    row = words.traffic().iloc[0]
    assert row["id"] == "gone" and row["status"] == 499, row.to_dict()
    assert 1 <= len(row["outputs"]["text_output"]) < 10
