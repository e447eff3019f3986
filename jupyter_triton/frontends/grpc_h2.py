"""gRPC's transport: a small HTTP/2 server of our own on asyncio, serving the handlers of
frontends/grpc.py (``method_handlers``) on the engine's loop.

Why not grpc.aio's server: its per-RPC machinery (four completion-queue round trips through a
poller thread and a socket, five tasks, an ``asyncio.wait`` over every pending accept) cost
more event-loop time than the whole fast HTTP path: measured with perf_analyzer at c=32,
~300 us of server CPU per RPC over a trivial engine, against ~110 us here.

What gRPC clients need from HTTP/2 and no more: the preface, SETTINGS, HEADERS (+CONTINUATION,
HPACK via the ``hpack`` package), DATA with both flow-control windows, WINDOW_UPDATE, PING,
RST_STREAM (cancels the handler), GOAWAY (graceful stop). Responses use precomputed header and
trailer blocks. The handlers are frontends/grpc.py's ``method_handlers(service)``.
"""
from __future__ import annotations

import asyncio
import base64
import gzip
import logging
import struct
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import grpc
from hpack import Decoder

from .limits import HTTP2Limits

if TYPE_CHECKING:
    from ssl import SSLContext

# (service, method, the call's headers) -> None to admit, or (status, details) to refuse
Admit = Callable[[str, str, list], "tuple[grpc.StatusCode, str] | None"]


log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = \
    range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
OUR_WINDOW = 1 << 30
# Received bytes given back to the connection's window in one WINDOW_UPDATE: a frame per
# DATA frame was work on both sides for a window that never runs low (1 GiB).
WINDOW_REFILL = 1 << 20
MAX_FRAME = 16384                   # RFC 9113's default, which we do not raise
# Streams one connection may have open; beyond, REFUSED_STREAM (the RPC cap is global).
MAX_STREAMS_PER_CONNECTION = 1024
MAX_WINDOW = (1 << 31) - 1
# Bytes of a streaming RPC's responses queued behind flow control before its handler waits.
STREAM_PENDING_BYTES = 1 << 20
# Distinct request header blocks remembered per connection, and the largest remembered
# (a repeated block is all table references: tens of bytes), see _Connection._head.
HEAD_CACHE = 32
HEAD_CACHE_BLOCK = 1024
# Headers that are gRPC's own, not the call's metadata.
_NOT_METADATA = frozenset(("te", "content-type", "grpc-timeout", "grpc-encoding",
                           "grpc-accept-encoding"))


def _int(n: int, prefix: int, first: int = 0) -> bytes:
    """HPACK integer with a ``prefix``-bit prefix (RFC 7541 5.1)."""
    limit = (1 << prefix) - 1
    if n < limit:
        return bytes([first | n])
    out = [first | limit]
    n -= limit
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


# :status 200 (static index 8); content-type (static name 31) application/grpc
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _int(16, 7) + b"application/grpc"
TRAILERS_OK = _literal(b"grpc-status", b"0")


