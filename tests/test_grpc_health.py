"""gRPC's standard health service on the gRPC port, as a Kubernetes gRPC probe or
``grpc_health_probe`` calls it: ``grpc.health.v1.Health`` Check and Watch, for the server ("")
and each model, through grpc's own ``HealthStub`` over a real channel, on the gRPC port alone,
the standalone server and the Jupyter server's extension port."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc

from conftest import INFER_KEY, in_thread
from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.frontends.admission import HEALTH, AccessPolicy, Restriction
from jupyter_triton.frontends.grpc import start_grpc_server

SERVING, NOT_SERVING = hpb.HealthCheckResponse.SERVING, hpb.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = hpb.HealthCheckResponse.SERVICE_UNKNOWN


def check(stub: health_pb2_grpc.HealthStub, service: str, **kwargs) -> int:
    return stub.Check(hpb.HealthCheckRequest(service=service), timeout=10, **kwargs).status


def refusal(stub: health_pb2_grpc.HealthStub, service: str, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        check(stub, service, **kwargs)
    return err.value.code()


def test_check_and_watch_follow_the_models(model_repo: Path):
    async def story():
        engine = Engine(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                      load_models=["linear"]))
        await engine.start()
        server, port = await start_grpc_server(engine, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def status(service: str) -> int:
                    return (await stub.Check(hpb.HealthCheckRequest(service=service))).status

                # the server; a loaded model; one in the repository, not loaded
                assert [await status(s) for s in ("", "linear", "simple")] == \
                    [SERVING, SERVING, NOT_SERVING]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await status("no_such_model")
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

                # Watch: the status at once, then each change, until the client goes away
                watch = stub.Watch(hpb.HealthCheckRequest(service="simple"))
                assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
                await engine.load_model("simple")
                assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
                await engine.unload_model("simple")
                assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
                watch.cancel()
                unknown = stub.Watch(hpb.HealthCheckRequest(service="no_such_model"))
                assert (await asyncio.wait_for(unknown.read(), 5)).status == SERVICE_UNKNOWN
                unknown.cancel()
                # the inference service is still served beside it on the same port
                assert await status("linear") == SERVING
        finally:
            await server.stop(0.5)
            await engine.stop()
    asyncio.run(story())


def test_standalone_health_is_the_health_group(model_repo: Path):
    """tritonserver's --grpc-restricted-protocol health:<key>=<value> guards Check and Watch as
    it guards ServerLive; without a restriction (the default) a probe needs nothing."""
    from jupyter_triton.standalone import start_in_thread
    restricted = AccessPolicy.open([Restriction.parse(f"{HEALTH}:probe-key=s3cret")])
    for access, header in ((None, ()), (restricted, (("probe-key", "s3cret"),))):
        server = start_in_thread(EngineOptions(model_repository=model_repo,
                                               model_control_mode="explicit", load_models=["*"]),
                                 host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                                 grpc_access=access)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            if access is not None:
                assert refusal(stub, "") == grpc.StatusCode.PERMISSION_DENIED
                with pytest.raises(grpc.RpcError) as err:
                    next(stub.Watch(hpb.HealthCheckRequest(service="linear"), timeout=10))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert check(stub, "", metadata=header) == SERVING
            assert check(stub, "simple", metadata=header) == SERVING
            watch = stub.Watch(hpb.HealthCheckRequest(service="linear"), metadata=header)
            assert next(watch).status == SERVING
            watch.cancel()
        finally:
            channel.close()
            server.close()


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "grpc_port": 0}}


async def test_the_extension_grpc_port_serves_health_to_credentials(jp_triton):
    """On the Jupyter server's gRPC port HEALTH takes the same credentials as ServerLive there
    (an inference key; nothing anonymous unless allow_anonymous_inference)."""
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    key = (("authorization", f"Bearer {INFER_KEY}"),)

    def story():
        channel = grpc.insecure_channel(f"127.0.0.1:{ext.bound_grpc_port}")
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return (refusal(stub, ""), check(stub, "", metadata=key),
                    check(stub, "linear", metadata=key),
                    refusal(stub, "no_such_model", metadata=key))
        finally:
            channel.close()

    assert await in_thread(story) == (grpc.StatusCode.UNAUTHENTICATED, SERVING, SERVING,
                                      grpc.StatusCode.NOT_FOUND)
