"""Triton's trace extension: tritonclient's trace-settings calls over HTTP and gRPC, and the
trace JSON a traced request writes (timestamps, tensors, an ensemble's steps as children)."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import build_repository
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

pytestmark = pytest.mark.timeout(120)

PAIR = """name: "pair"
platform: "ensemble"
max_batch_size: 4
input [ { name: "A", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } },
  { model_name: "simple" model_version: -1
    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "OUT" } } ] }
"""
STARTUP = {"trace_file": "", "trace_level": ["TIMESTAMPS"], "trace_rate": "1",
           "trace_count": "-1", "log_frequency": "0", "trace_mode": "triton"}
STAMPS = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
          "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]


def repository(root: Path) -> Path:
    build_repository(root)
    (root / "pair" / "1").mkdir(parents=True)
    (root / "pair" / "config.pbtxt").write_text(PAIR)
    return root


def start(root: Path, *trace_config: str):
    return start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                         load_models=["*"], trace_config=list(trace_config)),
                           host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return repository(tmp_path_factory.mktemp("trace") / "models")


@pytest.fixture
def server(repo: Path, tmp_path: Path):
    trace_file = tmp_path / "trace.json"
    server = start(repo, f"triton,file={trace_file}", "level=TIMESTAMPS", "rate=1")
    server.trace_file = trace_file
    yield server
    server.close()


def startup(server) -> dict:
    return {**STARTUP, "trace_file": str(server.trace_file)}


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)


def infer_simple(client, request_id: str = "", model: str = "simple") -> np.ndarray:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return client.infer(model, inputs, request_id=request_id).as_numpy("OUTPUT0")


def infer_pair(client, request_id: str = "") -> np.ndarray:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [httpclient.InferInput("A", [1, 4], "FP32"), httpclient.InferInput("B", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.full_like(a, 10.0))
    return client.infer("pair", inputs, request_id=request_id).as_numpy("OUT")


def traces(entries: list[dict]) -> dict[int, dict]:
    """Trace file entries grouped per trace id: its head, its timestamps, its tensors."""
    out: dict[int, dict] = {}
    for e in entries:
        t = out.setdefault(e["id"], {"stamps": {}, "tensors": []})
        if "model_name" in e:
            t["head"] = e
        for stamp in e.get("timestamps", []):
            t["stamps"][stamp["name"]] = stamp["ns"]
        if "activity" in e:
            t["tensors"].append(e)
    return out


def post(server, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read() or b"{}")
    conn.close()
    return status, data


def test_http_settings_as_triton(server):
    client = http_client(server)
    assert "trace" in client.get_server_metadata()["extensions"]
    initial = startup(server)
    assert client.get_trace_settings() == initial
    assert client.get_trace_settings(model_name="simple") == initial

    # a model's own settings override field by field; the rest follow the global ones
    model = client.update_trace_settings(model_name="simple",
                                         settings={"trace_rate": "12", "log_frequency": "34"})
    assert model == {**initial, "trace_rate": "12", "log_frequency": "34"}
    glob = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"],
                                                  "trace_rate": "56"})
    assert glob == {**initial, "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "56"}
    assert client.get_trace_settings(model_name="simple") == {
        **initial, "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "12", "log_frequency": "34"}

    # clearing: a model's setting falls back to the global one, a global one to its startup value
    assert client.update_trace_settings(model_name="simple", settings={"trace_rate": None}) == {
        **initial, "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "56", "log_frequency": "34"}
    assert client.update_trace_settings(settings={"trace_level": None, "trace_rate": None}) == initial
    assert client.update_trace_settings(model_name="simple", settings={"log_frequency": None}) == initial

    with pytest.raises(InferenceServerException, match="trace file location can not be updated"):
        client.update_trace_settings(model_name="simple", settings={"trace_file": "elsewhere.log"})
    with pytest.raises(InferenceServerException, match="Request for unknown model : does-not-exist"):
        client.get_trace_settings(model_name="does-not-exist")
    with pytest.raises(InferenceServerException, match="Request for unknown model : does-not-exist"):
        client.update_trace_settings(model_name="does-not-exist", settings={"trace_rate": "2"})
    assert client.get_trace_settings() == initial          # a refused update changed nothing


def test_http_bad_settings_are_400(server):
    for body, words in ((b'{"trace_rate": "abc"}', "trace_rate"),
                        (b'{"trace_rate": "-1"}', "trace_rate"),
                        (b'{"trace_level": ["LOUD"]}', "LOUD"),
                        (b'{"trace_level": ["OFF", "TENSORS"]}', "OFF"),
                        (b'{"trace_count": "-2"}', "trace_count"),
                        (b'{"no_such_setting": "1"}', "no_such_setting"),
                        (b'[1, 2]', "JSON object"),
                        (b'{"trace_rate": ', "JSON")):
        status, reply = post(server, "/v2/trace/setting", body)
        assert status == 400, (body, reply)
        assert words in reply["error"]
    assert http_client(server).get_trace_settings() == startup(server)


def test_grpc_settings_as_triton(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    initial = startup(server)

    def plain(response) -> dict:
        return {k: list(v.value) if k == "trace_level" else v.value[0]
                for k, v in response.settings.items()}

    assert plain(client.get_trace_settings()) == initial
    assert plain(client.get_trace_settings(model_name="simple")) == initial
    assert plain(client.update_trace_settings(model_name="simple", settings={"trace_count": "3"})) == \
        {**initial, "trace_count": "3"}
    assert plain(client.update_trace_settings(settings={"trace_level": ["TENSORS"]})) == \
        {**initial, "trace_level": ["TENSORS"]}
    assert plain(client.get_trace_settings(model_name="simple")) == \
        {**initial, "trace_level": ["TENSORS"], "trace_count": "3"}
    # None clears (tritonclient sends an empty value)
    assert plain(client.update_trace_settings(model_name="simple", settings={"trace_count": None})) == \
        {**initial, "trace_level": ["TENSORS"]}
    assert plain(client.update_trace_settings(settings={"trace_level": None})) == initial
    with pytest.raises(InferenceServerException, match="trace file location can not be updated"):
        client.update_trace_settings(settings={"trace_file": "x"})
    with pytest.raises(InferenceServerException, match="unknown trace level"):
        client.update_trace_settings(settings={"trace_level": ["LOUD"]})
    with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
        client.get_trace_settings(model_name="nope")
    client.close()


def test_traced_requests_write_triton_trace_json(repo: Path, tmp_path: Path):
    trace_file = tmp_path / "trace.json"
    server = start(repo, f"triton,file={trace_file}", "level=TIMESTAMPS", "rate=1")
    try:
        client = http_client(server)
        np.testing.assert_allclose(infer_simple(client, "req-1"), [[1, 2, 3, 4]])
        np.testing.assert_allclose(infer_pair(client, "req-2"), [[20, 21, 22, 23]])
    finally:
        server.close()              # log_frequency 0: the file is complete at shutdown
    entries = json.loads(trace_file.read_text())
    assert isinstance(entries, list)
    by_id = traces(entries)
    assert len(by_id) == 4          # simple, and the ensemble with its two steps
    [simple] = [t for t in by_id.values() if t["head"].get("request_id") == "req-1"]
    assert simple["head"]["model_name"] == "simple" and simple["head"]["model_version"] == 1
    assert "parent_id" not in simple["head"]
    assert list(simple["stamps"]) == STAMPS
    ns = [simple["stamps"][name] for name in STAMPS]
    assert ns == sorted(ns) and ns[-1] > ns[0]

    [parent] = [t for t in by_id.values() if t["head"]["model_name"] == "pair"]
    assert parent["head"]["request_id"] == "req-2" and parent["head"]["model_version"] == 1
    children = [t for t in by_id.values() if t["head"].get("parent_id") == parent["head"]["id"]]
    assert [c["head"]["model_name"] for c in children] == ["simple", "simple"]
    for child in children:
        assert list(child["stamps"]) == STAMPS
        # every step happens within its ensemble's request
        assert parent["stamps"]["REQUEST_START"] <= child["stamps"]["REQUEST_START"]
        assert child["stamps"]["REQUEST_END"] <= parent["stamps"]["REQUEST_END"]
    first, second = sorted(children, key=lambda c: c["stamps"]["REQUEST_START"])
    assert first["stamps"]["REQUEST_END"] <= second["stamps"]["COMPUTE_START"]


def test_tensors_rate_and_count(server):
    client = http_client(server)
    client.update_trace_settings(model_name="simple", settings={"trace_level": ["TENSORS"]})
    infer_simple(client, "tensors")
    recent = traces(server.engine.tracing.recent())
    [traced] = [t for t in recent.values() if t["head"].get("request_id") == "tensors"]
    by_name = {(e["activity"], e["tensor"]["name"]): e["tensor"] for e in traced["tensors"]}
    assert by_name[("TENSOR_QUEUE_INPUT", "INPUT0")] == {
        "name": "INPUT0", "data": "0.0,1.0,2.0,3.0", "shape": "1,4", "dtype": "FP32"}
    assert by_name[("TENSOR_BACKEND_OUTPUT", "OUTPUT0")]["data"] == "1.0,2.0,3.0,4.0"

    # every 2nd request, 2 traces in all; then the count says none remain
    client.update_trace_settings(model_name="simple", settings={"trace_level": ["TIMESTAMPS"],
                                                                 "trace_rate": "2", "trace_count": "2"})
    before = len(traces(server.engine.tracing.recent()))
    for i in range(8):
        infer_simple(client, f"counted-{i}")
    counted = [t for t in traces(server.engine.tracing.recent()).values()
               if t["head"].get("request_id", "").startswith("counted-")]
    assert sorted(t["head"]["request_id"] for t in counted) == ["counted-1", "counted-3"]
    assert len(traces(server.engine.tracing.recent())) == before + 2
    assert client.get_trace_settings(model_name="simple")["trace_count"] == "0"
    assert client.get_trace_settings()["trace_count"] == "-1"

    # level OFF for the model: its requests go untraced while the others still are
    client.update_trace_settings(model_name="simple", settings={"trace_level": ["OFF"],
                                                                 "trace_count": None})
    infer_simple(client, "off")
    infer_pair(client, "pair-on")
    heads = [t["head"] for t in traces(server.engine.tracing.recent()).values()]
    assert not any(h.get("request_id") == "off" for h in heads)
    assert any(h.get("request_id") == "pair-on" for h in heads)


def test_log_frequency_writes_numbered_files(repo: Path, tmp_path: Path):
    trace_file = tmp_path / "trace.json"
    server = start(repo, f"triton,file={trace_file}", "triton,log-frequency=2", "level=TIMESTAMPS",
                   "rate=1")
    try:
        client = http_client(server)
        for i in range(5):
            infer_simple(client, f"n{i}")
        # 2 traces a file as they are collected; the fifth waits for shutdown
        assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.0", "trace.json.1"]
    finally:
        server.close()
    files = sorted(tmp_path.glob("trace.json.*"))
    assert [p.name for p in files] == ["trace.json.0", "trace.json.1", "trace.json.2"]
    ids = [[t["head"]["request_id"] for t in traces(json.loads(p.read_text())).values()]
           for p in files]
    assert ids == [["n0", "n1"], ["n2", "n3"], ["n4"]]


def test_tracing_off_leaves_requests_untraced(repo: Path):
    server = start(repo)
    try:
        client = http_client(server)
        assert client.get_trace_settings()["trace_level"] == ["OFF"]
        assert server.engine.tracing.on is False
        infer_simple(client)
        assert server.engine.tracing.recent() == []
        # switched on over the protocol, the next request is traced (default rate 1000:
        # set 1 to see it)
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        assert server.engine.tracing.on is True
        infer_simple(client, "now")
        assert [e["request_id"] for e in server.engine.tracing.recent() if "request_id" in e] == ["now"]
    finally:
        server.close()


def test_a_decoupled_stream_is_one_trace_with_a_stamp_per_response(tmp_path: Path):
    """tritonclient's gRPC stream to a decoupled model: one trace for the request, each
    response stamped INFER_RESPONSE_COMPLETE, its outputs as TENSORS."""
    import queue

    from decoupled_models import write_words
    root = write_words(tmp_path / "models")
    server = start(root, "level=TENSORS", "rate=1")
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hello world"], dtype=np.object_))
        client.async_stream_infer("words", [text], request_id="stream-1")
        words = []
        for _ in range(2):
            result, error = got.get(timeout=30)
            assert error is None
            words.append(result.as_numpy("text_output")[0])
        client.stop_stream()
        assert words == [b"hello", b"world"]
    finally:
        client.close()
        server.close()
    [traced] = [t for t in traces(server.engine.tracing.recent()).values()
                if t["head"].get("request_id") == "stream-1"]
    assert traced["head"]["model_name"] == "words" and traced["head"]["model_version"] == 1
    names = [e["timestamps"][0]["name"] for e in server.engine.tracing.recent()
             if e["id"] == traced["head"]["id"] and "timestamps" in e]
    assert names[0] == "REQUEST_START" and "REQUEST_END" in names
    assert names.count("INFER_RESPONSE_COMPLETE") == 3      # two words, then the final flag
    stamps = [e["timestamps"][0]["ns"] for e in server.engine.tracing.recent()
              if e["id"] == traced["head"]["id"] and "timestamps" in e]
    assert stamps == sorted(stamps)
    assert {"QUEUE_START", "COMPUTE_START", "COMPUTE_END"} <= set(names)
    tensors = [(e["activity"], e["tensor"]["data"]) for e in traced["tensors"]]
    assert tensors == [("TENSOR_QUEUE_INPUT", "hello world"), ("TENSOR_BACKEND_OUTPUT", "hello"),
                       ("TENSOR_BACKEND_OUTPUT", "world")]


BLS_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="simple", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
'''


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_bls_call_is_a_child_of_its_callers_trace(tmp_path: Path, mode: str):
    root = build_repository(tmp_path / "models")
    (root / "bls_add" / "1").mkdir(parents=True)
    (root / "bls_add" / "1" / "model.py").write_text(BLS_MODEL)
    (root / "bls_add" / "config.pbtxt").write_text(f'''name: "bls_add"
backend: "python"
max_batch_size: 4
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }}, {{ name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "{mode}" }} }}
''')
    server = start(root, "level=TIMESTAMPS", "rate=1")
    try:
        client = http_client(server)
        np.testing.assert_allclose(infer_simple(client, "bls-1", model="bls_add"), [[1, 2, 3, 4]])
        # with the caller untraced, its BLS call is not traced either
        client.update_trace_settings(model_name="bls_add", settings={"trace_level": ["OFF"]})
        infer_simple(client, "bls-off", model="bls_add")
    finally:
        server.close()
    by_id = traces(server.engine.tracing.recent())
    [caller] = [t for t in by_id.values() if t["head"]["model_name"] == "bls_add"]
    assert caller["head"]["request_id"] == "bls-1"
    [child] = [t for t in by_id.values() if t["head"]["model_name"] == "simple"]
    assert child["head"]["parent_id"] == caller["head"]["id"]
    # the call is made while the caller computes
    assert caller["stamps"]["COMPUTE_START"] <= child["stamps"]["REQUEST_START"]
    assert child["stamps"]["REQUEST_END"] <= caller["stamps"]["COMPUTE_END"]


def test_recent_traces_are_bounded(monkeypatch, repo: Path):
    import jupyter_triton.engine.observation.trace as trace_module
    monkeypatch.setattr(trace_module, "RECENT_TRACES", 3)
    server = start(repo, "level=TENSORS", "rate=1")
    try:
        client = http_client(server)
        for i in range(5):
            infer_simple(client, f"r{i}")
        ids = [e["request_id"] for e in server.engine.tracing.recent() if "request_id" in e]
        assert ids == ["r2", "r3", "r4"]
        # tensor data counts against its own budget: past it only the newest trace stays
        monkeypatch.setattr(trace_module, "RECENT_TENSOR_BYTES", 10)
        infer_simple(client, "big")
        ids = [e["request_id"] for e in server.engine.tracing.recent() if "request_id" in e]
        assert ids == ["big"]
    finally:
        server.close()


def test_cli_trace_flags_as_tritonserver(repo: Path, tmp_path: Path):
    import re
    import subprocess
    import sys
    trace_file = tmp_path / "cli-trace.json"
    base = [sys.executable, "-m", "jupyter_triton.cli", "serve", "--model-repository", str(repo),
            "--http-port", "0", "--grpc-port", "0", "--allow-metrics", "false",
            "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--model-control-mode",
            "explicit", "--load-model", "simple"]
    # the deprecated spellings and --trace-config together, as tritonserver 2.51 takes them
    proc = subprocess.Popen(base + ["--trace-file", str(trace_file), "--trace-level", "TIMESTAMPS",
                                    "--trace-rate", "1", "--trace-config", "count=5",
                                    "--trace-config", "triton,log-frequency=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        match = None
        for _ in range(20):                 # the server's own log lines come first
            line = proc.stdout.readline()
            match = re.search(r"HTTP http://127\.0\.0\.1:(\d+)", line)
            if match or not line:
                break
        assert match, line
        client = httpclient.InferenceServerClient(f"127.0.0.1:{match.group(1)}")
        assert client.get_trace_settings() == {**STARTUP, "trace_file": str(trace_file),
                                               "trace_count": "5"}
        infer_simple(client, "from-cli")
        assert client.get_trace_settings()["trace_count"] == "4"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # SIGTERM stops the server cleanly: the trace file is complete
    heads = [e for e in json.loads(trace_file.read_text()) if "model_name" in e]
    assert [h["request_id"] for h in heads] == ["from-cli"]

    bad = subprocess.run(base + ["--trace-config", "level=LOUD"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0
    assert "unknown trace level 'LOUD'" in bad.stderr and "Traceback" not in bad.stderr


def test_settings_of_an_unknown_model_are_refused_with_400(server):
    # tritonserver 2.51: HTTP 400 and gRPC INVALID_ARGUMENT, "Request for unknown model : <m>",
    # for GET and POST alike (read from it: the same calls against its python backend)
    client = http_client(server)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        for call in (lambda: client.get_trace_settings(model_name="nosuch"),
                     lambda: client.update_trace_settings(model_name="nosuch",
                                                          settings={"trace_rate": "5"})):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert (err.value.status(), err.value.message()) == (
                "400", "Request for unknown model : nosuch")
        with pytest.raises(InferenceServerException) as err:
            grpc.get_trace_settings(model_name="nosuch")
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()
        grpc.close()
