"""Triton's GRPCInferenceService on its port: every RPC's handler, the API group the admission
asks for it, and the server's start. The inference RPCs are the gRPC codec's
(frontends/grpc_codec.py: what every call meets, on the data path); every other RPC is here,
each a thin codec over the v2 operation it shares with HTTP (frontends/operations.py): decode
its small message, one operation, encode. Served by our own HTTP/2 front
(frontends/grpc_calls.py over frontends/h2_connection.py, listening in
frontends/grpc_server.py; grpc.aio's server is not used: it had none of that front's
protections against hostile peers, and cost more CPU per RPC; see
benchmarks/results/notes-frontends.md).

The server's admission decides on each call's HEADERS (``grpc_codec.admit_on_headers``: the
port's door) before the call comes here. Errors are rendered once (``grpc_codec.rpc``): a
TritonError aborts with its own status code and message; anything else is logged and reaches
the client as INTERNAL with its message only.
"""
from __future__ import annotations

import functools
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb

from ..engine import Engine
from ..protocol.errors import InvalidArgument
from . import grpc_health, operations
from .admission import (HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY,
                        SHARED_MEMORY, STATISTICS, TRACE, AccessPolicy, Admission, Door)
from .grpc_codec import GrpcInference, admit_on_headers, parameter_value, rpc
from .grpc_options import GrpcTLS
from .grpc_server import H2GrpcServer, serve_h2
from .limits import HTTP2Limits

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
# RPCs (a stream counts once) in flight at once; beyond, RESOURCE_EXHAUSTED at once.
DEFAULT_MAX_CONCURRENT_RPCS = 1024
# Request bytes held by inference RPCs in flight, in multiples of the receive limit:
# decoded requests keep views of their bytes while they queue for a batch.
DEFAULT_INFLIGHT_MESSAGES = 4
SERVICE_NAME = "inference.GRPCInferenceService"
_METHODS = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods

# How protobuf's parameter types are named in the repository operations' refusals
PARAMETER_WORDS = operations.ParameterWords(
    config="load parameter 'config' of model '{model}' must be a string_param holding the "
           "model configuration JSON",
    file="load parameter '{key}' of model '{model}' must be a bytes_param holding the file "
         "content",
    flag="unload parameter '{key}' must be a bool_param")


class GrpcOperations:
    """Every RPC of Triton's service but inference, over ``engine`` (jupyter_triton.engine.Engine's
    public API)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- health and metadata ----------------------------------------------------------
    @rpc(HEALTH)
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=operations.server_live(self.engine))

    @rpc(HEALTH)
    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=operations.server_ready(self.engine))

    @rpc(HEALTH)
    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(
            ready=operations.model_ready(self.engine, request.name, request.version))

    @rpc(METADATA)
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context
                             ) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(operations.server_metadata(self.engine),
                                     pb.ServerMetadataResponse(), ignore_unknown_fields=True)

    @rpc(METADATA)
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context
                            ) -> pb.ModelMetadataResponse:
        meta = operations.model_metadata(self.engine, request.name, request.version)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    @rpc(MODEL_CONFIG)
    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        config = operations.model_config(self.engine, request.name, request.version)
        response = pb.ModelConfigResponse()
        if config.DESCRIPTOR is response.config.DESCRIPTOR:
            response.config.CopyFrom(config)
        else:  # the same proto compiled into another module
            response.config.ParseFromString(config.SerializeToString())
        return response

    @rpc(STATISTICS)
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context
                              ) -> pb.ModelStatisticsResponse:
        # (the lifecycle history and residency have no field in Triton's message)
        stats = operations.statistics(self.engine, request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    # -- model repository ---------------------------------------------------------------
    @rpc(MODEL_REPOSITORY)
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context
                              ) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        for m in operations.repository_index(self.engine, request.ready):
            response.models.add(**{k: str(m[k]) for k in ("name", "version", "state", "reason")
                                   if m.get(k) is not None})
        return response

    @rpc(MODEL_REPOSITORY)
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, context
                                  ) -> pb.RepositoryModelLoadResponse:
        await operations.load(self.engine, request.model_name, _parameters(request.parameters),
                              PARAMETER_WORDS)
        return pb.RepositoryModelLoadResponse()

    @rpc(MODEL_REPOSITORY)
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest, context
                                    ) -> pb.RepositoryModelUnloadResponse:
        await operations.unload(self.engine, request.model_name,
                                _parameters(request.parameters), PARAMETER_WORDS)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ---------------------------------------------------------------------
    @rpc(SHARED_MEMORY)
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest, context
                                       ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in operations.shm_status(self.engine, request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    @rpc(SHARED_MEMORY)
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context) -> pb.SystemSharedMemoryRegisterResponse:
        operations.shm_register(self.engine, request.name, request.key, request.offset,
                                request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc(SHARED_MEMORY)
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context) -> pb.SystemSharedMemoryUnregisterResponse:
        operations.shm_unregister(self.engine, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc(SHARED_MEMORY)
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest, context
                                     ) -> pb.CudaSharedMemoryStatusResponse:
        operations.cuda_shm_status(self.engine, request.name)   # none registered, ever
        return pb.CudaSharedMemoryStatusResponse()

    @rpc(SHARED_MEMORY)
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest, context
                                       ) -> pb.CudaSharedMemoryRegisterResponse:
        operations.cuda_shm_register(self.engine, request.name)
        return pb.CudaSharedMemoryRegisterResponse()

    @rpc(SHARED_MEMORY)
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context) -> pb.CudaSharedMemoryUnregisterResponse:
        operations.cuda_shm_unregister(self.engine, request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and logging extensions ------------------------------------------------------
    @rpc(TRACE)
    async def TraceSetting(self, request: pb.TraceSettingRequest, context) -> pb.TraceSettingResponse:
        updates: dict[str, Any] = {}
        for name, value in request.settings.items():
            values = list(value.value)
            # an empty value clears the setting (tritonclient sends that for None)
            updates[name] = None if not values else values if name == "trace_level" else values[0]
        settings = operations.trace_setting(self.engine, request.model_name,
                                            updates if request.settings else None)
        response = pb.TraceSettingResponse()
        for name, value in settings.items():
            response.settings[name].value.extend(value if isinstance(value, list) else [value])
        return response

    @rpc(LOGGING)
    async def LogSettings(self, request: pb.LogSettingsRequest, context) -> pb.LogSettingsResponse:
        updates: dict[str, Any] = {}
        for name, value in request.settings.items():
            choice = value.WhichOneof("parameter_choice")
            if choice is None:
                raise InvalidArgument(f"log setting '{name}' has no value")
            updates[name] = getattr(value, choice)
        response = pb.LogSettingsResponse()
        for name, value in operations.log_settings(self.engine, updates or None).items():
            slot = response.settings[name]
            if isinstance(value, bool):
                slot.bool_param = value
            elif isinstance(value, int):
                slot.uint32_param = value
            else:
                slot.string_param = value
        return response

def _parameters(params: Any) -> dict[str, Any]:
    """A ModelRepositoryParameter map as Python values (None: a parameter with none set)."""
    return {key: parameter_value(param) for key, param in params.items()}


def _behaviours(*services: Any) -> dict[str, Any]:
    """Every RPC of Triton's service -> its behaviour: the first of ``services`` that has it."""
    return {method.name: next(getattr(s, method.name) for s in services if hasattr(s, method.name))
            for method in _METHODS}


