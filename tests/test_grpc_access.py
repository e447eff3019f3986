"""Credentials on the gRPC port: every RPC is checked against its Triton API group, from the
``authorization`` metadata (and tritonserver's restricted-protocol headers), through a real
standalone server and the unmodified tritonclient.grpc client."""
from __future__ import annotations

import json
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import GROUPS, INFERENCE_SCOPE, AccessPolicy, Restriction
from onnx_models import linear

ADMIN, INFER = "admin-token-1", "infer-key-1"


def _start(model_repo, policy: AccessPolicy):
    from jupyter_triton.standalone import start_in_thread
    return start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                         load_models=["linear"]),
                           host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                           grpc_access=policy)


@pytest.fixture
def keyed(model_repo):
    """A server whose gRPC port knows an admin token and an inference key, nothing anonymous."""
    server = _start(model_repo, AccessPolicy(tokens={ADMIN: GROUPS, INFER: INFERENCE_SCOPE}))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield server, client
    client.close()
    server.close()


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _x() -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [inp]


def _status(call, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call(*args, **kwargs)
    return err.value.status(), err.value.message()


def test_no_credential_is_unauthenticated(keyed):
    _, client = keyed
    for call, args in [(client.is_server_live, ()), (client.infer, ("linear", _x())),
                       (client.get_model_repository_index, ()),
                       (client.get_inference_statistics, ("linear",))]:
        status, message = _status(call, *args)
        assert status == "StatusCode.UNAUTHENTICATED", call
        assert "authentication required" in message
    status, message = _status(client.infer, "linear", _x(), headers=_bearer("made-up"))
    assert status == "StatusCode.UNAUTHENTICATED" and "not valid" in message


def test_inference_key_infers_and_reads_stats_but_cannot_load(keyed, model_repo):
    _, client = keyed
    h = _bearer(INFER)
    assert client.is_server_live(headers=h) and client.is_model_ready("linear", headers=h)
    assert client.get_model_metadata("linear", headers=h).name == "linear"
    assert client.get_model_config("linear", headers=h).config.max_batch_size == 8
    out = client.infer("linear", _x(), headers=h).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    stats = client.get_inference_statistics("linear", headers=h).model_stats[0]
    assert stats.inference_stats.success.count == 1

    cfg = json.dumps({"name": "g", "backend": "onnxruntime", "max_batch_size": 8,
                      "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                      "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]})
    files = {"file:1/model.onnx": linear(W)}
    status, message = _status(client.load_model, "g", config=cfg, files=files, headers=h)
    assert status == "StatusCode.PERMISSION_DENIED" and "model-repository" in message
    assert not (model_repo / "g").exists()
    for call in (client.unload_model, client.get_model_repository_index):
        args = ("linear",) if call == client.unload_model else ()
        assert _status(call, *args, headers=h)[0] == "StatusCode.PERMISSION_DENIED"
    assert client.is_model_ready("linear", headers=h)

    admin = _bearer(ADMIN)
    client.load_model("g", config=cfg, files=files, headers=admin)
    assert client.is_model_ready("g", headers=h)


def test_stream_needs_a_credential(keyed):
    _, client = keyed
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        try:    # the stream may already be refused before this request is written
            client.async_stream_infer("linear", _x(), request_id="anon")
        except InferenceServerException:
            pass
        result, error = results.get(timeout=10)
    finally:
        client.stop_stream()
    assert result is None and error.status() == "StatusCode.UNAUTHENTICATED"

    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers=_bearer(INFER))
    try:
        client.async_stream_infer("linear", _x(), request_id="keyed")
        result, error = results.get(timeout=10)
    finally:
        client.stop_stream()
    assert error is None and result.get_response().id == "keyed"
    assert result.as_numpy("OUTPUT0").shape == (1, 4)


# Every RPC of the service and the API group tritonserver files it under.
RPCS = [
    ("ServerLive", pb.ServerLiveRequest(), "health"),
    ("ServerReady", pb.ServerReadyRequest(), "health"),
    ("ModelReady", pb.ModelReadyRequest(name="linear"), "health"),
    ("ServerMetadata", pb.ServerMetadataRequest(), "metadata"),
    ("ModelMetadata", pb.ModelMetadataRequest(name="linear"), "metadata"),
    ("ModelConfig", pb.ModelConfigRequest(name="linear"), "model-config"),
    ("ModelStatistics", pb.ModelStatisticsRequest(name="linear"), "statistics"),
    ("ModelInfer", pb.ModelInferRequest(model_name="linear"), "inference"),
    ("RepositoryIndex", pb.RepositoryIndexRequest(), "model-repository"),
    ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="x"), "model-repository"),
    ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="x"), "model-repository"),
    ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(), "shared-memory"),
    ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(name="r"), "shared-memory"),
    ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="r"),
     "shared-memory"),
    ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(), "shared-memory"),
    ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(name="r"), "shared-memory"),
    ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name="r"),
     "shared-memory"),
    ("TraceSetting", pb.TraceSettingRequest(), "trace"),
    ("LogSettings", pb.LogSettingsRequest(), "logging"),
]


def test_every_rpc_is_checked_against_its_group(model_repo):
    """A token that reaches every group but one is refused exactly the RPCs of that group."""
    tokens = {f"all-but-{g}": GROUPS - {g} for g in GROUPS}
    server = _start(model_repo, AccessPolicy(tokens=tokens))
    assert {g for _, _, g in RPCS} == GROUPS
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for method, request, group in RPCS:
                call = getattr(stub, method)
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=[("authorization", f"Bearer all-but-{group}")],
                         timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
                assert f"'{group}' API" in err.value.details(), method
                other = next(g for g in sorted(GROUPS) if g != group)
                try:       # past the check, the RPC itself answers (possibly with its own error)
                    call(request, metadata=[("authorization", f"Bearer all-but-{other}")],
                         timeout=10)
                except grpc.RpcError as passed:
                    assert passed.code() not in (grpc.StatusCode.PERMISSION_DENIED,
                                                 grpc.StatusCode.UNAUTHENTICATED), method
    finally:
        server.close()


def test_restricted_protocol_needs_its_header(model_repo):
    """tritonserver's --grpc-restricted-protocol=model-repository:admin-key=secret."""
    policy = AccessPolicy.open([Restriction.parse("model-repository:admin-key=secret")])
    server = _start(model_repo, policy)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.infer("linear", _x()).as_numpy("OUTPUT0").shape == (1, 4)
        assert client.get_inference_statistics("linear").model_stats[0].name == "linear"
        status, message = _status(client.get_model_repository_index)
        assert status == "StatusCode.PERMISSION_DENIED"
        assert "expecting header 'admin-key'" in message
        assert _status(client.unload_model, "linear",
                       headers={"admin-key": "wrong"})[0] == "StatusCode.PERMISSION_DENIED"
        index = client.get_model_repository_index(headers={"admin-key": "secret"})
        assert "linear" in {m.name for m in index.models}
        client.unload_model("linear", headers={"admin-key": "secret"})
        assert not client.is_model_ready("linear")
    finally:
        client.close()
        server.close()
