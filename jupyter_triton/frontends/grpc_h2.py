"""gRPC's transport: a small HTTP/2 server of our own on asyncio, serving the handlers of
frontends/grpc.py (``method_handlers``) on the engine's loop. Three layers, one file each:

- frontends/h2_connection.py: HTTP/2 itself, sans-IO (frames, SETTINGS, streams, flow control,
  header limits, floods, GOAWAY): bytes in, events and frames out;
- frontends/grpc_calls.py: gRPC calls over it (message framing, admission of each message to
  the bytes-in-flight budget, compression, deadlines, handlers, trailers);
- here: the asyncio protocol that moves the bytes (one write per loop iteration, reads paced,
  a peer that does not read not read either) and runs the connection's timer, and the server.

Why not grpc.aio's server: its per-RPC machinery (four completion-queue round trips through a
poller thread and a socket, five tasks, an ``asyncio.wait`` over every pending accept) cost
more event-loop time than the whole fast HTTP path. Nor the ``h2`` package: its state machine
is sound but costs more per call than this whole front (benchmarks/h2_cost.py). The figures:
benchmarks/results/notes-frontends.md.
"""
from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

import grpc

from .admission import INFLIGHT_MESSAGES, BodyBudget
from .grpc_calls import Admit, Charged, GrpcCalls, trim_heap
from .h2_connection import WINDOW_REFILL
from .limits import HTTP2Limits

if TYPE_CHECKING:
    from ssl import SSLContext

__all__ = ["Admit", "Charged", "H2GrpcServer", "WINDOW_REFILL", "serve_h2"]

# Bytes one connection's reads may bring in per loop iteration before it is paused until the
# next: asyncio's transports read 256 KiB an iteration, uvloop's (libuv) read again until the
# socket is drained (32 reads of 256,000 bytes in one iteration). Unpaced on uvloop, one
# connection's 1 MiB calls were taken in faster than they ran, dozens of them admitted at
# once (see benchmarks/results/notes-frontends.md). Reads smaller than a quarter of it (every read of small calls) cost two comparisons.
READ_BURST = 256 * 1024
# A connection that held this many bytes when it went: the heap is trimmed after it.
TRIM_AFTER = 8 << 20