def _percent(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"".join(bytes([c]) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c
                    for c in raw)


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def _timeout(value: str) -> float | None:
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    if len(value) < 2 or value[-1] not in units or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * units[value[-1]]


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


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
    """What a request's header block says, worked out once per distinct block."""
    __slots__ = ("headers", "path", "encoding", "timeout", "_metadata")

    def __init__(self, headers: list) -> None:
        self.headers = headers
        self.path = ""
        self.encoding = "identity"
        self.timeout: float | None = None
        self._metadata: tuple | None = None
        for key, value in headers:
            if key == ":path" and not self.path:
                self.path = value
            elif key == "grpc-encoding":
                self.encoding = value
            elif key == "grpc-timeout":
                self.timeout = _timeout(value) if value else None

    def metadata(self) -> tuple:
        """The call's metadata, ``-bin`` values decoded (a bad one raises in the call)."""
        if self._metadata is None:
            out = []
            for key, value in self.headers:
                if key[0] == ":" or key in _NOT_METADATA:
                    continue
                if key.endswith("-bin"):
                    value = base64.b64decode(value + "=" * (-len(value) % 4))
                out.append((key, value))
            self._metadata = tuple(out)
        return self._metadata


_NO_HEAD = _Head([])


class _Stream:
    __slots__ = ("sid", "block", "head", "buf", "messages", "queue", "task", "window",
                 "pending", "trailers", "ended", "handler", "method", "encoding", "writable")

    def __init__(self, sid: int, window: int) -> None:
        self.sid = sid
        self.block = bytearray()
        self.head = _NO_HEAD            # the request's headers, once they are complete
        self.buf = bytearray()
        self.messages: list[bytes] = []
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.window = window
        self.pending = bytearray()      # DATA payload not yet sent (flow control)
        self.trailers: bytes | None = None
        self.ended = False              # the client sent END_STREAM
        self.handler: Any = None
        self.method = ""
        self.encoding = "identity"
        self.writable: asyncio.Future | None = None     # a stream handler waiting on flow control


_EOF = object()


class _Connection(asyncio.Protocol):
    def __init__(self, server: "H2GrpcServer") -> None:
        self.server = server
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder()
        # header block bytes -> (the HPACK table's state it was decoded in, its _Head)
        self.heads: dict[bytes, tuple[Any, int, int, _Head]] = {}
        self.streams: dict[int, _Stream] = {}
        self.peer_frame = 16384
        self.peer_window = 65535        # initial window of new streams, from peer SETTINGS
        self.send_window = 65535        # connection-level
        self.received = 0               # connection-level bytes not yet given back
        self.blocked: dict[int, _Stream] = {}
        self.continuing: _Stream | None = None
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.flush_scheduled = False

    # -- output: coalesced into one write per loop iteration -----------------------------
    def _emit(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport      # type: ignore[assignment]
        self.server.connections.add(self)
        settings = struct.pack(">HL", 4, OUR_WINDOW) + struct.pack(">HL", 3, MAX_STREAMS_PER_CONNECTION)
        self._emit(_frame(SETTINGS, 0, 0, settings)
                   + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", OUR_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for st in list(self.streams.values()):
            if st.task is not None:
                st.task.cancel()
        self.streams.clear()

    def _error(self, code: int = 1) -> None:
        self._emit(_frame(GOAWAY, 0, 0, struct.pack(">LL", 0, code)))
        self._flush()
        if self.transport is not None:
            self.transport.close()

    # -- input -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.preface:
            if len(buf) < 24:
                return
            if bytes(buf[:24]) != PREFACE:
                return self._error()
            del buf[:24]
            self.preface = True
        pos, n = 0, len(buf)
        while n - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > MAX_FRAME:      # never buffer more than one frame we allowed
                del buf[:pos]
                return self._error(6)   # FRAME_SIZE_ERROR
            if n - pos < 9 + length:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            try:
                self._frame_received(ftype, flags, sid, payload)
            except Exception:  # noqa: BLE001 - a protocol error closes this connection only
                log.exception("HTTP/2 protocol error")
                del buf[:pos]
                return self._error()
        del buf[:pos]

    def _frame_received(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continuing is not None and ftype != CONTINUATION:
            raise ValueError("expected CONTINUATION")
        if ftype == DATA:
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            st = self.streams.get(sid)
            if st is None:                  # request headers
                if len(self.streams) >= MAX_STREAMS_PER_CONNECTION:
                    self.decoder.decode(payload)    # keeps HPACK state in step
                    self._emit(_frame(RST_STREAM, 0, sid, struct.pack(">L", 7)))
                    return
                st = self.streams[sid] = _Stream(sid, self.peer_window)
            st.block += payload
            if flags & END_STREAM:
                st.ended = True
            if flags & END_HEADERS:
                self._headers_done(st)
            else:
                self.continuing = st
        elif ftype == CONTINUATION:
            st = self.continuing
            if st is None or st.sid != sid:
                raise ValueError("unexpected CONTINUATION")
            st.block += payload
            if flags & END_HEADERS:
                self.continuing = None
                self._headers_done(st)
        elif ftype == SETTINGS:
            if not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack(">HL", payload[i:i + 6])
                    if key == 4:
                        delta = value - self.peer_window
                        self.peer_window = value
                        for st in self.streams.values():
                            st.window += delta
                    elif key == 5:
                        self.peer_frame = value
                self._emit(_frame(SETTINGS, ACK, 0))
                self._unblock()
        elif ftype == WINDOW_UPDATE:
            inc = struct.unpack(">L", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif sid in self.streams:
                self.streams[sid].window += inc
            self._unblock()
        elif ftype == PING:
            if not flags & ACK:
                self._emit(_frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            st = self.streams.pop(sid, None)
            self.blocked.pop(sid, None)
            if st is not None and st.task is not None:
                st.task.cancel()
        elif ftype == GOAWAY:
            pass                        # the client finishes its streams and closes

    def _head(self, block: bytes) -> _Head:
        """The decoded header block. A client repeats the same block for every call of a
        method (all fields indexed), and pure-Python HPACK was a third of this front's CPU
        per call: a block that left the HPACK table as it found it decodes to the same
        headers whenever the table is in that state again, so it is decoded once. The
        table's state is its newest entry (held, so compared by identity), its length and
        its size limit: entries only enter at the front, so equal states are equal tables."""
        table = self.decoder.header_table
        entries = table.dynamic_entries
        newest = entries[0] if entries else None
        known = self.heads.get(block)
        if known is not None and known[0] is newest and known[1] == len(entries) \
                and known[2] == table.maxsize:
            return known[3]
        state = (newest, len(entries), table.maxsize)
        head = _Head(self.decoder.decode(block))
        if (entries[0] if entries else None) is newest and len(entries) == state[1] \
                and table.maxsize == state[2] and len(block) <= HEAD_CACHE_BLOCK:
            if len(self.heads) >= HEAD_CACHE:
                self.heads.clear()
            self.heads[block] = (*state, head)
        return head

    def _headers_done(self, st: _Stream) -> None:
        head = self._head(bytes(st.block))
        st.block = bytearray()
        if st.head.headers:             # trailers of a request: ignored
            if st.ended:
                self._ended(st)
            return
        st.head = head
        st.encoding = head.encoding
        self._start(st)
        if st.ended:
            self._ended(st)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        st = self.streams.get(sid)
        updates = []
        self.received += size
        if self.received >= WINDOW_REFILL:
            updates.append(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", self.received)))
            self.received = 0
        if st is not None:
            if size and not flags & END_STREAM:
                updates.append(_frame(WINDOW_UPDATE, 0, sid, struct.pack(">L", size)))
            st.buf += payload
            self._messages(st)
            if flags & END_STREAM:
                st.ended = True
                self._ended(st)
        if updates:
            self._emit(b"".join(updates))

    def _messages(self, st: _Stream) -> None:
        buf = st.buf
        limit = self.server.max_receive
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if length > limit:
                self._reply_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"Received message larger than max ({length} vs. {limit})")
                buf.clear()
                return
            if len(buf) < 5 + length:
                return
            compressed = buf[0]
            message = bytes(buf[5:5 + length])
            del buf[:5 + length]
            if compressed:
                if st.encoding != "gzip":
                    self._reply_error(st, grpc.StatusCode.UNIMPLEMENTED,
                                      f"message compression '{st.encoding}' is not supported")
                    return
                message = gzip.decompress(message)
            if st.queue is not None:
                st.queue.put_nowait(message)
            else:
                st.messages.append(message)

    def _ended(self, st: _Stream) -> None:
        if st.queue is not None:
            st.queue.put_nowait(_EOF)
        elif st.task is None and st.trailers is None and st.handler is not None:
            st.task = asyncio.get_running_loop().create_task(self._unary(st))

    # -- calls -----------------------------------------------------------------------------
    def _start(self, st: _Stream) -> None:
        service, _, method = st.head.path.lstrip("/").partition("/")
        handler = self.server.services.get(service, {}).get(method)
        if handler is None:
            return self._reply_error(st, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if self.server.active >= self.server.max_concurrent_rpcs:
            return self._reply_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "Concurrent RPC limit exceeded!")
        st.handler, st.method = handler, method
        if handler.request_streaming:
            st.queue = asyncio.Queue()
            for m in st.messages:
                st.queue.put_nowait(m)
            st.messages.clear()
            st.task = asyncio.get_running_loop().create_task(self._streaming(st, handler))

    async def _unary(self, st: _Stream) -> None:
        handler = st.handler
        if len(st.messages) != 1:
            return self._reply_error(st, grpc.StatusCode.INTERNAL,
                                     f"expected one request message, got {len(st.messages)}")
        self.server.active += 1
        try:
            message = st.messages.pop()
            request = handler.request_deserializer(message) if handler.request_deserializer \
                else message
            call = handler.unary_unary(request, _Context(st.head.metadata()))
            timeout = st.head.timeout
            response = await (asyncio.wait_for(call, timeout) if timeout else call)
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

    async def _streaming(self, st: _Stream, handler: Any) -> None:
        queue = st.queue
        assert queue is not None

        async def requests() -> AsyncIterator[Any]:
            while (item := await queue.get()) is not _EOF:
                yield handler.request_deserializer(item) if handler.request_deserializer \
                    else item

        self.server.active += 1
        started = False
        responses = handler.stream_stream(requests(), _Context(st.head.metadata()))
        try:
            async for response in responses:
                raw = handler.response_serializer(response)
                if not started:
                    self._emit(_frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
                    started = True
                self._send(st, b"\x00" + struct.pack(">L", len(raw)) + raw, None)
                if len(st.pending) > STREAM_PENDING_BYTES:
                    # A client that reads slower than the model answers holds the model back
                    # (through the handler's bounded queue), not this server's memory.
                    st.writable = asyncio.get_running_loop().create_future()
                    await st.writable
            self._finish(st, TRAILERS_OK, started)
        except _Abort as abort:
            self._finish(st, self._status_block(abort.code, abort.details), started)
        except asyncio.CancelledError:
            pass
        except Exception as err:  # noqa: BLE001
            log.exception("gRPC %s failed", st.method)
            self._finish(st, self._status_block(grpc.StatusCode.UNKNOWN,
                                                f"Unexpected {type(err)}: {err}"), started)
        finally:
            self.server.active -= 1
            # Cancelled while waiting on flow control, the handler sits at a yield: closing
            # it now (not when collected) ends its requests' work.
            close = getattr(responses, "aclose", None)
            if close is not None:
                await close()

    # -- responses -------------------------------------------------------------------------
    @staticmethod
    def _status_block(code: grpc.StatusCode, details: str) -> bytes:
        block = _literal(b"grpc-status", str(code.value[0]).encode())
        if details:
            block += _literal(b"grpc-message", _percent(details)[:8192])
        return block

    def _reply_error(self, st: _Stream, code: grpc.StatusCode, details: str) -> None:
        """A trailers-only response; the stream is done."""
        if st.trailers is not None:
            return
        st.trailers = b""
        self._emit(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid,
                          RESPONSE_HEADERS + self._status_block(code, details)))
        self._close(st)

    def _reply(self, st: _Stream, raw: bytes) -> None:
        """A unary call's response message and OK trailers: in one piece (headers, DATA,
        trailers) when the windows allow, as nearly every call's do."""
        n = len(raw) + 5
        if n <= self.send_window and n <= st.window and n <= self.peer_frame and not st.pending:
            self.send_window -= n
            st.window -= n
            sid = st.sid
            self._emit(b"".join((
                struct.pack(">BHBBL", 0, len(RESPONSE_HEADERS), HEADERS, END_HEADERS, sid),
                RESPONSE_HEADERS,
                struct.pack(">BHBBLBL", n >> 16, n & 0xFFFF, DATA, 0, sid, 0, len(raw)), raw,
                struct.pack(">BHBBL", 0, len(TRAILERS_OK), HEADERS, END_HEADERS | END_STREAM,
                            sid), TRAILERS_OK)))
            st.trailers = b""
            self._close(st)
            return
        self._send(st, b"\x00" + struct.pack(">L", len(raw)) + raw, TRAILERS_OK)

    def _send(self, st: _Stream, body: bytes, trailers: bytes | None) -> None:
        if trailers is not None:
            self._emit(_frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
        st.pending += body
        if trailers is not None:
            st.trailers = trailers
        self._drain(st)

    def _finish(self, st: _Stream, trailers: bytes, started: bool) -> None:
        if not started:
            self._emit(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid,
                              RESPONSE_HEADERS + trailers))
            st.trailers = b""
            return self._close(st)
        st.trailers = trailers
        self._drain(st)

    def _drain(self, st: _Stream) -> None:
        """Send what the windows allow; the rest waits for WINDOW_UPDATE."""
        pending = st.pending
        while pending:
            room = min(self.send_window, st.window, self.peer_frame, len(pending))
            if room <= 0:
                self.blocked[st.sid] = st
                return
            self._emit(_frame(DATA, 0, st.sid, bytes(pending[:room])))
            del pending[:room]
            self.send_window -= room
            st.window -= room
        self.blocked.pop(st.sid, None)
        if st.writable is not None:
            if not st.writable.done():
                st.writable.set_result(None)
            st.writable = None
        if st.trailers:
            self._emit(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid, st.trailers))
            st.trailers = b""
            self._close(st)

    def _unblock(self) -> None:
        for st in list(self.blocked.values()):
            self._drain(st)

    def _close(self, st: _Stream) -> None:
        if not st.ended:                # the client is still sending: tell it to stop
            self._emit(_frame(RST_STREAM, 0, st.sid, struct.pack(">L", 0)))
        self.streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)


class H2GrpcServer:
    """What standalone/serverext use of grpc.aio.Server: ``stop(grace)``.

    ``services``: service name -> (method name -> grpc method handler). ``admit(service,
    method, headers)`` is asked when a call's HEADERS are complete, before any of its body is
    taken: None admits, else the ``(grpc.StatusCode, details)`` the call is refused with."""

    def __init__(self, services: dict[str, dict[str, grpc.RpcMethodHandler]], max_receive: int,
                 max_concurrent_rpcs: int, limits: HTTP2Limits = HTTP2Limits(),
                 admit: Admit | None = None) -> None:
        self.services = services
        self.max_receive = max_receive
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.limits = limits
        self.admit = admit
        self.active = 0
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def stop(self, grace: float | None) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn._emit(_frame(GOAWAY, 0, 0, struct.pack(">LL", 0x7FFFFFFF, 0)))
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
                   ssl: "SSLContext | None" = None) -> tuple[H2GrpcServer, int]:
    """Serve ``services`` (see H2GrpcServer) on ``host:port`` (0: a free port) on the running
    loop, over TLS when ``ssl`` is given; returns the server and its port."""
    server = H2GrpcServer(services, max_receive, max_concurrent_rpcs, limits, admit)
    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(lambda: _Connection(server), host, port, ssl=ssl)
    return server, server._server.sockets[0].getsockname()[1]
