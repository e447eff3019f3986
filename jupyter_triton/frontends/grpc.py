"""Triton's GRPCInferenceService: a codec over the v2 operations it shares with HTTP
(frontends/operations.py: decode, one operation, encode), served by our own HTTP/2 front
(frontends/grpc_calls.py over frontends/h2_connection.py, listening in
frontends/grpc_server.py; grpc.aio's server is not used: it had none of that front's
protections against hostile peers, and cost more CPU per RPC; see
benchmarks/results/notes-frontends.md).

Every RPC is a thin skin: decode, one engine call, encode; the server's admission decided on
the call's HEADERS (``admit_on_headers``: the port's door) before it came. Errors are rendered
once, in ``_rpc``: a TritonError aborts with its own status code and message; anything else
is logged here and reaches the client as INTERNAL with its message only.

ModelInfer and ModelStreamInfer take the raw request bytes: their size is charged to the
bytes-in-flight budget before anything is parsed (on our front, a message larger than its connection's allowance was charged already,
when its length prefix arrived: ``grpc_calls.Charged``), and a message that does not parse is
INVALID_ARGUMENT rather than grpc's INTERNAL.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from ..engine import Engine
from ..engine.composition.streaming import DecoupledRefused
from ..protocol.errors import InvalidArgument, TritonError, Unsupported
from ..protocol.grpc_codec import (RequestPlans, ResponsePlans, decode_grpc_request,
                                   parameter_value, parse_infer_request)
from ..engine.observation.trace import trace_context
from . import grpc_health, operations
from .admission import (HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY,
                        SHARED_MEMORY, STATISTICS, TRACE, AccessPolicy, Admission, BodyBudget,
                        Door, ResourceExhausted)
from .grpc_calls import Admit, Charged
from .grpc_options import GrpcTLS
from .grpc_server import H2GrpcServer, serve_h2
from .limits import HTTP2Limits

log = logging.getLogger(__name__)

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
# ModelStreamInfer requests of one stream in flight at once; further reads wait.
STREAM_CONCURRENCY = 64
# Responses of one stream ready but not yet written; past it, the models' streams wait.
STREAM_BUFFERED_RESPONSES = 256
# RPCs (a stream counts once) in flight at once; beyond, RESOURCE_EXHAUSTED at once.
DEFAULT_MAX_CONCURRENT_RPCS = 1024
# Request bytes held by inference RPCs in flight, in multiples of the receive limit:
# decoded requests keep views of their bytes while they queue for a batch.
DEFAULT_INFLIGHT_MESSAGES = 4
SERVICE_NAME = "inference.GRPCInferenceService"


# How protobuf's parameter types are named in the repository operations' refusals
PARAMETER_WORDS = operations.ParameterWords(
    config="load parameter 'config' of model '{model}' must be a string_param holding the "
           "model configuration JSON",
    file="load parameter '{key}' of model '{model}' must be a bytes_param holding the file "
         "content",
    flag="unload parameter '{key}' must be a bool_param")


class _StreamFailure:
    """An error that ends a stream (``triton_grpc_error`` mode) rather than travel on it."""
    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


def _internal_message(err: BaseException) -> str:
    return f"internal error: {type(err).__name__}: {err}" if str(err) else \
        f"internal error: {type(err).__name__}"


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's metadata as headers (keys arrive lower-case; binary ``-bin`` values are
    never credentials)."""
    return {key: value for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)}


