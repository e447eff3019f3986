"""The gRPC port's server: listens on the engine's loop and serves each connection with the
call layer (frontends/grpc_calls.py, over frontends/h2_connection.py's sans-IO HTTP/2), the
handlers being frontends/grpc.py's ``method_handlers``; started and stopped here.

Why not grpc.aio's server: its per-RPC machinery (four completion-queue round trips through a
poller thread and a socket, five tasks, an ``asyncio.wait`` over every pending accept) cost
more event-loop time than the whole fast HTTP path. Nor the ``h2`` package: its state machine
is sound but costs more per call than this whole front (benchmarks/h2_cost.py). The figures:
benchmarks/results/notes-frontends.md.
"""
from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Callable

import grpc

from .admission import INFLIGHT_MESSAGES, Admission, BodyBudget, ConnectionSlot, Door
from .grpc_calls import Admit, GrpcConnection
from .limits import HTTP2Limits

if TYPE_CHECKING:
    from ssl import SSLContext

__all__ = ["H2GrpcServer", "serve_h2"]


class H2GrpcServer:
    """The gRPC port's server; standalone/serverext stop it with ``stop(grace)``.

    ``services``: service name -> (method name -> grpc method handler). ``admit(service,
    method, headers)`` is asked when a call's HEADERS are complete, before any of its body is
    taken: the server's admission's ticket (held until the call is over) or None, else the
    TritonError the call is refused with (frontends/grpc_codec.py's ``admit_on_headers``).
    ``budget``: the server's bytes-in-flight budget (``frontends.admission``), charged with
    messages larger than a connection's allowance when their prefix arrives (see ``Charged``);
    None: one of its own, 4 x the receive limit. ``connect()``: the server's admission's slot
    for a connection just accepted (``Admission.connect`` at the port's door, whose
    ``max_streams`` caps its streams), or the refusal it is closed with; None: an admission of
    its own, at ``limits.max_connections`` and ``limits.max_concurrent_streams``."""

    def __init__(self, services: dict[str, dict[str, grpc.RpcMethodHandler]], max_receive: int,
                 max_concurrent_rpcs: int, limits: HTTP2Limits = HTTP2Limits(),
                 admit: Admit | None = None, budget: BodyBudget | None = None,
                 connect: Callable[..., ConnectionSlot] | None = None) -> None:
        self.services = services
        self.max_receive = max_receive
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.limits = limits
        self.admit = admit
        self.budget = budget if budget is not None else BodyBudget(INFLIGHT_MESSAGES * max_receive)
        self.connect = connect or functools.partial(
            Admission().connect, Door("grpc", max_connections=limits.max_connections,
                                      max_streams=limits.max_concurrent_streams))
        self.active = 0
        self.connections: set[GrpcConnection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def stop(self, grace: float | None) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.h2.shutdown()
        deadline = asyncio.get_running_loop().time() + (grace or 0)
        while self.active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.flush()
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()


async def serve_h2(services: dict[str, dict[str, grpc.RpcMethodHandler]], host: str, port: int,
                   max_receive: int, max_concurrent_rpcs: int, *,
                   limits: HTTP2Limits = HTTP2Limits(), admit: Admit | None = None,
                   ssl: "SSLContext | None" = None, budget: BodyBudget | None = None,
                   connect: Callable[..., ConnectionSlot] | None = None
                   ) -> tuple[H2GrpcServer, int]:
    """Serve ``services`` (see H2GrpcServer) on ``host:port`` (0: a free port) on the running
    loop, over TLS when ``ssl`` is given; returns the server and its port."""
    server = H2GrpcServer(services, max_receive, max_concurrent_rpcs, limits, admit, budget,
                          connect)
    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(lambda: GrpcConnection(server), host, port, ssl=ssl)
    return server, server._server.sockets[0].getsockname()[1]
