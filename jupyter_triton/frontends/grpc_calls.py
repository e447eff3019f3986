"""gRPC calls over one HTTP/2 connection, and the asyncio protocol that moves its bytes, on the
engine's loop. The gRPC port is served by our own HTTP/2 front, in three layers:

- frontends/h2_connection.py: HTTP/2 itself, sans-IO (frames, SETTINGS, streams, flow control,
  header limits, floods, GOAWAY): bytes in, events and frames out;
- here, the call layer, where IO meets calls: what a call's stream carries and what the server
  does with it, and the connection's socket (``GrpcConnection``: one write per loop iteration,
  reads paced, a peer that does not read not read either, the connection's timer);
- the codec: frontends/grpc_codec.py (a call's admission, the inference RPCs and their
  protobuf codec) and frontends/grpc.py (the other RPCs, ``method_handlers``). The server
  that listens is frontends/grpc_server.py.

What the call layer does:

- a call starts on its HEADERS (on a stream the connection's slot at the admission let open):
  its method found, the server's admission asked (``admit``) before any of its body is taken,
  the server's RPC cap applied;
- messages are framed by their 5-byte prefix (compressed flag, length). Each is admitted when
  its prefix arrives, before its body: within its connection's allowance of bytes charged to
  nothing (``connection_allowance``), or else charged to the server's one bytes-in-flight
  budget (``frontends.admission``, shared with the HTTP fronts), or refused
  (RESOURCE_EXHAUSTED, RST_STREAM) with no window extended for it. A stream's window is given
  back as handlers take its messages (``H2Stream.waiting``), so what all peers together can
  make us hold of unfinished or untaken messages is ``max_connections x
  connection_allowance`` plus the budget, whatever the sizes they announce;
- a charged message still arriving after ``message_timeout`` is DEADLINE_EXCEEDED, and a
  call's handler, unary or streaming, is bounded by its ticket's ``deadline`` (the
  admission's, from the call's ``grpc-timeout``);
- compressed messages (gzip, deflate) inflate to at most the receive limit, off the loop when
  large;
- answers: precomputed header and trailer blocks, a unary answer in one write when the
  windows allow; a stream's handler waits while the peer's flow control holds its answers.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import functools
import logging
import struct
import zlib
from typing import Any, AsyncIterator, Callable, Protocol

import grpc

from ..protocol.errors import TritonError
from .admission import ResourceExhausted
from .h2_connection import H2Connection, H2Events, H2Stream, hpack_int, hpack_literal


class CallServer(Protocol):
    """What a connection and its calls read of their server (grpc_server.H2GrpcServer)."""
    active: int
    admit: Any
    budget: Any
    connect: Any
    connections: set
    limits: Any
    max_concurrent_rpcs: int
    max_receive: int
    services: Any

# (service, method, the call's headers) -> the admission's ticket (None: nothing held), or
# the TritonError it refuses the call with
Admit = Callable[[str, str, list], Any]

log = logging.getLogger(__name__)

# Bytes one connection's reads may bring in per loop iteration before it is paused until the
# next: asyncio's transports read 256 KiB an iteration, uvloop's (libuv) read again until the
# socket is drained (32 reads of 256,000 bytes in one iteration). Unpaced on uvloop, one
# connection's 1 MiB calls were taken in faster than they ran, dozens of them admitted at
# once (see benchmarks/results/notes-frontends.md). Reads smaller than a quarter of it (every
# read of small calls) cost two comparisons.
READ_BURST = 256 * 1024
# A connection that held this many bytes when it went: the heap is trimmed after it.
TRIM_AFTER = 8 << 20
# Bytes of a streaming RPC's responses queued behind flow control before its handler waits.
STREAM_PENDING_BYTES = 1 << 20
# A compressed message larger than this is inflated on a worker thread, not on the loop.
INFLATE_ON_LOOP = 64 * 1024
INFLATE_STEP = 1 << 20              # output inflated at a time
# Headers that are gRPC's own, not the call's metadata.
_NOT_METADATA = frozenset(("te", "content-type", "grpc-timeout", "grpc-encoding",
                           "grpc-accept-encoding"))
ENCODINGS = ("gzip", "deflate")

# :status 200 (static index 8); content-type (static name 31) application/grpc; the
# encodings we accept (grpc core sends it so that clients may compress)
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + hpack_int(16, 7) + b"application/grpc" + \
    hpack_literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
TRAILERS_OK = hpack_literal(b"grpc-status", b"0")


def _percent(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"".join(bytes([c]) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c
                    for c in raw)


def status_block(code: grpc.StatusCode, details: str) -> bytes:
    block = hpack_literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        block += hpack_literal(b"grpc-message", _percent(details)[:8192])
    return block


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Compressed(bytes):
    """A message as it came (compressed): inflated when its handler takes it. Its wire size
    is charged to the budget until it is inflated."""
    __slots__ = ()


class Charged(bytes):
    """A message whose size was charged to the server's bytes-in-flight budget when its
    length prefix arrived (it was larger than its connection's allowance). A unary handler
    gets it with the charge held until its call ends; a stream handler that takes raw bytes
    (no ``request_deserializer``) owns the charge once it has the message and gives
    ``len(message)`` back to the budget when done with it. Either way the handler takes no
    second charge for it."""
    __slots__ = ()


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim): after a connection
    or a message that held many megabytes, so that what an attacker made us allocate does
    not stay resident in the allocator's arenas."""
    if _malloc_trim is not None:
        _malloc_trim(0)


try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):     # not glibc
    _malloc_trim = None


