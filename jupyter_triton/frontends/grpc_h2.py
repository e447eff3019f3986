"""gRPC's transport: a small HTTP/2 server of our own on asyncio, serving the handlers of
frontends/grpc.py (``method_handlers``) on the engine's loop.

Why not grpc.aio's server: its per-RPC machinery (four completion-queue round trips through a
poller thread and a socket, five tasks, an ``asyncio.wait`` over every pending accept) cost
more event-loop time than the whole fast HTTP path: measured with perf_analyzer at c=32,
~300 us of server CPU per RPC over a trivial engine, against ~110 us here. Nor the ``h2``
package: its state machine is sound but costs more per call than this whole front.

What gRPC clients need from HTTP/2 and no more: the preface, SETTINGS, HEADERS (+CONTINUATION,
HPACK via the ``hpack`` package), DATA with both flow-control windows, WINDOW_UPDATE, PING,
RST_STREAM (cancels the handler), GOAWAY (graceful stop). Responses use precomputed header and
trailer blocks. The handlers are frontends/grpc.py's ``method_handlers(service)``.

What a hostile peer meets (issue 17; every limit is a field of ``HTTP2Limits``):
- every connection error RFC 9113 names ends the connection with GOAWAY (the right code and
  the last stream processed), then a close;
- header blocks (CONTINUATION included) are bounded by SETTINGS_MAX_HEADER_LIST_SIZE, frames
  by SETTINGS_MAX_FRAME_SIZE, streams by SETTINGS_MAX_CONCURRENT_STREAMS (REFUSED_STREAM);
- every message is admitted when its 5-byte length prefix arrives, before its body: within
  its connection's allowance of bytes charged to nothing (``connection_allowance``), or else
  charged to the server's one bytes-in-flight budget (``frontends.admission``, shared with
  the HTTP fronts), or refused (RESOURCE_EXHAUSTED, RST_STREAM) with no window extended for
  it. Stream windows are handed back as handlers take messages (or while an admitted one is
  still arriving), the connection's as bytes arrive. So what all peers together can make us
  hold of unfinished or untaken messages is ``max_connections x connection_allowance``
  (4,096 x 1 MiB by default) plus the budget (4 x the receive limit by default), whatever
  the sizes they announce;
- control frames (PING, SETTINGS, RST_STREAM, PRIORITY, empty DATA, unknown) are counted per
  second, and pings policed as grpc core does: past either, GOAWAY ENHANCE_YOUR_CALM;
- a peer that sends fast is read at most ``READ_BURST`` bytes a loop iteration, whatever the
  loop (uvloop's transports drain a socket in one go), so its calls run as they arrive rather
  than a burst of them being admitted, each holding its message, before any has run;
- a peer that does not read: past the write buffer's high-water mark we stop reading it, and
  responses held behind its flow control are bounded per connection;
- the credentials of a call are checked (``admit``) on its HEADERS, before its body is taken;
- compressed messages (gzip, deflate) inflate to at most the receive limit, off the loop when
  large;
- one timer per connection: handshake, idle, keep-alive and age deadlines.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import logging
import struct
import zlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import grpc
from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from .admission import INFLIGHT_MESSAGES, BodyBudget, ResourceExhausted
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
# RFC 9113 §7 error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# SETTINGS identifiers (RFC 9113 §6.5.2)
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
# Received bytes given back in one WINDOW_UPDATE at most this late: a frame per DATA frame was
# work on both sides for windows that are far from running low.
WINDOW_REFILL = 1 << 20
DEFAULT_FRAME = 16384               # RFC 9113's initial SETTINGS_MAX_FRAME_SIZE
MAX_WINDOW = (1 << 31) - 1
# Bytes of a streaming RPC's responses queued behind flow control before its handler waits.
STREAM_PENDING_BYTES = 1 << 20
# Bytes one connection's reads may bring in per loop iteration before it is paused until the
# next: asyncio's transports read 256 KiB an iteration, uvloop's (libuv) read again until the
# socket is drained (measured: 32 reads of 256,000 bytes in one iteration). Unpaced on uvloop,
# one connection's 1 MiB calls were taken in faster than they ran, ~40 MiB of them admitted
# at once: RSS +114-126 MiB, not asyncio's +40-47, in
# test_streams_at_window_zero_hold_bounded_responses_released_on_close. Reads smaller than a
# quarter of it (every read of small calls) cost two comparisons.
READ_BURST = 256 * 1024
# A compressed message larger than this is inflated on a worker thread, not on the loop.
INFLATE_ON_LOOP = 64 * 1024
INFLATE_STEP = 1 << 20              # output inflated at a time
# A connection that held this many bytes when it went: the heap is trimmed after it.
TRIM_AFTER = 8 << 20
# Distinct request header blocks remembered per connection, and the largest remembered
# (a repeated block is all table references: tens of bytes), see _Connection._head.
HEAD_CACHE = 32
HEAD_CACHE_BLOCK = 1024
KEEPALIVE_PING = b"jtkalive"
# Headers that are gRPC's own, not the call's metadata.
_NOT_METADATA = frozenset(("te", "content-type", "grpc-timeout", "grpc-encoding",
                           "grpc-accept-encoding"))
ENCODINGS = ("gzip", "deflate")


class H2ConnectionError(Exception):
    """An RFC 9113 connection error: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


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


