"""A decoupled (streaming) model as the middle step of an ensemble, as Triton allows it:
preprocess -> words (one response per word) -> postprocess. Each response of the middle step
flows through the last step and out, in order, on the gRPC stream, generate_stream and the
OpenAI route; a client that goes away cancels every step."""
from __future__ import annotations

import http.client
import json
import queue
import socket
import time

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from google.protobuf import text_format

from decoupled_models import write_model, write_words
from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.composition.ensemble import plan
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.standalone import start_in_thread

TIMEOUT_S = 30

PRE_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "text_output", np.array([text.decode().upper().encode()], dtype=np.object_))]))
        return out
'''

# Two instances, and earlier (longer) words wait longer: without the ensemble putting its
# responses back in order, they would come out shortest first.
POST_MODEL = '''\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            word = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            time.sleep(0.02 * len(word))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "text_output", np.array([b"<" + word + b">"], dtype=np.object_))]))
        return out
'''

STEP_CONFIG = '''\
name: "{name}"
backend: "python"
max_batch_size: 0
instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
input [ {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }} ]
'''

STREAMING_ENSEMBLE = '''\
name: "stream_pipe"
platform: "ensemble"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
ensemble_scheduling {
  max_inflight_requests: 4
  step [
    { model_name: "pre" model_version: -1
      input_map { key: "text_input" value: "text_input" } output_map { key: "text_output" value: "upper" } },
    { model_name: "words" model_version: -1
      input_map { key: "text_input" value: "upper" } output_map { key: "text_output" value: "word" } },
    { model_name: "post" model_version: -1
      input_map { key: "text_input" value: "word" } output_map { key: "text_output" value: "text_output" } } ] }