def _inflate(data: bytes, limit: int) -> bytes:
    """gzip or zlib ("deflate" in gRPC) ``data``, never more than ``limit`` bytes of output,
    inflated a step at a time so that a bomb is refused having held at most ``limit``."""
    inflater = zlib.decompressobj(47)           # 32 + 15: a gzip or a zlib header
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            part = inflater.decompress(data, INFLATE_STEP)
            data = inflater.unconsumed_tail
            size += len(part)
            if size > limit:
                parts.clear()
                del part
                trim_heap()
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Received message larger than max (more than {limit} bytes once "
                             f"decompressed vs. {limit})")
            parts.append(part)
            if inflater.eof or (not part and not data):
                break
    except zlib.error as err:
        raise _Abort(grpc.StatusCode.INTERNAL, f"Failed to decompress the message: {err}") from None
    if not inflater.eof:
        raise _Abort(grpc.StatusCode.INTERNAL, "Failed to decompress the message: truncated")
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Context:
    """What the handlers use of grpc.aio.ServicerContext."""
    __slots__ = ("_metadata",)

    def __init__(self, metadata: tuple) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)


class _Head:
    """What a request's header block says, worked out once per distinct block (the
    connection caches it with the block)."""
    __slots__ = ("headers", "path", "encoding", "_metadata")

    def __init__(self, headers: list) -> None:
        self.headers = headers
        self.path = ""
        self.encoding = "identity"
        self._metadata: tuple | None = None
        for key, value in headers:
            if key == ":path" and not self.path:
                self.path = value
            elif key == "grpc-encoding":
                self.encoding = value

    def metadata(self) -> tuple:
        """The call's metadata, ``-bin`` values decoded; a value that is not base64 is
        INVALID_ARGUMENT (raised inside the call, whose resources a ``finally`` frees)."""
        if self._metadata is None:
            out = []
            for key, value in self.headers:
                if key[0] == ":" or key in _NOT_METADATA:
                    continue
                if key.endswith("-bin"):
                    try:
                        value = base64.b64decode(value + "=" * (-len(value) % 4))
                    except (binascii.Error, ValueError):
                        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"metadata '{key}' is not base64") from None
                out.append((key, value))
            self._metadata = tuple(out)
        return self._metadata


class _Call(H2Stream):
    """A stream as a gRPC call: its messages, its handler, what it holds."""
    __slots__ = ("buf", "messages", "queue", "task", "handler", "method", "encoding",
                 "writable", "held", "admitted", "paid", "reserved", "charged", "paid_at",
                 "ticket")

    def __init__(self, sid: int, window: int, recv_window: int) -> None:
        H2Stream.__init__(self, sid, window, recv_window)   # not super(): a call per stream
        self.buf = bytearray()          # the message being received
        self.messages: list[bytes] = []
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.handler: Any = None
        self.method = ""
        self.encoding = "identity"
        self.writable: asyncio.Future | None = None     # a stream handler waiting on flow control
        self.held = 0                   # received bytes no handler has taken yet
        self.admitted = 0               # the arriving message's wire size, once admitted
        self.paid = False               # ... and whether it was charged to the budget
        self.reserved = 0               # wire bytes of messages within the allowance, untaken
        self.charged = 0                # bytes of the budget held for messages not handed over
        self.paid_at = 0.0              # when the arriving charged message was admitted
        self.ticket: Any = None         # the admission's, held until the call is over


