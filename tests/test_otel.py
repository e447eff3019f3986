"""``--trace-config mode=opentelemetry``: spans with the model and version on them, an
ensemble's steps as child spans, and a client's W3C ``traceparent`` (HTTP header, gRPC
metadata) continuing the client's trace; seen through an in-memory exporter."""
from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from test_trace import repository

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = repository(tmp_path_factory.mktemp("otel") / "models")
    server = start_in_thread(
        EngineOptions(model_repository=root, model_control_mode="explicit", load_models=["*"],
                      trace_config=["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]),
        host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    server.spans = InMemorySpanExporter()
    server.engine.tracing.otel.add_span_processor(SimpleSpanProcessor(server.spans))
    yield server
    server.close()


def pair_inputs(module):
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [module.InferInput("A", [1, 4], "FP32"), module.InferInput("B", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.full_like(a, 10.0))
    return inputs


def client_context() -> tuple[str, str, dict[str, str]]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def spans_of(server, trace_id: str) -> list:
    return [s for s in server.spans.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id]


def check_ensemble_trace(server, trace_id: str, span_id: str, request_id: str) -> None:
    spans = spans_of(server, trace_id)
    [parent] = [s for s in spans if s.name == "pair"]
    # the client's span is the ensemble's parent: the client's trace goes on here
    assert format(parent.parent.span_id, "016x") == span_id and parent.parent.is_remote
    assert parent.attributes["triton.model"] == "pair"
    assert parent.attributes["triton.version"] == "1"
    assert parent.attributes["triton.request_id"] == request_id
    steps = [s for s in spans if s.name == "simple"]
    assert len(steps) == 2
    for step in steps:
        assert step.parent.span_id == parent.context.span_id
        assert step.attributes["triton.model"] == "simple"
        assert step.attributes["triton.version"] == "1"
        assert step.attributes["triton.batch_size"] == 1
        assert parent.start_time <= step.start_time <= step.end_time <= parent.end_time
        [compute] = [s for s in spans if s.name == "compute" and s.parent.span_id == step.context.span_id]
        assert step.start_time <= compute.start_time <= compute.end_time <= step.end_time
        names = [e.name for e in step.events]
        assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END"
        assert {"QUEUE_START", "COMPUTE_START", "COMPUTE_END"} <= set(names)
    first, second = sorted(steps, key=lambda s: s.start_time)
    assert first.end_time <= second.start_time         # step 2 reads step 1's output


def test_http_traceparent_continues_the_clients_trace(server):
    trace_id, span_id, headers = client_context()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    result = client.infer("pair", pair_inputs(httpclient), request_id="otel-http", headers=headers)
    np.testing.assert_allclose(result.as_numpy("OUT"), [[20, 21, 22, 23]])
    check_ensemble_trace(server, trace_id, span_id, "otel-http")


def test_grpc_traceparent_continues_the_clients_trace(server):
    trace_id, span_id, headers = client_context()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    result = client.infer("pair", pair_inputs(grpcclient), request_id="otel-grpc", headers=headers)
    np.testing.assert_allclose(result.as_numpy("OUT"), [[20, 21, 22, 23]])
    client.close()
    check_ensemble_trace(server, trace_id, span_id, "otel-grpc")


def test_without_traceparent_a_new_trace_and_rate_zero(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert client.get_trace_settings()["trace_mode"] == "opentelemetry"
    before = len(server.spans.get_finished_spans())
    client.infer("pair", pair_inputs(httpclient), request_id="fresh")
    [root] = [s for s in server.spans.get_finished_spans()[before:] if s.name == "pair"]
    assert root.parent is None
    assert root.attributes["triton.request_id"] == "fresh"

    # rate 0 (Triton's advice): only requests that carry a client's context are traced
    client.update_trace_settings(settings={"trace_rate": "0"})
    try:
        before = len(server.spans.get_finished_spans())
        client.infer("pair", pair_inputs(httpclient), request_id="unsampled")
        assert len(server.spans.get_finished_spans()) == before
        trace_id, span_id, headers = client_context()
        client.infer("pair", pair_inputs(httpclient), request_id="propagated", headers=headers)
        check_ensemble_trace(server, trace_id, span_id, "propagated")
    finally:
        client.update_trace_settings(settings={"trace_rate": None})


def test_a_failed_request_ends_its_span_with_the_error(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    trace_id, _, headers = client_context()
    bad = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    other = httpclient.InferInput("INPUT1", [1, 3], "FP32")
    other.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(Exception):
        client.infer("simple", [bad, other], headers=headers)
    [span] = spans_of(server, trace_id)
    assert span.name == "simple" and not span.status.is_ok


def test_a_bls_call_is_a_child_span_of_its_caller(tmp_path: Path):
    from conftest import build_repository
    from test_trace import BLS_MODEL
    root = build_repository(tmp_path / "models")
    (root / "bls_add" / "1").mkdir(parents=True)
    (root / "bls_add" / "1" / "model.py").write_text(BLS_MODEL)
    (root / "bls_add" / "config.pbtxt").write_text('''name: "bls_add"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
''')
    server = start_in_thread(
        EngineOptions(model_repository=root, model_control_mode="explicit", load_models=["bls_add", "simple"],
                      trace_config=["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]),
        host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    spans = InMemorySpanExporter()
    server.engine.tracing.otel.add_span_processor(SimpleSpanProcessor(spans))
    trace_id, span_id, headers = client_context()
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        a = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        a.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        b = httpclient.InferInput("INPUT1", [1, 4], "FP32")
        b.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        client.infer("bls_add", [a, b], headers=headers)
    finally:
        server.close()
    mine = [s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    [caller] = [s for s in mine if s.name == "bls_add"]
    [called] = [s for s in mine if s.name == "simple"]
    assert format(caller.parent.span_id, "016x") == span_id
    assert called.parent.span_id == caller.context.span_id
    assert called.attributes["triton.model"] == "simple" and called.attributes["triton.version"] == "1"


def test_generate_stream_continues_the_clients_trace(tmp_path: Path):
    """Triton's generate_stream (server-sent events) to a decoupled model: one span for the
    request in the client's trace, an INFER_RESPONSE_COMPLETE event per response."""
    import http.client
    import json

    from decoupled_models import write_words
    root = write_words(tmp_path / "models")
    server = start_in_thread(
        EngineOptions(model_repository=root, model_control_mode="explicit", load_models=["*"],
                      trace_config=["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]),
        host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    spans = InMemorySpanExporter()
    server.engine.tracing.otel.add_span_processor(SimpleSpanProcessor(spans))
    trace_id, span_id, headers = client_context()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v2/models/words/generate_stream",
                     json.dumps({"text_input": "one two three"}),
                     {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
        assert resp.status == 200 and body.count("data:") >= 3, body
    finally:
        server.close()
    [span] = [s for s in spans.get_finished_spans()
              if format(s.context.trace_id, "032x") == trace_id and s.name == "words"]
    assert format(span.parent.span_id, "016x") == span_id
    assert [e.name for e in span.events].count("INFER_RESPONSE_COMPLETE") == 4   # 3 words + final


def test_grpc_stream_metadata_continues_the_clients_trace(tmp_path: Path):
    """ModelStreamInfer: the stream's traceparent metadata continues the client's trace for
    each request on it (tritonclient's start_stream(headers=...))."""
    import queue

    from decoupled_models import write_words
    root = write_words(tmp_path / "models")
    server = start_in_thread(
        EngineOptions(model_repository=root, model_control_mode="explicit", load_models=["*"],
                      trace_config=["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]),
        host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    spans = InMemorySpanExporter()
    server.engine.tracing.otel.add_span_processor(SimpleSpanProcessor(spans))
    trace_id, span_id, headers = client_context()
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
        for i, text in enumerate((b"a b", b"c")):
            inp = grpcclient.InferInput("text_input", [1], "BYTES")
            inp.set_data_from_numpy(np.array([text], dtype=np.object_))
            client.async_stream_infer("words", [inp], request_id=f"s{i}")
        for _ in range(3):
            result, error = got.get(timeout=30)
            assert error is None
        client.stop_stream()
    finally:
        client.close()
        server.close()
    mine = [s for s in spans.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id and s.name == "words"]
    assert sorted(s.attributes["triton.request_id"] for s in mine) == ["s0", "s1"]
    assert all(format(s.parent.span_id, "016x") == span_id for s in mine)