'''

WORDS = ["abcdefgh", "abcdef", "abcd", "ab", "a"]      # longest first
EXPECTED = [f"<{w.upper()}>" for w in WORDS]


def write_repository(root):
    write_words(root)
    write_model(root, "pre", PRE_MODEL, STEP_CONFIG.format(name="pre", count=1))
    write_model(root, "post", POST_MODEL, STEP_CONFIG.format(name="post", count=2))
    (root / "stream_pipe" / "1").mkdir(parents=True)
    (root / "stream_pipe" / "config.pbtxt").write_text(STREAMING_ENSEMBLE)
    (root / "undeclared" / "1").mkdir(parents=True)
    (root / "undeclared" / "config.pbtxt").write_text(
        STREAMING_ENSEMBLE.replace('"stream_pipe"', '"undeclared"')
        .replace("model_transaction_policy { decoupled: true }\n", ""))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_repository(tmp_path_factory.mktemp("models"))
    served = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield served
    served.close()


def _text(text: str) -> list:
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return [t]


def test_each_response_of_the_middle_step_flows_out_in_order_over_grpc(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("stream_pipe", _text(" ".join(WORDS)), request_id="r1",
                                  enable_empty_final_response=True)
        got, final = [], False
        while not final:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None, error
            response = result.get_response()
            assert response.id == "r1"
            final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                got.append(result.as_numpy("text_output").reshape(-1)[0].decode())
    finally:
        client.stop_stream()
        client.close()
    assert got == EXPECTED


def _post(port: int, path: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response, response.read()


def test_generate_stream_and_the_openai_route_stream_the_ensemble(server):
    response, raw = _post(server.http_port, "/v2/models/stream_pipe/generate_stream",
                          {"text_input": " ".join(WORDS)})
    assert response.status == 200
    events = [json.loads(block[len("data: "):]) for block in raw.decode().split("\n\n") if block]
    assert [e["text_output"] for e in events] == EXPECTED
    assert {e["model_name"] for e in events} == {"stream_pipe"}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="any",
                           max_retries=0, timeout=TIMEOUT_S)
    chunks = list(client.completions.create(model="stream_pipe", prompt="x yy zzz", stream=True))
    assert [c.choices[0].text for c in chunks if c.choices[0].text] == ["<X>", "<YY>", "<ZZZ>"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    done = client.completions.create(model="stream_pipe", prompt="p q r", max_tokens=2)
    assert done.choices[0].text == "<P><Q>" and done.choices[0].finish_reason == "length"


def test_a_one_response_call_to_the_streaming_ensemble_is_refused(server):
    response, raw = _post(server.http_port, "/v2/models/stream_pipe/infer", {"inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]})
    assert response.status == 501
    assert "decoupled transaction policy" in json.loads(raw)["error"]


def test_an_error_response_of_the_middle_step_is_one_of_the_ensembles(server):
    response, raw = _post(server.http_port, "/v2/models/stream_pipe/generate_stream",
                          {"text_input": "ok fail never"})
    events = [json.loads(block[len("data: "):]) for block in raw.decode().split("\n\n") if block]
    assert events[0]["text_output"] == "<OK>"
    # (generate_stream ends at an error event, as for any model)
    assert "ensemble 'stream_pipe' step 2 ('words' v1) failed" in events[1]["error"]
    assert "the model failed on FAIL" in events[1]["error"]


def test_a_client_that_goes_away_cancels_every_step(server, tmp_path):
    marker = tmp_path / "cancelled"
    body = json.dumps({"text_input": " ".join(f"w{i}" for i in range(400)),
                       "parameters": {"delay": 0.05, "cancel_marker": str(marker)}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=TIMEOUT_S)
    sock.sendall(b"POST /v2/models/stream_pipe/generate_stream HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))
    received = b""
    while b"<W1>" not in received:          # a couple of responses went all the way through
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    sock.close()
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the streaming step never saw is_cancelled() after the client left"
    # the last step stops too: its count settles (what it had begun may still end) well
    # short of the 400 words, which it would reach, still counting, without the cancel
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def count() -> int:
        stats = client.get_inference_statistics("post", as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0))
    counts = [-1, count()]
    while counts[-1] != counts[-2]:
        assert time.monotonic() < deadline + TIMEOUT_S, counts
        time.sleep(0.5)
        counts.append(count())
    assert counts[-1] < 400, counts
    assert client.is_model_ready("stream_pipe")
    client.close()


# -- what the plan refuses, as Triton refuses it --------------------------------------------------

def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def _lookup(model: str, version: str) -> mc.ModelConfig:
    decoupled = model.startswith("stream")
    return _config(f'''name: "{model}" max_batch_size: 0
        model_transaction_policy {{ decoupled: {str(decoupled).lower()} }}
        input [ {{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] }},
                {{ name: "B" data_type: TYPE_FP32 dims: [ 1 ] optional: true }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]''')


def _ensemble(steps: str) -> mc.ModelConfig:
    return _config(f'''name: "e" platform: "ensemble" max_batch_size: 0
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {steps} ] }}''')


def test_a_step_may_not_mix_responses_of_different_decoupled_steps():
    ok = _ensemble('''
        { model_name: "stream1" input_map { key: "A" value: "X" } output_map { key: "Y" value: "s" } },
        { model_name: "stream2" input_map { key: "A" value: "s" } output_map { key: "Y" value: "t" } },
        { model_name: "plain" input_map { key: "A" value: "t" } output_map { key: "Y" value: "OUT" } }''')
    assert [s.decoupled for s in plan(ok, _lookup)] == [True, True, False]
    mixed = _ensemble('''
        { model_name: "stream1" input_map { key: "A" value: "X" } output_map { key: "Y" value: "s" } },
        { model_name: "plain" input_map [ { key: "A" value: "s" }, { key: "B" value: "X" } ]
          output_map { key: "Y" value: "OUT" } }''')
    with pytest.raises(InvalidArgument, match="receives inputs originated from different "
                                              "decoupled models"):
        plan(mixed, _lookup)
    siblings = _ensemble('''
        { model_name: "stream1" input_map { key: "A" value: "X" } output_map { key: "Y" value: "s" } },
        { model_name: "stream2" input_map { key: "A" value: "X" } output_map { key: "Y" value: "t" } },
        { model_name: "plain" input_map { key: "A" value: "s" } output_map { key: "Y" value: "OUT" } }''')
    with pytest.raises(InvalidArgument, match="read the same responses"):
        plan(siblings, _lookup)


def test_the_notebooks_ensemble_of_a_streaming_step_is_decoupled(server):
    from jupyter_triton.kernel.ensemble import ensemble_config, parse_steps
    triton = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def config_of(model: str, version: str = "") -> dict:
        return triton.get_model_config(model, version, as_json=True)["config"]

    steps = parse_steps("pre: text_input=text_input -> text_output=upper\n"
                        "words: text_input=upper -> text_output=word\n"
                        "post: text_input=word -> text_output=text_output")
    assert ensemble_config("e", steps, config_of).model_transaction_policy.decoupled
    assert not ensemble_config("e", steps[:1], config_of).model_transaction_policy.decoupled
    triton.close()


def test_an_ensemble_with_a_streaming_step_not_declared_decoupled_is_made_decoupled(server):
    # as tritonserver does at load: the ensemble streams, and its config says so
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    config = client.get_model_config("undeclared", as_json=True)["config"]
    assert config.get("model_transaction_policy", {}).get("decoupled") is True
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("undeclared", _text("a b"), enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                got.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert len(got) == 2, got