def _rpc(group: str) -> Callable[[Callable], Callable]:
    """A unary RPC of Triton's API ``group`` (what the admission is asked on its HEADERS),
    its errors mapped to gRPC statuses."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        async def wrapper(self: "GRPCInferenceService", request: Any,
                          context: grpc.aio.ServicerContext):
            try:
                return await method(self, request, context)
            except TritonError as err:
                await context.abort(grpc.StatusCode[err.grpc_code], str(err))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - rendered without a traceback
                log.exception("gRPC %s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, _internal_message(err))
        wrapper.api_group = group           # what admission asks on the call's HEADERS
        return wrapper
    return decorate


def _unimplemented(group: str, what: str) -> Callable:
    @_rpc(group)
    async def method(self: "GRPCInferenceService", request: Any, context: grpc.aio.ServicerContext):
        raise Unsupported(f"{what} is not supported by this server")
    return method


class GRPCInferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's inference service; ``engine`` is jupyter_triton.engine.Engine's public API."""

    def __init__(self, engine: Engine, max_elements: int | None = None,
                 max_inflight_bytes: int = DEFAULT_INFLIGHT_MESSAGES * DEFAULT_MAX_INPUT_SIZE,
                 admission: Admission | None = None) -> None:
        """``admission``: the server's, whose bytes-in-flight budget the inference RPCs share
        with its other listeners (else one of their own)."""
        self.engine = engine
        self.inflight = admission.budget if admission is not None else BodyBudget(max_inflight_bytes)
        self._decode_kwargs = {} if max_elements is None else {"max_elements": max_elements}
        self._plans = RequestPlans()
        self._responses = ResponsePlans()

    # -- health and metadata ----------------------------------------------------------
    @_rpc(HEALTH)
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=operations.server_live(self.engine))

    @_rpc(HEALTH)
    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=operations.server_ready(self.engine))

    @_rpc(HEALTH)
    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(
            ready=operations.model_ready(self.engine, request.name, request.version))

    @_rpc(METADATA)
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context
                             ) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(operations.server_metadata(self.engine),
                                     pb.ServerMetadataResponse(), ignore_unknown_fields=True)

    @_rpc(METADATA)
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context
                            ) -> pb.ModelMetadataResponse:
        meta = operations.model_metadata(self.engine, request.name, request.version)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    @_rpc(MODEL_CONFIG)
    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        config = operations.model_config(self.engine, request.name, request.version)
        response = pb.ModelConfigResponse()
        if config.DESCRIPTOR is response.config.DESCRIPTOR:
            response.config.CopyFrom(config)
        else:  # the same proto compiled into another module
            response.config.ParseFromString(config.SerializeToString())
        return response

    @_rpc(STATISTICS)
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context
                              ) -> pb.ModelStatisticsResponse:
        # (the lifecycle history and residency have no field in Triton's message)
        stats = operations.statistics(self.engine, request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    # -- inference ----------------------------------------------------------------------
    @_rpc(INFERENCE)
    async def ModelInfer(self, raw: bytes, context) -> bytes:
        # A Charged message (grpc_calls: larger than its connection's allowance) is on the budget
        # since its prefix arrived, until this call ends: not charged twice.
        size = 0 if type(raw) is Charged else len(raw)
        self.inflight.take(size)
        try:
            infer_request = self._plans.decode(raw, **self._decode_kwargs)
            if self.engine.tracing.on:     # engine/observation/trace.py: a client's W3C trace context
                infer_request.trace_context = trace_context(_headers(context))
            try:
                response = await self.engine.infer(infer_request)
            except DecoupledRefused as err:
                raise operations.decoupled_unsupported(err, "ModelInfer RPC") from None
            return self._responses.encode(response, infer_request)     # serialised already
        finally:
            self.inflight.give(size)

    def _stream_error(self, request: pb.ModelInferRequest, err: BaseException,
                      final: bool = True) -> bytes:
        """An error on the stream, as Triton writes it: ``error_message`` set, the request's
        model and id, and ``triton_final_response``; the stream itself goes on."""
        if isinstance(err, TritonError):
            message = str(err)
        else:
            log.error("gRPC ModelStreamInfer request failed", exc_info=err)
            message = _internal_message(err)
        response = pb.ModelInferResponse(model_name=request.model_name,
                                         model_version=request.model_version, id=request.id)
        response.parameters["triton_final_response"].bool_param = final
        return pb.ModelStreamInferResponse(error_message=message,
                                           infer_response=response).SerializeToString()

    def _failure(self, request: pb.ModelInferRequest, err: BaseException, final: bool,
                 grpc_error: bool) -> "bytes | _StreamFailure":
        if not grpc_error:
            return self._stream_error(request, err, final)
        if isinstance(err, TritonError):
            return _StreamFailure(grpc.StatusCode[err.grpc_code], str(err))
        log.error("gRPC ModelStreamInfer request failed", exc_info=err)
        return _StreamFailure(grpc.StatusCode.INTERNAL, _internal_message(err))

    async def _stream_one(self, raw: bytes, put: Callable[[Any], Awaitable[None]],
                          carrier: dict | None = None, grpc_error: bool = False) -> None:
        """Every response of one request onto the stream (``put``), each with Triton's
        ``triton_final_response`` parameter; a decoupled model's empty final response only
        when the request asked for it (``triton_enable_empty_final_response``). An error is
        an error response on the stream, or (``grpc_error``) the status that ends it."""
        request = pb.ModelInferRequest()
        try:
            request = parse_infer_request(raw)
            infer_request = decode_grpc_request(request, **self._decode_kwargs)
            if carrier is not None:        # engine/observation/trace.py: the stream's W3C trace context
                infer_request.trace_context = carrier
            # the frontend's to act on, as in Triton: the model never sees it
            empty_final = infer_request.parameters.pop("triton_enable_empty_final_response",
                                                       None) is True
            responses = self.engine.infer_stream(infer_request)
            try:
                async for response in responses:
                    if response.error is not None:
                        await put(self._failure(request, response.error, response.final,
                                                grpc_error))
                        continue
                    if response.final and not response.outputs and not empty_final and \
                            self.engine.is_decoupled(request.model_name, request.model_version):
                        continue        # COMPLETE_FINAL without a response: not asked for
                    await put(self._responses.encode_stream(response, infer_request))
            finally:
                # Early exit (the stream ended, a put cancelled): the model sees is_cancelled().
                await responses.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - errors travel on the stream, as in Triton
            await put(self._failure(request, err, True, grpc_error))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[bytes],
                               context) -> AsyncIterator[bytes]:
        """Each request's responses are written on the stream as soon as each is ready (so
        possibly interleaved across requests, as in Triton: clients match them by ``id``).
        A client that goes away cancels every request of the stream still running. With
        Triton's ``triton_grpc_error: true`` metadata, the first error ends the stream with
        its gRPC status instead of travelling on it."""
        grpc_error = dict(context.invocation_metadata() or ()).get(
            "triton_grpc_error", "").lower() == "true"
        carrier = trace_context(_headers(context)) if self.engine.tracing.on else None
        # Bounded: a model that answers faster than the client reads waits for the client.
        results: asyncio.Queue = asyncio.Queue(STREAM_BUFFERED_RESPONSES)
        slots = asyncio.Semaphore(STREAM_CONCURRENCY)
        tasks: set[asyncio.Task] = set()
        done = object()

        def answered(size: int, task: asyncio.Task) -> None:
            # a callback, not a finally: a task cancelled before it ever ran has none
            tasks.discard(task)
            self.inflight.give(size)
            slots.release()

        async def read() -> None:
            try:
                async for raw in request_iterator:
                    # A Charged message (grpc_calls) comes with its bytes on the budget already:
                    # this stream gives them back when its answer is done.
                    charged = type(raw) is Charged
                    try:
                        await slots.acquire()
                    except BaseException:
                        if charged:
                            self.inflight.give(len(raw))
                        raise
                    if not charged:
                        try:
                            self.inflight.take(len(raw))
                        except ResourceExhausted as err:
                            slots.release()
                            await results.put(pb.ModelStreamInferResponse(
                                error_message=str(err)).SerializeToString())
                            continue
                    task = asyncio.create_task(
                        self._stream_one(raw, results.put, carrier, grpc_error))
                    tasks.add(task)
                    task.add_done_callback(functools.partial(answered, len(raw)))
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            except asyncio.CancelledError:
                raise               # the stream is over: nobody waits for `done` (nor has room)
            except Exception:       # noqa: BLE001 - the client's half of the stream broke
                log.debug("gRPC ModelStreamInfer request stream failed", exc_info=True)
            await results.put(done)

        reader = asyncio.create_task(read())
        try:
            while (item := await results.get()) is not done:
                if type(item) is _StreamFailure:
                    await context.abort(item.code, item.message)
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    # -- model repository ---------------------------------------------------------------
    @_rpc(MODEL_REPOSITORY)
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context
                              ) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        for m in operations.repository_index(self.engine, request.ready):
            response.models.add(**{k: str(m[k]) for k in ("name", "version", "state", "reason")
                                   if m.get(k) is not None})
        return response

    @_rpc(MODEL_REPOSITORY)
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, context
                                  ) -> pb.RepositoryModelLoadResponse:
        await operations.load(self.engine, request.model_name, _parameters(request.parameters),
                              PARAMETER_WORDS)
        return pb.RepositoryModelLoadResponse()

    @_rpc(MODEL_REPOSITORY)
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest, context
                                    ) -> pb.RepositoryModelUnloadResponse:
        await operations.unload(self.engine, request.model_name,
                                _parameters(request.parameters), PARAMETER_WORDS)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ---------------------------------------------------------------------
    @_rpc(SHARED_MEMORY)
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest, context
                                       ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in operations.shm_status(self.engine, request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    @_rpc(SHARED_MEMORY)
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context) -> pb.SystemSharedMemoryRegisterResponse:
        operations.shm_register(self.engine, request.name, request.key, request.offset,
                                request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc(SHARED_MEMORY)
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context) -> pb.SystemSharedMemoryUnregisterResponse:
        operations.shm_unregister(self.engine, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc(SHARED_MEMORY)
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest, context
                                     ) -> pb.CudaSharedMemoryStatusResponse:
        operations.cuda_shm_status(self.engine, request.name)   # none registered, ever
        return pb.CudaSharedMemoryStatusResponse()

    @_rpc(SHARED_MEMORY)
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest, context
                                       ) -> pb.CudaSharedMemoryRegisterResponse:
        operations.cuda_shm_register(self.engine, request.name)
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc(SHARED_MEMORY)
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context) -> pb.CudaSharedMemoryUnregisterResponse:
        operations.cuda_shm_unregister(self.engine, request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and logging extensions ------------------------------------------------------
    @_rpc(TRACE)
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

    @_rpc(LOGGING)
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


def method_handlers(service: GRPCInferenceService) -> dict[str, grpc.RpcMethodHandler]:
    """Every RPC of Triton's service (from its descriptor) -> the handler over ``service``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behaviour = getattr(service, method.name)
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


def api_groups(service: GRPCInferenceService) -> dict[str, str]:
    """Every RPC of Triton's service -> the Triton API group it belongs to."""
    return {method.name: getattr(getattr(service, method.name), "api_group", INFERENCE)
            for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}


class _Headers:
    """A call's header list as the mapping the admission reads (keys arrive lower-case;
    binary ``-bin`` values are never credentials)."""
    __slots__ = ("pairs",)

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.pairs:
            if k == key and isinstance(v, str):
                return v
        return default

    def items(self):
        return ((k, v) for k, v in self.pairs if isinstance(v, str) and not k.endswith("-bin"))


def admit_on_headers(admission: Admission, door: Door,
                     groups: dict[str, dict[str, str]]) -> Admit:
    """The h2 front's ``admit``: the admission's decision on a call's HEADERS, before its
    body is read, for the API group of its method (``groups``: service -> method -> group)."""
    def admit(name: str, method: str, headers: list):
        group = groups.get(name, {}).get(method)
        if group is None:
            return None
        return admission.admit(door, group, "POST", _Headers(headers), op=method)
    return admit


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
                max_connections=limits.max_connections)
    service = GRPCInferenceService(engine, admission=admission)
    services = {SERVICE_NAME: method_handlers(service),
                grpc_health.SERVICE_NAME: grpc_health.method_handlers(
                    grpc_health.HealthService(engine))}
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        groups = {SERVICE_NAME: api_groups(service),
                  grpc_health.SERVICE_NAME: grpc_health.API_GROUPS}
        return await serve_h2(services, host.strip("[]"), port, limit, max_concurrent_rpcs,
                              limits=limits, admit=admit_on_headers(admission, door, groups),
                              ssl=ssl.ssl_context() if ssl else None,
                              budget=service.inflight,
                              connect=functools.partial(admission.connect, door))
    except OSError as err:
        raise OSError(f"could not bind the gRPC server to {address}: {err}") from None