_EOF = object()


class GrpcCalls(H2Events):
    """The calls of one connection: ``h2`` (made here) raises its events on this object."""

    def __init__(self, server: CallServer, loop: asyncio.AbstractEventLoop,
                 on_output: Callable[[], None] | None = None) -> None:
        self.server = server
        self.loop = loop
        limits = self.limits = server.limits
        self.h2 = H2Connection(limits, self, loop.time, _Head, _Call, on_output)
        self.held = 0                   # bytes of all streams no handler has taken yet
        # Wire bytes of admitted messages not charged to the budget (their whole size from
        # their prefix on) and their cap: past it a message is charged to the budget. Every
        # byte held is in one or the other (but a prefix's 4), so the connection's window is
        # handed back as bytes arrive and no mix of partly sent messages can stall it.
        self.reserved = 0
        self.reserve_cap = limits.connection_allowance
        self.budget = server.budget

    # -- events of the connection ----------------------------------------------------------
    def stream_ended(self, st: _Call) -> None:          # type: ignore[override]
        if st.queue is not None:
            st.queue.put_nowait(_EOF)
        elif st.task is None and st.trailers is None and st.handler is not None:
            st.task = self.loop.create_task(self._unary(st))

    def stream_reset(self, st: _Call) -> None:          # type: ignore[override]
        self.held -= st.held
        st.held = 0
        self._drop(st)

    def stream_closed(self, st: _Call, was_open: bool) -> None:  # type: ignore[override]
        self._release(st)
        if was_open and st.held:        # bytes no handler will take: the window opens again
            self.held -= st.held
            st.held = 0
            self.h2.give_back(None)

    def stream_drained(self, st: _Call) -> None:        # type: ignore[override]
        if st.writable is not None:
            if not st.writable.done():
                st.writable.set_result(None)
            st.writable = None

    def timer(self, now: float) -> None:
        """A message charged to the budget that is still arriving after message_timeout."""
        timeout = self.limits.message_timeout
        late = [st for st in self.h2.streams.values() if st.admitted and st.paid  # type: ignore[attr-defined]
                and now - st.paid_at > timeout]                                    # type: ignore[attr-defined]
        for st in late:
            self._refuse(st, grpc.StatusCode.DEADLINE_EXCEEDED,  # type: ignore[arg-type]
                         f"the request message did not arrive within {timeout:g} s")

    def lost(self) -> int:
        """The connection is gone: every call's handler cancelled, its bytes dropped. Returns
        how many bytes it held."""
        held = self.held + self.h2.pending_total
        for st in self.h2.lost():
            self._drop(st)              # type: ignore[arg-type]
        self.held = self.reserved = 0
        return held

    def _drop(self, st: _Call) -> None:
        self._release(st)
        if st.task is not None and not st.task.done():
            st.task.cancel()
        if st.writable is not None and not st.writable.done():
            st.writable.cancel()
        st.writable = None
        st.buf = bytearray()
        st.messages.clear()

    # -- messages and what they hold -------------------------------------------------------
    def _taken(self, st: _Call, message: bytes) -> None:
        """A handler took ``message``: its windows can open, its reservation ends (a charged
        message's charge is the caller's to hand over or give back)."""
        n = len(message) + 5
        if type(message) is bytes:
            r = min(n, st.reserved)     # nothing, once the stream is released
            st.reserved -= r
            self.reserved -= r
        n = min(n, st.held)             # nothing, once the stream is forgotten
        st.held -= n
        st.waiting -= 1
        self.held -= n
        if not self.h2.dead:
            self.h2.give_back(st)

    def _paid(self, st: _Call, n: int) -> None:
        """``n`` bytes the transport charged for ``st`` go back to the budget (no more than
        it still holds: a released stream holds none)."""
        n = min(n, st.charged)
        st.charged -= n
        self.budget.give(n)

    def _release(self, st: _Call) -> None:
        """The stream is over: its reservations and charges go back, and its messages no
        handler took are dropped (so none is handed over with a charge given back)."""
        if st.reserved:
            self.reserved -= st.reserved
            st.reserved = 0
        if st.charged:
            self.budget.give(st.charged)
            st.charged = 0
        st.admitted = 0
        if st.ticket is not None:
            st.ticket.release()
        queue = st.queue
        if queue is not None:
            while not queue.empty():
                queue.get_nowait()

    def _admit(self, st: _Call, compressed: int, length: int) -> bool:
        """A message's prefix, past the connection's allowance (or compressed): its size is
        charged to the budget now, before its body arrives, or the call is refused."""
        limit = self.server.max_receive
        if length > limit:
            self._refuse(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Received message larger than max ({length} vs. {limit})")
            return False
        n = length + 5
        if not compressed and self.reserved + n <= self.reserve_cap:
            self.reserved += n
            st.reserved += n
            st.paid = False
        else:
            if compressed and st.encoding not in ENCODINGS:
                self._refuse(st, grpc.StatusCode.UNIMPLEMENTED,
                             f"message compression '{st.encoding}' is not supported")
                return False
            try:
                self.budget.take(length)
            except ResourceExhausted as err:
                self._refuse(st, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
                return False
            st.charged += length
            st.paid = True
            st.paid_at = self.loop.time()
        st.admitted = n
        return True

    def _refuse(self, st: _Call, code: grpc.StatusCode, details: str) -> None:
        """The transport ends a call: trailers-only (RST_STREAM if the client still sends),
        its handler cancelled, what it holds released."""
        self._reply_error(st, code, details)
        self.h2.forget(st)

    def data_received(self, st: _Call, payload: bytes) -> None:  # type: ignore[override]
        """A stream's DATA: its messages, each admitted on its prefix, handed to its call."""
        kept = len(payload)
        st.held += kept
        self.held += kept
        st.buf += payload
        buf = st.buf
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if not st.admitted:
                # Admitted on its prefix: within the connection's allowance (all a small
                # message costs is these comparisons), else charged to the budget or refused.
                n = length + 5
                if self.reserved + n <= self.reserve_cap and not buf[0] and \
                        length <= self.server.max_receive:
                    self.reserved += n
                    st.reserved += n
                    st.paid = False
                    st.admitted = n
                elif not self._admit(st, buf[0], length):
                    return
            if len(buf) < 5 + length:
                return
            st.admitted = 0
            kind = bytes if not st.paid else _Compressed if buf[0] else Charged
            if len(buf) == 5 + length:
                message = kind(memoryview(buf)[5:]) if length else kind()
                st.buf = buf = bytearray()
            else:
                with memoryview(buf) as view:
                    message = kind(view[5:5 + length])
                del buf[:5 + length]
            st.waiting += 1
            if st.queue is not None:
                st.queue.put_nowait(message)
            elif st.messages and st.handler is not None:     # a unary call's second message
                self._refuse(st, grpc.StatusCode.INTERNAL, "expected one request message, got more")
                return
            else:
                st.messages.append(message)

    # -- calls -----------------------------------------------------------------------------
    def request_received(self, st: _Call) -> None:      # type: ignore[override]
        """A call's HEADERS: its method, its credentials (before any of its body), the cap."""
        st.encoding = st.head.encoding
        service, _, method = st.head.path.lstrip("/").partition("/")
        handler = self.server.services.get(service, {}).get(method)
        if handler is None:
            return self._reply_error(st, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        admit = self.server.admit
        if admit is not None:
            try:
                st.ticket = admit(service, method, st.head.headers)
            except TritonError as err:  # before any of the body: the client is told to stop
                return self._reply_error(st, grpc.StatusCode[err.grpc_code], str(err))
        if self.server.active >= self.server.max_concurrent_rpcs:
            return self._reply_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "Concurrent RPC limit exceeded!")
        st.handler, st.method = handler, method
        if handler.request_streaming:
            st.queue = asyncio.Queue()
            for m in st.messages:
                st.queue.put_nowait(m)
            st.messages.clear()
            st.task = self.loop.create_task(self._streaming(st, handler))

    async def _inflated(self, message: bytes) -> bytes:
        """A compressed message, inflated within the receive limit (off the loop if large)."""
        limit = self.server.max_receive
        if len(message) > INFLATE_ON_LOOP:
            return await asyncio.to_thread(_inflate, message, limit)
        return _inflate(message, limit)

    @staticmethod
    async def _admitted(st: _Call) -> None:
        """The admission's answer on a credential it asked its issuer about (a JupyterHub
        token first seen), before the handler runs."""
        try:
            await st.ticket.pending
        except TritonError as err:
            raise _Abort(grpc.StatusCode[err.grpc_code], str(err)) from None

    async def _unary(self, st: _Call) -> None:
        handler = st.handler
        if len(st.messages) != 1:
            return self._reply_error(st, grpc.StatusCode.INTERNAL,
                                     f"expected one request message, got {len(st.messages)}")
        self.server.active += 1
        paid = 0
        try:
            message = st.messages.pop()
            self._taken(st, message)
            if type(message) is not bytes:  # charged: until the call ends, or it is inflated
                paid = len(message)
                if type(message) is _Compressed:
                    message = await self._inflated(message)
                    self._paid(st, paid)
                    paid = 0
            if st.ticket is not None and st.ticket.pending is not None:
                await self._admitted(st)
            request = handler.request_deserializer(message) if handler.request_deserializer \
                else message
            call = handler.unary_unary(request, _Context(st.head.metadata()))
            deadline = st.ticket.deadline if st.ticket is not None else None
            response = await (asyncio.wait_for(call, deadline) if deadline else call)
            raw = handler.response_serializer(response) if handler.response_serializer \
                else response
            self._reply(st, raw)
        except _Abort as abort:
            self._reply_error(st, abort.code, abort.details)
        except asyncio.TimeoutError:
            self._reply_error(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            pass
        except Exception as err:  # noqa: BLE001 - as grpc.aio renders an unexpected error
            log.exception("gRPC %s failed", st.method)
            self._reply_error(st, grpc.StatusCode.UNKNOWN, f"Unexpected {type(err)}: {err}")
        finally:
            self.server.active -= 1
            if paid:
                self._paid(st, paid)

    async def _streaming(self, st: _Call, handler: Any) -> None:
        queue = st.queue
        assert queue is not None
        failed: list[_Abort] = []

        async def requests() -> AsyncIterator[Any]:
            while (item := await queue.get()) is not _EOF:
                self._taken(st, item)
                if type(item) is _Compressed:
                    wire = len(item)
                    try:
                        item = await self._inflated(item)
                    except _Abort as abort:     # ends the call with this status
                        failed.append(abort)
                        raise
                    finally:
                        self._paid(st, wire)
                elif type(item) is Charged:
                    if handler.request_deserializer is None:
                        st.charged -= len(item)     # the handler's from here (see Charged)
                    else:
                        self._paid(st, len(item))
                yield handler.request_deserializer(item) if handler.request_deserializer \
                    else item

        h2 = self.h2
        self.server.active += 1
        started = False
        responses = None
        # the call's deadline bounds the whole stream, as grpc's own servers do: past it,
        # the handler is cancelled (its requests' work ends) and the call DEADLINE_EXCEEDED
        deadline = st.ticket.deadline if st.ticket is not None else None
        timer = self.loop.call_later(deadline, asyncio.current_task().cancel) if deadline \
            else None
        try:
            if st.ticket is not None and st.ticket.pending is not None:
                await self._admitted(st)
            responses = handler.stream_stream(requests(), _Context(st.head.metadata()))
            async for response in responses:
                if failed:
                    break
                raw = handler.response_serializer(response) if handler.response_serializer \
                    else response
                if not started:
                    h2.send_headers(st, RESPONSE_HEADERS)
                    started = True
                h2.send_data(st, b"\x00" + struct.pack(">L", len(raw)) + raw)
                if len(st.pending) > STREAM_PENDING_BYTES or \
                        (st.pending and h2.pending_total > self.limits.max_pending_bytes):
                    # A client that reads slower than the model answers holds the model back
                    # (through the handler's bounded queue), not this server's memory.
                    st.writable = self.loop.create_future()
                    st.wants_drain = True
                    await st.writable
            if failed:
                raise failed[0]
            self._finish(st, TRAILERS_OK, started)
        except _Abort as abort:
            self._finish(st, status_block(abort.code, abort.details), started)
        except asyncio.CancelledError:
            # past the deadline, and the stream still open (not reset, its connection not lost)
            if timer is not None and self.loop.time() >= timer.when() and st.trailers is None:
                uncancel = getattr(asyncio.current_task(), "uncancel", None)
                if uncancel is not None:        # Python 3.11: this cancel is handled here
                    uncancel()
                self._finish(st, status_block(grpc.StatusCode.DEADLINE_EXCEEDED,
                                              "Deadline Exceeded"), started)
        except Exception as err:  # noqa: BLE001
            if failed:
                self._finish(st, status_block(failed[0].code, failed[0].details), started)
            else:
                log.exception("gRPC %s failed", st.method)
                self._finish(st, status_block(grpc.StatusCode.UNKNOWN,
                                              f"Unexpected {type(err)}: {err}"), started)
        finally:
            if timer is not None:
                timer.cancel()
            self.server.active -= 1
            # Cancelled while waiting on flow control, the handler sits at a yield: closing
            # it now (not when collected) ends its requests' work.
            close = getattr(responses, "aclose", None)
            if close is not None:
                try:
                    await close()
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - it is over anyway
                    pass

    # -- answers ---------------------------------------------------------------------------
    def _reply_error(self, st: _Call, code: grpc.StatusCode, details: str) -> None:
        """A trailers-only answer; the stream is done."""
        if st.trailers is not None:
            return
        self.h2.send_headers(st, RESPONSE_HEADERS + status_block(code, details), end_stream=True)

    def _reply(self, st: _Call, raw: bytes) -> None:
        """A unary call's answer and OK trailers: in one piece when the windows allow."""
        h2 = self.h2
        if h2.send_whole(st, RESPONSE_HEADERS, struct.pack(">BL", 0, len(raw)), raw, TRAILERS_OK):
            return
        n = len(raw) + 5
        if h2.pending_total and h2.pending_total + n > self.limits.max_pending_bytes:
            # The client does not let earlier responses flow: this one is not held too.
            return self._reply_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "the client's flow-control windows hold back "
                                     f"{h2.pending_total} bytes of responses already")
        h2.send_headers(st, RESPONSE_HEADERS)
        h2.send_data(st, b"\x00" + struct.pack(">L", len(raw)) + raw, TRAILERS_OK)

    def _finish(self, st: _Call, trailers: bytes, started: bool) -> None:
        if not started:
            self.h2.send_headers(st, RESPONSE_HEADERS + trailers, end_stream=True)
        else:
            self.h2.end_stream(st, trailers)


class GrpcConnection(asyncio.Protocol):
    """One connection's socket: bytes to ``h2`` (its calls are ``calls``), frames back."""

    def __init__(self, server: CallServer) -> None:
        self.server = server
        # held: asyncio.get_running_loop() costs a getpid() a call, several calls a request
        self.loop = asyncio.get_running_loop()
        self.limits = server.limits
        # frames waiting: written once, at the end of this loop iteration
        self.calls = GrpcCalls(server, self.loop, functools.partial(self.loop.call_soon,
                                                                     self.flush))
        self.h2 = self.calls.h2
        self.transport: asyncio.Transport | None = None
        self.closed = False             # closing after a connection error
        self.paused_at = 0.0
        self.burst = 0                  # bytes read this loop iteration, counted from READ_BURST on
        # one call_later per connection, re-armed each tick
        self.timer: asyncio.TimerHandle | None = None
        self.slot: Any = None           # the admission's (server.connect), held while open;
        # it decides too whether each stream may open (h2's)

    # -- output: coalesced into one write per loop iteration -----------------------------
    def flush(self) -> None:
        out = self.h2.out
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))
        out.clear()

    def _close(self) -> None:
        """After a connection error (GOAWAY queued): close, abort if the peer does not read."""
        if self.closed:
            return
        self.closed = True
        self.flush()
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
        try:
            self.slot = self.h2.slot = server.connect()
        except TritonError:             # past the port's max_connections: closed at once
            self.h2.dead = True
            transport.abort()           # type: ignore[attr-defined]
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=limits.max_pending_reply_bytes)  # type: ignore[attr-defined]
        self.h2.initiate_connection(self.loop.time())
        self.timer = self.loop.call_later(self._tick_interval(), self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        """Everything the connection holds goes now: handlers cancelled, buffers dropped."""
        if self.slot is not None:
            self.slot.release()
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