def method_handlers(*services: Any) -> dict[str, grpc.RpcMethodHandler]:
    """Every RPC of Triton's service (from its descriptor) -> the handler over ``services``."""
    behaviours = _behaviours(*services)
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in _METHODS:
        behaviour = behaviours[method.name]
        # the inference RPCs get bytes (sized before they are parsed) and answer bytes
        # (serialised already: codec plans write them): no (de)serializer either way
        raw = method.name in ("ModelInfer", "ModelStreamInfer")
        request_type = getattr(pb, method.input_type.name)
        deserializer = None if raw else request_type.FromString
        serializer = None if raw else getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behaviour, request_deserializer=deserializer, response_serializer=serializer)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                behaviour, request_deserializer=deserializer, response_serializer=serializer)
    return handlers


def api_groups(*services: Any) -> dict[str, str]:
    """Every RPC of Triton's service -> the Triton API group it belongs to."""
    return {name: getattr(behaviour, "api_group", INFERENCE)
            for name, behaviour in _behaviours(*services).items()}


async def start_grpc_server(engine: Engine, host: str, port: int,
                            max_receive_message_size: int | None = None, *,
                            access: AccessPolicy | None = None,
                            max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
                            max_inflight_bytes: int | None = None,
                            limits: HTTP2Limits | None = None, ssl: GrpcTLS | None = None,
                            admission: Admission | None = None
                            ) -> tuple[H2GrpcServer, int]:
    """Serve the engine over gRPC on ``host:port`` (port 0: a free one) on the running loop.

    Returns the started server and the port it bound; stop it with ``await server.stop(grace)``.
    The receive limit is ``max_receive_message_size``, else ``engine.options.max_input_size``,
    else 64 MiB. ``access`` is checked on every RPC against its Triton API group, from the
    ``authorization`` (and restricted-API header) metadata; None serves everyone. Beyond
    ``max_concurrent_rpcs`` RPCs at once, or ``max_inflight_bytes`` of inference requests
    (default: 4x the receive limit; with ``admission``, the server's one budget, shared with
    its other listeners), an RPC fails at once with RESOURCE_EXHAUSTED; the same budget is
    charged with a large message when its length prefix arrives, so a call is refused before
    its body is taken.
    ``limits``: the connections' HTTP/2 limits and keep-alive (tritonserver's gRPC flags);
    ``ssl``: serve TLS (``--grpc-use-ssl``). Beside Triton's service, the port serves
    ``grpc.health.v1.Health`` (frontends/grpc_health.py) under the same access policy.
    """
    limit = max_receive_message_size or engine.options.max_input_size or DEFAULT_MAX_INPUT_SIZE
    if admission is None:
        admission = Admission(max_input_size=limit, max_inflight_bytes=max_inflight_bytes
                              or DEFAULT_INFLIGHT_MESSAGES * limit)
    limits = limits or HTTP2Limits()
    # The port's own policy (tritonserver's --grpc-restricted-protocol), not the HTTP port's;
    # its connections counted at the admission under this port's limit.
    door = Door("grpc", access=access if access is not None else AccessPolicy.open(),
                max_connections=limits.max_connections,
                max_streams=limits.max_concurrent_streams)
    inference = GrpcInference(engine, admission.budget)
    cold = GrpcOperations(engine)
    services = {SERVICE_NAME: method_handlers(inference, cold),
                grpc_health.SERVICE_NAME: grpc_health.method_handlers(
                    grpc_health.HealthService(engine))}
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        groups = {SERVICE_NAME: api_groups(inference, cold),
                  grpc_health.SERVICE_NAME: grpc_health.API_GROUPS}
        return await serve_h2(services, host.strip("[]"), port, limit, max_concurrent_rpcs,
                              limits=limits, admit=admit_on_headers(admission, door, groups),
                              ssl=ssl.ssl_context() if ssl else None,
                              budget=inference.inflight,
                              connect=functools.partial(admission.connect, door))
    except OSError as err:
        raise OSError(f"could not bind the gRPC server to {address}: {err}") from None