# :status 200 (static index 8); content-type (static name 31) application/grpc; the
# encodings we accept (grpc core sends it so that clients may compress)
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _int(16, 7) + b"application/grpc" + \
    _literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
TRAILERS_OK = _literal(b"grpc-status", b"0")


def _percent(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"".join(bytes([c]) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c
                    for c in raw)


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def _window_update(sid: int, n: int) -> bytes:
    return struct.pack(">BHBBLL", 0, 4, WINDOW_UPDATE, 0, sid, n)


def _timeout(value: str) -> float | None:
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    if len(value) < 2 or value[-1] not in units or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * units[value[-1]]


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


def _trim_heap() -> None:
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
                _trim_heap()
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


_NO_HEAD = _Head([])


class _Stream:
    __slots__ = ("sid", "block", "head", "buf", "messages", "queue", "task", "window",
                 "pending", "trailers", "ended", "handler", "method", "encoding", "writable",
                 "recv_window", "credit", "held", "waiting", "refused", "admitted", "paid",
                 "reserved", "charged", "paid_at")

    def __init__(self, sid: int, window: int, recv_window: int) -> None:
        self.sid = sid
        self.block = bytearray()
        self.head = _NO_HEAD            # the request's headers, once they are complete
        self.buf = bytearray()
        self.messages: list[bytes] = []
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.window = window            # send window
        self.pending = bytearray()      # DATA payload not yet sent (flow control)
        self.trailers: bytes | None = None
        self.ended = False              # the client sent END_STREAM
        self.handler: Any = None
        self.method = ""
        self.encoding = "identity"
        self.writable: asyncio.Future | None = None     # a stream handler waiting on flow control
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.credit = 0                 # received bytes not yet given back to the peer
        self.held = 0                   # received bytes no handler has taken yet
        self.waiting = 0                # whole messages no handler has taken yet
        self.refused = False            # headers decoded for HPACK's sake only
        self.admitted = 0               # the arriving message's wire size, once admitted
        self.paid = False               # ... and whether it was charged to the budget
        self.reserved = 0               # wire bytes of messages within the allowance, untaken
        self.charged = 0                # bytes of the budget held for messages not handed over
        self.paid_at = 0.0              # when the arriving charged message was admitted


_EOF = object()


class _Connection(asyncio.Protocol):
    def __init__(self, server: "H2GrpcServer") -> None:
        self.server = server
        # held: asyncio.get_running_loop() costs a getpid() a call, several calls a request
        self.loop = asyncio.get_running_loop()
        limits = self.limits = server.limits
        self.buf = bytearray()
        self.preface = False
        self.settled = False            # the peer's first SETTINGS arrived
        self.decoder = Decoder(max_header_list_size=limits.max_header_list_size)
        # header block bytes -> (the HPACK table's state it was decoded in, its _Head)
        self.heads: dict[bytes, tuple[Any, int, int, _Head]] = {}
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0               # the newest stream the peer opened (GOAWAY's last id)
        self.goaway_sid: int | None = None  # after our GOAWAY: streams past it are refused
        self.peer_frame = DEFAULT_FRAME
        self.peer_window = 65535        # initial window of new streams, from peer SETTINGS
        self.send_window = 65535        # connection-level
        self.recv_window = limits.connection_window     # what the peer may still send
        self.credit = 0                 # connection-level bytes not yet given back
        self.held = 0                   # bytes of all streams no handler has taken yet
        # Wire bytes of admitted messages not charged to the budget (their whole size from
        # their prefix on) and their cap: past it a message is charged to the budget. Every
        # byte held is in one or the other (but a prefix's 4), so the connection's window is
        # handed back as bytes arrive and no mix of partly sent messages can stall it.
        self.reserved = 0
        self.reserve_cap = limits.connection_allowance
        self.budget = server.budget
        self.stream_refill = min(WINDOW_REFILL, limits.stream_window // 2)
        self.conn_refill = min(WINDOW_REFILL, limits.connection_window // 2)
        self.blocked: dict[int, _Stream] = {}
        self.pending_total = 0          # response bytes held behind the peer's flow control
        self.continuing: _Stream | None = None
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.dead = False
        self.write_paused = False
        self.paused_at = 0.0
        self.burst = 0                  # bytes read this loop iteration, counted from READ_BURST on
        # flood accounting, reset each second by the timer
        self.control = 0
        self.resets = 0
        self.paused_control = 0
        # pings (grpc core's policing) and keep-alive
        self.replies = 0                # responses sent: a ping after data is no strike
        self.ping_replies = -1
        self.last_ping = float("-inf")
        self.ping_strikes = 0
        self.reads = 0                  # data_received calls, for the keep-alive check
        self.keepalive_reads = -1
        self.keepalive_at = 0.0
        self.keepalive_sent: float | None = None
        self.pings_without_data = 0
        self.pings_replies = -1
        # timers: one call_later per connection, re-armed each tick
        self.timer: asyncio.TimerHandle | None = None
        self.born = 0.0
        self.idle_sid = -1
        self.idle_since = 0.0
        self.second = 0.0
        self.closing_at: float | None = None

    # -- output: coalesced into one write per loop iteration -----------------------------
    def _emit(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def _paced(self, size: int) -> None:
        """A large read: past READ_BURST this iteration, reading pauses until the next."""
        if not self.burst:
            self.loop.call_soon(self._next_burst)
        self.burst += size
        if self.burst > READ_BURST and self.transport is not None:
            self.transport.pause_reading()

    def _next_burst(self) -> None:
        paused, self.burst = self.burst > READ_BURST, 0
        if paused and not self.write_paused and not self.dead and self.transport is not None \
                and not self.transport.is_closing():
            self.transport.resume_reading()

    # write back-pressure: a peer that does not read is not read either
    def pause_writing(self) -> None:
        self.write_paused = True
        self.paused_at = self.loop.time()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.paused_control = 0
        if self.transport is not None and not self.transport.is_closing() and not self.dead:
            self.transport.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport      # type: ignore[assignment]
        server, limits = self.server, self.limits
        if len(server.connections) >= limits.max_connections:
            self.dead = True
            transport.abort()           # type: ignore[attr-defined]
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=limits.max_pending_reply_bytes)  # type: ignore[attr-defined]
        settings = struct.pack(">HLHLHLHL", S_INITIAL_WINDOW_SIZE, limits.stream_window,
                               S_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams,
                               S_MAX_HEADER_LIST_SIZE, limits.max_header_list_size,
                               S_MAX_FRAME_SIZE, limits.max_frame_size)
        self._emit(_frame(SETTINGS, 0, 0, settings)
                   + _window_update(0, limits.connection_window - 65535))
        loop = asyncio.get_running_loop()
        self.born = self.idle_since = self.second = self.keepalive_at = loop.time()
        self.timer = loop.call_later(self._tick_interval(), self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        """Everything the connection holds goes now: handlers cancelled, buffers dropped."""
        self.dead = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        held = self.held + self.pending_total
        for st in list(self.streams.values()):
            self._drop(st)
        if self.continuing is not None:
            self._drop(self.continuing)
        self.streams.clear()
        self.blocked.clear()
        self.continuing = None
        self.heads.clear()
        self.out.clear()
        self.buf = bytearray()
        self.pending_total = self.held = self.reserved = 0
        self.transport = None
        if held >= TRIM_AFTER:
            self.loop.run_in_executor(None, _trim_heap)

    def _drop(self, st: _Stream) -> None:
        self._release(st)
        if st.task is not None and not st.task.done():
            st.task.cancel()
        if st.writable is not None and not st.writable.done():
            st.writable.cancel()
        st.writable = None
        self.pending_total -= len(st.pending)
        st.pending = bytearray()
        st.buf = bytearray()
        st.messages.clear()
        st.block = bytearray()

    def _goaway(self, code: int, debug: bytes = b"") -> None:
        self._emit(_frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_sid, code) + debug))

    def _error(self, code: int = PROTOCOL_ERROR, debug: str = "") -> None:
        """A connection error: GOAWAY(code), then close (abort if the peer does not read)."""
        if self.dead:
            return
        self.dead = True
        if code != NO_ERROR:
            log.debug("HTTP/2 connection error %#x: %s", code, debug)
        self._goaway(code, debug.encode()[:256])
        self._flush()
        transport = self.transport
        if transport is not None:
            transport.close()
            self.loop.call_later(2.0, transport.abort)

    # -- timers: one per connection ------------------------------------------------------
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
        if self.dead or self.transport is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        limits = self.limits
        if now - self.second >= 1.0:            # flood counters are per second
            self.second, self.control, self.resets = now, 0, 0
        if self.write_paused and now - self.paused_at > limits.keepalive_timeout:
            # a peer that has read nothing of ours for that long is as good as gone
            self.dead = True
            self.transport.abort()
            return
        if not self.settled:
            if now - self.born > limits.handshake_timeout:
                return self._error(PROTOCOL_ERROR, "handshake timeout")
        # idle: no stream open and none opened since the last tick
        if self.streams or self.last_sid != self.idle_sid:
            self.idle_sid, self.idle_since = self.last_sid, now
        elif now - self.idle_since > limits.max_connection_idle:
            return self._error(NO_ERROR, "max_idle")
        # age: GOAWAY, then close after the grace
        age = limits.max_connection_age
        if age is not None and self.goaway_sid is None and now - self.born > age:
            self.goaway_sid = self.last_sid
            self._goaway(NO_ERROR, b"max_age")
            grace = limits.max_connection_age_grace     # None: as grpc core, until streams end
            self.closing_at = now + grace if grace is not None else float("inf")
        if self.closing_at is not None and (now >= self.closing_at or not self.streams):
            return self._error(NO_ERROR, "max_age")
        # a message charged to the budget that is still arriving after message_timeout
        late = [st for st in self.streams.values() if st.admitted and st.paid
                and now - st.paid_at > limits.message_timeout]
        for st in late:
            self._refuse(st, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the request message did not arrive within {limits.message_timeout:g} s")
        # keep-alive: a ping after keepalive_time without anything read; no ACK in time: close
        if self.keepalive_sent is not None:
            if now - self.keepalive_sent > limits.keepalive_timeout:
                return self._error(NO_ERROR, "keepalive timeout")
        elif self.reads != self.keepalive_reads:
            self.keepalive_reads, self.keepalive_at = self.reads, now
        elif now - self.keepalive_at > limits.keepalive_time and \
                (self.streams or limits.keepalive_permit_without_calls):
            if self.replies != self.pings_replies:
                self.pings_replies, self.pings_without_data = self.replies, 0
            if not limits.max_pings_without_data or \
                    self.pings_without_data < limits.max_pings_without_data:
                self.pings_without_data += 1
                self.keepalive_sent = now
                self._emit(_frame(PING, 0, 0, KEEPALIVE_PING))
        self.timer = loop.call_later(self._tick_interval(), self._tick)

    # -- input -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.dead:
            return
        self.reads += 1
        if len(data) >= READ_BURST // 4 or self.burst:
            self._paced(len(data))
        buf = self.buf
        buf += data
        if not self.preface:
            if len(buf) < 24:
                if PREFACE[:len(buf)] != bytes(buf):
                    return self._error(PROTOCOL_ERROR, "not an HTTP/2 preface")
                return
            if bytes(buf[:24]) != PREFACE:
                return self._error(PROTOCOL_ERROR, "not an HTTP/2 preface")
            del buf[:24]
            self.preface = True
        pos, n = 0, len(buf)
        max_frame = self.limits.max_frame_size
        try:
            while n - pos >= 9 and not self.dead:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > max_frame:      # never buffer more than one frame we allowed
                    raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if n - pos < 9 + length:
                    break
                ftype, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9:pos + 9 + length])
                pos += 9 + length
                if not self.settled and ftype != SETTINGS:
                    raise H2ConnectionError(PROTOCOL_ERROR, "the first frame must be SETTINGS")
                self._frame_received(ftype, flags, sid, payload)
        except H2ConnectionError as err:
            self.buf = bytearray()
            return self._error(err.code, str(err))
        except (OversizedHeaderListError,) as err:
            self.buf = bytearray()
            return self._error(ENHANCE_YOUR_CALM, f"header list too large: {err}")
        except HPACKError as err:
            self.buf = bytearray()
            return self._error(COMPRESSION_ERROR, f"HPACK: {err}")
        except Exception:  # noqa: BLE001 - a protocol error closes this connection only
            log.exception("HTTP/2 protocol error")
            self.buf = bytearray()
            return self._error(PROTOCOL_ERROR, "protocol error")
        del buf[:pos]

    def _count_control(self) -> None:
        """A control frame: past ``max_control_frames`` a second, or many while the peer
        does not read what we answer, ENHANCE_YOUR_CALM (nginx's and h2o's flood checks)."""
        self.control += 1
        if self.write_paused:
            self.paused_control += 1
            if self.paused_control > 1024:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "control frames from a peer that does not read")
        if self.control > self.limits.max_control_frames:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "flood of control frames")

    def _frame_received(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continuing is not None and ftype != CONTINUATION:
            raise H2ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if ftype == DATA:
            if sid == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            self._headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            st = self.continuing
            if st is None or st.sid != sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            st.block += payload
            if len(st.block) > self.limits.max_header_list_size:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                       "SETTINGS_MAX_HEADER_LIST_SIZE")
            if flags & END_HEADERS:
                self.continuing = None
                self._headers_done(st)
        elif ftype == SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            if sid != 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "PING of other than 8 bytes")
            if flags & ACK:
                if payload == KEEPALIVE_PING:
                    self.keepalive_sent = None
                return
            self._count_control()
            self._police_ping()
            self._emit(_frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            if sid == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
            if sid > self.last_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            self._count_control()
            self.resets += 1
            if self.resets > self.limits.max_resets_per_second:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "rapid reset")
            st = self.streams.pop(sid, None)
            if st is not None:
                self._forget(st)
        elif ftype == PRIORITY:
            if sid == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
            self._count_control()
        elif ftype == GOAWAY:
            if sid != 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
            self._count_control()   # the client finishes its streams and closes
        elif ftype == PUSH:
            raise H2ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            self._count_control()   # unknown frame types are ignored (RFC 9113 §4.1)

    def _police_ping(self) -> None:
        """grpc core's ping policing: pings closer together than the allowed interval while
        we sent no data are strikes; past ``max_ping_strikes``, GOAWAY "too_many_pings"."""
        limits = self.limits
        now = self.loop.time()
        if self.replies != self.ping_replies:       # we sent data since: a clean slate
            self.ping_replies = self.replies
            self.ping_strikes = 0
            self.last_ping = float("-inf")
        interval = limits.min_recv_ping_interval_without_data \
            if self.streams or limits.keepalive_permit_without_calls else 7200.0
        if now - self.last_ping < interval:
            self.ping_strikes += 1
            if self.ping_strikes > limits.max_ping_strikes:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "too_many_pings")
        self.last_ping = now

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        if self.settled:
            self._count_control()
        self.settled = True
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_window
                self.peer_window = value
                for st in self.streams.values():
                    st.window += delta
                    if st.window > MAX_WINDOW:
                        raise H2ConnectionError(FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        self._emit(_frame(SETTINGS, ACK, 0))
        self._unblock()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window past 2^31-1")
            if self.blocked:
                self._unblock()
            return
        if sid > self.last_sid:
            raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        st = self.streams.get(sid)
        if st is None:
            return                      # a stream closed meanwhile
        if inc == 0:
            return self._reset(st, PROTOCOL_ERROR)
        st.window += inc
        if st.window > MAX_WINDOW:
            return self._reset(st, FLOW_CONTROL_ERROR)
        if st.pending:
            self._drain(st)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or not sid & 1:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0 or an even stream")
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise H2ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
            payload = payload[1:len(payload) - payload[0]]
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        limits = self.limits
        if len(payload) > limits.max_header_list_size:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                   "SETTINGS_MAX_HEADER_LIST_SIZE")
        st = self.streams.get(sid)
        if st is not None:              # trailers of a request
            if st.ended or not flags & END_STREAM:
                raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on a stream whose headers came")
        elif sid <= self.last_sid:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on a closed stream or a stream id "
                                   "below one already used")
        else:
            self.last_sid = sid
            st = _Stream(sid, self.peer_window, limits.stream_window)
            if len(self.streams) >= limits.max_concurrent_streams or \
                    (self.goaway_sid is not None and sid > self.goaway_sid):
                st.refused = True       # decoded for HPACK's sake, then REFUSED_STREAM
            else:
                self.streams[sid] = st
        st.block += payload
        if flags & END_STREAM:
            st.ended = True
        if flags & END_HEADERS:
            self._headers_done(st)
        else:
            self.continuing = st

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
        if st.refused:
            self._emit(_frame(RST_STREAM, 0, st.sid, struct.pack(">L", REFUSED_STREAM)))
            return
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
        self.recv_window -= size
        if self.recv_window < 0:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection window")
        self.credit += size
        st = self.streams.get(sid)
        if st is None:
            if sid > self.last_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "DATA on an idle stream")
            # a stream we closed: its bytes are dropped, the connection's window given back
            if not size:
                self._count_control()
            self._give_back(None)
            return
        if st.ended:
            self._give_back(None)
            return self._reset(st, STREAM_CLOSED)
        st.recv_window -= size
        if st.recv_window < 0:
            self._give_back(None)
            return self._reset(st, FLOW_CONTROL_ERROR)
        if flags & PADDED:
            if not size or payload[0] >= size:
                raise H2ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
            payload = payload[1:size - payload[0]]
        elif not size and not flags & END_STREAM:
            self._count_control()
        kept = len(payload)
        st.credit += size
        st.held += kept
        self.held += kept
        if kept:
            st.buf += payload
            self._messages(st)
        if flags & END_STREAM:
            st.ended = True
            self._ended(st)
        self._give_back(st)

    def _give_back(self, st: _Stream | None) -> None:
        """WINDOW_UPDATEs: a stream's window while no whole message of it waits for its
        handler (so an admitted message may arrive whatever its size); the connection's as
        bytes arrive, since every byte held is admitted (reserved or charged, see
        ``_messages``)."""
        updates = b""
        if st is not None and st.credit >= self.stream_refill and not st.waiting \
                and not st.ended and st.sid in self.streams:
            updates = _window_update(st.sid, st.credit)
            st.recv_window += st.credit
            st.credit = 0
        if self.credit >= self.conn_refill:
            updates += _window_update(0, self.credit)
            self.recv_window += self.credit
            self.credit = 0
        if updates:
            self._emit(updates)

    def _taken(self, st: _Stream, message: bytes) -> None:
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
        if not self.dead:
            self._give_back(st)

    def _paid(self, st: _Stream, n: int) -> None:
        """``n`` bytes the transport charged for ``st`` go back to the budget (no more than
        it still holds: a released stream holds none)."""
        n = min(n, st.charged)
        st.charged -= n
        self.budget.give(n)

    def _release(self, st: _Stream) -> None:
        """The stream is over: its reservations and charges go back, and its messages no
        handler took are dropped (so none is handed over with a charge given back)."""
        if st.reserved:
            self.reserved -= st.reserved
            st.reserved = 0
        if st.charged:
            self.budget.give(st.charged)
            st.charged = 0
        st.admitted = 0
        queue = st.queue
        if queue is not None:
            while not queue.empty():
                queue.get_nowait()

    def _admit(self, st: _Stream, compressed: int, length: int) -> bool:
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

    def _refuse(self, st: _Stream, code: grpc.StatusCode, details: str) -> None:
        """The transport ends a call: trailers-only (RST_STREAM if the client still sends),
        its handler cancelled, what it holds released."""
        self._reply_error(st, code, details)
        self.streams.pop(st.sid, None)
        self._forget(st)

    def _messages(self, st: _Stream) -> None:
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

    def _ended(self, st: _Stream) -> None:
        if st.queue is not None:
            st.queue.put_nowait(_EOF)
        elif st.task is None and st.trailers is None and st.handler is not None:
            st.task = self.loop.create_task(self._unary(st))

    def _reset(self, st: _Stream, code: int) -> None:
        """A stream error: RST_STREAM(code); the stream and its handler are dropped."""
        self._emit(_frame(RST_STREAM, 0, st.sid, struct.pack(">L", code)))
        self.streams.pop(st.sid, None)
        self._forget(st)

    def _forget(self, st: _Stream) -> None:
        """The stream is gone (reset by either side): its handler and bytes too."""
        self.blocked.pop(st.sid, None)
        self.held -= st.held
        st.held = 0
        st.trailers = b""
        self._drop(st)
        self._give_back(None)

    # -- calls -----------------------------------------------------------------------------
    def _start(self, st: _Stream) -> None:
        service, _, method = st.head.path.lstrip("/").partition("/")
        handler = self.server.services.get(service, {}).get(method)
        if handler is None:
            return self._reply_error(st, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        admit = self.server.admit
        if admit is not None:
            refused = admit(service, method, st.head.headers)
            if refused is not None:     # before any of the body: the client is told to stop
                return self._reply_error(st, *refused)
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

    async def _unary(self, st: _Stream) -> None:
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
            if paid:
                self._paid(st, paid)

    async def _streaming(self, st: _Stream, handler: Any) -> None:
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

        self.server.active += 1
        started = False
        responses = None
        try:
            responses = handler.stream_stream(requests(), _Context(st.head.metadata()))
            async for response in responses:
                if failed:
                    break
                raw = handler.response_serializer(response)
                if not started:
                    self._emit(_frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
                    started = True
                self._send(st, b"\x00" + struct.pack(">L", len(raw)) + raw, None)
                if len(st.pending) > STREAM_PENDING_BYTES or \
                        (st.pending and self.pending_total > self.limits.max_pending_bytes):
                    # A client that reads slower than the model answers holds the model back
                    # (through the handler's bounded queue), not this server's memory.
                    st.writable = self.loop.create_future()
                    await st.writable
            if failed:
                raise failed[0]
            self._finish(st, TRAILERS_OK, started)
        except _Abort as abort:
            self._finish(st, self._status_block(abort.code, abort.details), started)
        except asyncio.CancelledError:
            pass
        except Exception as err:  # noqa: BLE001
            if failed:
                self._finish(st, self._status_block(failed[0].code, failed[0].details), started)
            else:
                log.exception("gRPC %s failed", st.method)
                self._finish(st, self._status_block(grpc.StatusCode.UNKNOWN,
                                                    f"Unexpected {type(err)}: {err}"), started)
        finally:
            self.server.active -= 1
            # Cancelled while waiting on flow control, the handler sits at a yield: closing
            # it now (not when collected) ends its requests' work.
            close = getattr(responses, "aclose", None)
            if close is not None:
                try:
                    await close()
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - it is over anyway
                    pass

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
        self.replies += 1
        self._emit(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid,
                          RESPONSE_HEADERS + self._status_block(code, details)))
        self._close(st)

    def _reply(self, st: _Stream, raw: bytes) -> None:
        """A unary call's response message and OK trailers: in one piece (headers, DATA,
        trailers) when the windows allow, as nearly every call's do."""
        n = len(raw) + 5
        self.replies += 1
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
        if self.pending_total and self.pending_total + n > self.limits.max_pending_bytes:
            # The client does not let earlier responses flow: this one is not held too.
            return self._reply_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "the client's flow-control windows hold back "
                                     f"{self.pending_total} bytes of responses already")
        self._send(st, b"\x00" + struct.pack(">L", len(raw)) + raw, TRAILERS_OK)

    def _send(self, st: _Stream, body: bytes, trailers: bytes | None) -> None:
        if trailers is not None:
            self._emit(_frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
        st.pending += body
        self.pending_total += len(body)
        if trailers is not None:
            st.trailers = trailers
        self._drain(st)

    def _finish(self, st: _Stream, trailers: bytes, started: bool) -> None:
        self.replies += 1
        if not started:
            self._emit(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid,
                              RESPONSE_HEADERS + trailers))
            st.trailers = b""
            return self._close(st)
        st.trailers = trailers
        self._drain(st)

    def _drain(self, st: _Stream) -> None:
        """Send what the windows allow; the rest waits for WINDOW_UPDATE."""
        if self.dead or st.sid not in self.streams:
            return
        pending = st.pending
        sent = 0
        while pending:
            room = min(self.send_window, st.window, self.peer_frame, len(pending))
            if room <= 0:
                break
            self._emit(_frame(DATA, 0, st.sid, bytes(pending[:room])))
            del pending[:room]
            self.send_window -= room
            st.window -= room
            sent += room
        if sent:
            self.pending_total -= sent
            self.replies += 1
        if pending:
            self.blocked[st.sid] = st
            return
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
            self._emit(_frame(RST_STREAM, 0, st.sid, struct.pack(">L", NO_ERROR)))
        self._release(st)
        if self.streams.pop(st.sid, None) is not None:
            self.blocked.pop(st.sid, None)
            if st.held:                 # bytes no handler will take: the window opens again
                self.held -= st.held
                st.held = 0
                self._give_back(None)


class H2GrpcServer:
    """What standalone/serverext use of grpc.aio.Server: ``stop(grace)``.

    ``services``: service name -> (method name -> grpc method handler). ``admit(service,
    method, headers)`` is asked when a call's HEADERS are complete, before any of its body is
    taken: None admits, else the ``(grpc.StatusCode, details)`` the call is refused with.
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
            conn.goaway_sid = conn.last_sid
            conn._goaway(NO_ERROR)
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