class _Connection(asyncio.Protocol):
    """One connection's socket: bytes to ``h2`` (its calls are ``calls``), frames back."""

    def __init__(self, server: "H2GrpcServer") -> None:
        self.server = server
        # held: asyncio.get_running_loop() costs a getpid() a call, several calls a request
        self.loop = asyncio.get_running_loop()
        self.limits = server.limits
        # frames waiting: written once, at the end of this loop iteration
        self.calls = GrpcCalls(server, self.loop, functools.partial(self.loop.call_soon,
                                                                     self._flush))
        self.h2 = self.calls.h2
        self.transport: asyncio.Transport | None = None
        self.closed = False             # closing after a connection error
        self.paused_at = 0.0
        self.burst = 0                  # bytes read this loop iteration, counted from READ_BURST on
        # one call_later per connection, re-armed each tick
        self.timer: asyncio.TimerHandle | None = None

    # -- output: coalesced into one write per loop iteration -----------------------------
    def _flush(self) -> None:
        out = self.h2.out
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))
        out.clear()

    def _close(self) -> None:
        """After a connection error (GOAWAY queued): close, abort if the peer does not read."""
        if self.closed:
            return
        self.closed = True
        self._flush()
        transport = self.transport
        if transport is not None:
            transport.close()
            self.loop.call_later(2.0, transport.abort)

    def _paced(self, size: int) -> None:
        """A large read: past READ_BURST this iteration, reading pauses until the next."""
        if not self.burst:
            self.loop.call_soon(self._next_burst)
        self.burst += size
        if self.burst > READ_BURST and self.transport is not None:
            self.transport.pause_reading()

    def _next_burst(self) -> None:
        paused, self.burst = self.burst > READ_BURST, 0
        if paused and not self.h2.write_paused and not self.h2.dead and \
                self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # write back-pressure: a peer that does not read is not read either
    def pause_writing(self) -> None:
        self.h2.write_paused = True
        self.paused_at = self.loop.time()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        h2 = self.h2
        h2.write_paused = False
        h2.paused_control = 0
        if self.transport is not None and not self.transport.is_closing() and not h2.dead:
            self.transport.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport      # type: ignore[assignment]
        server, limits = self.server, self.limits
        if len(server.connections) >= limits.max_connections:
            self.h2.dead = True
            transport.abort()           # type: ignore[attr-defined]
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=limits.max_pending_reply_bytes)  # type: ignore[attr-defined]
        self.h2.initiate_connection(self.loop.time())
        self.timer = self.loop.call_later(self._tick_interval(), self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        """Everything the connection holds goes now: handlers cancelled, buffers dropped."""
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        held = self.calls.lost()
        self.transport = None
        if held >= TRIM_AFTER:
            self.loop.run_in_executor(None, trim_heap)

    def data_received(self, data: bytes) -> None:
        h2 = self.h2
        if h2.dead:
            return
        if len(data) >= READ_BURST // 4 or self.burst:
            self._paced(len(data))
        h2.receive_data(data)
        if h2.dead:
            self._close()

    # -- timer: one per connection ---------------------------------------------------------
    def _tick_interval(self) -> float:
        """A quarter of the shortest deadline, within [50 ms, 1 s]."""
        limits = self.limits
        shortest = min(x for x in (limits.handshake_timeout, limits.max_connection_idle,
                                   limits.keepalive_time, limits.keepalive_timeout,
                                   limits.max_connection_age or 60.0,
                                   limits.max_connection_age_grace or 60.0,
                                   limits.message_timeout, 60.0) if x > 0)
        return min(1.0, max(0.05, shortest / 4))

    def _tick(self) -> None:
        self.timer = None
        h2 = self.h2
        if h2.dead or self.transport is None:
            return
        now = self.loop.time()
        if h2.write_paused and now - self.paused_at > self.limits.keepalive_timeout:
            # a peer that has read nothing of ours for that long is as good as gone
            h2.dead = True
            self.transport.abort()
            return
        h2.tick(now)
        if h2.dead:
            return self._close()
        self.timer = self.loop.call_later(self._tick_interval(), self._tick)


class H2GrpcServer:
    """The gRPC port's server; standalone/serverext stop it with ``stop(grace)``.

    ``services``: service name -> (method name -> grpc method handler). ``admit(service,
    method, headers)`` is asked when a call's HEADERS are complete, before any of its body is
    taken: the server's admission's ticket (held until the call is over) or None, else the
    TritonError the call is refused with (frontends/grpc.py's ``admit_on_headers``).
    ``budget``: the server's bytes-in-flight budget (``frontends.admission``), charged with
    messages larger than a connection's allowance when their prefix arrives (see ``Charged``);
    None: one of its own, 4 x the receive limit."""

    def __init__(self, services: dict[str, dict[str, grpc.RpcMethodHandler]], max_receive: int,
                 max_concurrent_rpcs: int, limits: HTTP2Limits = HTTP2Limits(),
                 admit: Admit | None = None, budget: BodyBudget | None = None) -> None:
        self.services = services
        self.max_receive = max_receive
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.limits = limits
        self.admit = admit
        self.budget = budget if budget is not None else BodyBudget(INFLIGHT_MESSAGES * max_receive)
        self.active = 0
        self.connections: set[_Connection] = set()
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
                conn._flush()
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()


async def serve_h2(services: dict[str, dict[str, grpc.RpcMethodHandler]], host: str, port: int,
                   max_receive: int, max_concurrent_rpcs: int, *,
                   limits: HTTP2Limits = HTTP2Limits(), admit: Admit | None = None,
                   ssl: "SSLContext | None" = None, budget: BodyBudget | None = None
                   ) -> tuple[H2GrpcServer, int]:
    """Serve ``services`` (see H2GrpcServer) on ``host:port`` (0: a free port) on the running
    loop, over TLS when ``ssl`` is given; returns the server and its port."""
    server = H2GrpcServer(services, max_receive, max_concurrent_rpcs, limits, admit, budget)
    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(lambda: _Connection(server), host, port, ssl=ssl)
    return server, server._server.sockets[0].getsockname()[1]
