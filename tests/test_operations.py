"""The v2 operations (frontends/operations.py) answer the same over HTTP and gRPC: each
refusal of a repository parameter is one rule, in each protocol's words and status."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc


@pytest.fixture
def wires(standalone):
    """(post to HTTP -> (status, body), the gRPC stub) of one standalone server."""
    def post(path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{standalone.http_port}/{path}", json.dumps(body).encode(),
            {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                raw = reply.read()
                return reply.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    channel = grpc.insecure_channel(f"127.0.0.1:{standalone.grpc_port}")
    yield post, service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _grpc_refusal(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call(request, timeout=60)
    return refused.value.code(), refused.value.details()


@pytest.mark.parametrize("http_params, grpc_params, http_words, grpc_words", [
    ({"config": 7}, {"config": pb.ModelRepositoryParameter(int64_param=7)},
     "load parameter 'config' must be a JSON string",
     "load parameter 'config' of model 'linear' must be a string_param holding the model "
     "configuration JSON"),
    ({"file:1/model.onnx": 7},
     {"file:1/model.onnx": pb.ModelRepositoryParameter(string_param="x")},
     "load parameter 'file:1/model.onnx' must be base64 text",
     "load parameter 'file:1/model.onnx' of model 'linear' must be a bytes_param holding the "
     "file content"),
])
def test_load_refusals_one_rule_each_protocols_words(wires, http_params, grpc_params,
                                                     http_words, grpc_words):
    post, stub = wires
    assert post("v2/repository/models/linear/load", {"parameters": http_params}) == \
        (400, {"error": http_words})
    assert _grpc_refusal(stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(
        model_name="linear", parameters=grpc_params)) == \
        (grpc.StatusCode.INVALID_ARGUMENT, grpc_words)


def test_unload_dependents_must_be_a_boolean_on_both(wires):
    post, stub = wires
    assert post("v2/repository/models/linear/unload",
                {"parameters": {"unload_dependents": "yes"}}) == \
        (400, {"error": "unload parameter 'unload_dependents' must be a boolean"})
    assert _grpc_refusal(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(
        model_name="linear", parameters={"unload_dependents": pb.ModelRepositoryParameter(
            string_param="yes")})) == \
        (grpc.StatusCode.INVALID_ARGUMENT, "unload parameter 'unload_dependents' must be a bool_param")


def test_a_config_without_a_value_is_no_config_on_both(wires):
    """HTTP's ``"config": null`` and gRPC's parameter with no value set both load the model
    as the repository holds it (gRPC refused the latter before the operations were one)."""
    post, stub = wires
    assert post("v2/repository/models/linear/unload", {}) == (200, {})
    assert post("v2/repository/models/linear/load", {"parameters": {"config": None}}) == (200, {})
    assert stub.ModelReady(pb.ModelReadyRequest(name="linear"), timeout=60).ready
    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="linear"), timeout=60)
    assert not stub.ModelReady(pb.ModelReadyRequest(name="linear"), timeout=60).ready
    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(
        model_name="linear", parameters={"config": pb.ModelRepositoryParameter()}), timeout=60)
    assert stub.ModelReady(pb.ModelReadyRequest(name="linear"), timeout=60).ready


def test_a_version_is_read_once_for_every_operation(wires):
    """gRPC carries the version as free text: every model operation reads it by Triton's
    rule before a model is looked up."""
    _, stub = wires
    words = ("failed to get model version from specified version string 'one' (details: stol), "
             "version should be an integral value > 0")
    for call, request in ((stub.ModelReady, pb.ModelReadyRequest(name="linear", version="one")),
                          (stub.ModelMetadata, pb.ModelMetadataRequest(name="linear",
                                                                       version="one")),
                          (stub.ModelConfig, pb.ModelConfigRequest(name="linear", version="one")),
                          (stub.ModelStatistics, pb.ModelStatisticsRequest(name="linear",
                                                                           version="one"))):
        assert _grpc_refusal(call, request) == (grpc.StatusCode.INVALID_ARGUMENT, words)
