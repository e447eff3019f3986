"""gRPC's standard health service (``grpc.health.v1.Health``), beside Triton's service on the
same gRPC port: what Kubernetes' gRPC probes and ``grpc_health_probe`` call.

Service names: "" is the server (SERVING while the engine is live and ready, as
``ServerReady``); a model's name is that model (SERVING while a version of it is ready,
NOT_SERVING while it is known but not ready). A name that is neither is unknown: Check
answers NOT_FOUND and Watch sends SERVICE_UNKNOWN, as grpc's own ``HealthServicer`` does.
Both methods are Triton's HEALTH API group for access control, like ``ServerLive``.

Watch sends the status at once, then every change. The engine has no model-state event to
subscribe to, so a watch looks again every ``WATCH_INTERVAL_S``: a dictionary lookup for a
ready model; for one that is not, the repository's listing, read at most once per interval for
all calls together (a thousand watches of made-up names cost one directory listing, not a
thousand).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2 as hpb

from ..engine import Engine
from .admission import HEALTH

SERVICE_NAME = "grpc.health.v1.Health"
# Every method of the service is the HEALTH group (what the admission is asked on a call's
# HEADERS, before the service sees it: frontends/grpc_codec.py's admit_on_headers).
API_GROUPS = {"Check": HEALTH, "Watch": HEALTH}
WATCH_INTERVAL_S = 0.5

SERVING = hpb.HealthCheckResponse.SERVING
NOT_SERVING = hpb.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = hpb.HealthCheckResponse.SERVICE_UNKNOWN

class HealthService:
    """``grpc.health.v1.Health`` over the engine."""

    def __init__(self, engine: Engine, watch_interval: float = WATCH_INTERVAL_S) -> None:
        self.engine = engine
        self.watch_interval = watch_interval
        self._listed: tuple[float, frozenset[str]] = (float("-inf"), frozenset())

    def status(self, service: str) -> int:
        """The serving status of ``service`` ("" or a model name); SERVICE_UNKNOWN when the
        server knows no such model."""
        engine = self.engine
        if not service:
            return SERVING if engine.live() and engine.ready() else NOT_SERVING
        if engine.model_ready(service):
            return SERVING
        known = service in self._repository_models() or \
            any(mv.name == service for mv in engine.models())
        return NOT_SERVING if known else SERVICE_UNKNOWN

    def _repository_models(self) -> frozenset[str]:
        when, names = self._listed
        now = time.monotonic()
        if now - when >= self.watch_interval:
            names = frozenset(self.engine.repository.model_names())
            self._listed = (now, names)
        return names

    async def Check(self, request: hpb.HealthCheckRequest, context: Any
                    ) -> hpb.HealthCheckResponse:
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown service '{request.service}': neither the server ('') "
                                "nor a model of this server")
        return hpb.HealthCheckResponse(status=status)

    async def Watch(self, requests: AsyncIterator[hpb.HealthCheckRequest], context: Any
                    ) -> AsyncIterator[hpb.HealthCheckResponse]:
        """Registered as a stream-stream method (see ``method_handlers``): the client's one
        request comes through ``requests``."""
        request = None
        async for request in requests:
            break
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Watch needs one HealthCheckRequest")
        last = None
        while True:             # until the client goes away (the call is cancelled)
            status = self.status(request.service)
            if status != last:
                last = status
                yield hpb.HealthCheckResponse(status=status)
            await asyncio.sleep(self.watch_interval)


def method_handlers(service: HealthService) -> dict[str, grpc.RpcMethodHandler]:
    """The service's handlers, for frontends/grpc_server.py's ``serve_h2``.

    Watch is server-streaming in health.proto; it is registered stream-stream because on the
    wire the two are the same call (the client sends one message, then half-closes) and our
    HTTP/2 front dispatches streaming calls on ``request_streaming`` only."""
    return {
        "Check": grpc.unary_unary_rpc_method_handler(
            service.Check, request_deserializer=hpb.HealthCheckRequest.FromString,
            response_serializer=hpb.HealthCheckResponse.SerializeToString),
        "Watch": grpc.stream_stream_rpc_method_handler(
            service.Watch, request_deserializer=hpb.HealthCheckRequest.FromString,
            response_serializer=hpb.HealthCheckResponse.SerializeToString),
    }
