"""HTTP/2 (RFC 9113), the server's side of one connection, sans-IO: bytes in
(``receive_data``), events out (calls on an ``H2Events``), frames out (``data_to_send``).
No sockets, no asyncio, no gRPC: the gRPC call layer (frontends/grpc_calls.py) sits on it and
moves its bytes (its asyncio protocol). Modelled on python-hyper's
``H2Connection``; ours because that one cost more per call than this whole front
(benchmarks/h2_cost.py; see benchmarks/results/notes-frontends.md).

What it owns, every limit a field of ``HTTP2Limits``:
- the preface and SETTINGS (ours sent first; the peer's initial window, frame size, push);
- streams: client-opened odd ids, ascending; refused past our GOAWAY, or where the
  connection's slot at the admission says no (``ConnectionSlot.open_stream``: its
  SETTINGS_MAX_CONCURRENT_STREAMS): REFUSED_STREAM (the header block still decoded, for HPACK's
  table);
- header blocks (HEADERS + CONTINUATION, padding, priority) bounded by
  SETTINGS_MAX_HEADER_LIST_SIZE, decoded with the ``hpack`` package;
- flow control both ways: received bytes are given back in WINDOW_UPDATEs at most
  ``WINDOW_REFILL`` late, a stream's only while the layer above has taken what it was given
  (``H2Stream.waiting``); what we send waits for the peer's windows;
- floods: control frames counted per second, rapid reset, ping policing as grpc core does,
  control frames from a peer that does not read: GOAWAY ENHANCE_YOUR_CALM;
- every connection error RFC 9113 names: GOAWAY with its code and the last stream processed,
  then ``dead`` (the caller closes the socket);
- the connection's deadlines, driven by ``tick(now)``: handshake, idle, age (GOAWAY, then
  close after the grace), keep-alive pings.
"""
from __future__ import annotations

import logging
import struct
from typing import Any, Callable

from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from .admission import ConnectionSlot
from .limits import HTTP2Limits

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
# Distinct request header blocks remembered per connection, and the largest remembered
# (a repeated block is all table references: tens of bytes), see H2Connection._head.
HEAD_CACHE = 32
HEAD_CACHE_BLOCK = 1024
KEEPALIVE_PING = b"jtkalive"


class H2ConnectionError(Exception):
    """An RFC 9113 connection error: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def hpack_int(n: int, prefix: int, first: int = 0) -> bytes:
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


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def window_update(sid: int, n: int) -> bytes:
    return struct.pack(">BHBBLL", 0, 4, WINDOW_UPDATE, 0, sid, n)


class H2Stream:
    """One stream's HTTP/2 state. The layer above may subclass it (``new_stream``) to keep
    its own per-stream fields in the same object."""
    __slots__ = ("sid", "block", "head", "window", "pending", "trailers", "ended",
                 "recv_window", "credit", "waiting", "refused", "wants_drain")

    def __init__(self, sid: int, window: int, recv_window: int) -> None:
        self.sid = sid
        self.block = bytearray()        # header block being received (CONTINUATION)
        self.head: Any = None           # the request's headers (``parse_head``'s), once complete
        self.window = window            # send window
        self.pending = bytearray()      # DATA payload not yet sent (flow control)
        # trailers sent once ``pending`` is out; b"": the stream sends nothing more
        self.trailers: bytes | None = None
        self.ended = False              # the client sent END_STREAM
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.credit = 0                 # received bytes not yet given back to the peer
        # units the layer above was given and has not taken: while any, the stream's window
        # is not given back (so the peer cannot send more than the window past them)
        self.waiting = 0
        self.refused = False            # headers decoded for HPACK's sake only
        self.wants_drain = False        # ``stream_drained`` is called once ``pending`` is out


class H2Events:
    """What the connection tells the layer above, synchronously, as frames arrive or as what
    it sends drains. A stream given to these is ``new_stream``'s."""

    def request_received(self, st: H2Stream) -> None:
        """A new stream's header block is complete (``st.head``)."""

    def data_received(self, st: H2Stream, payload: bytes) -> None:
        """DATA of a stream (padding removed, never empty); its window comes back only while
        ``st.waiting`` is 0, with ``give_back(st)``."""

    def stream_ended(self, st: H2Stream) -> None:
        """The peer sent END_STREAM (on DATA, HEADERS or trailers)."""

    def stream_reset(self, st: H2Stream) -> None:
        """The stream is gone without an answer (the peer's RST_STREAM, or ours): drop what
        it holds."""

    def stream_closed(self, st: H2Stream, was_open: bool) -> None:
        """We ended the stream (its trailers or a trailers-only answer went out)."""

    def stream_drained(self, st: H2Stream) -> None:
        """A stream that asked (``wants_drain``) has sent all its pending DATA."""

    def timer(self, now: float) -> None:
        """``tick(now)``: the layer above checks its own deadlines (after the connection's
        handshake, idle and age ones, before keep-alive)."""


class H2Connection:
    """The server's side of one HTTP/2 connection. ``events`` hears of streams; ``clock()``
    is the time in seconds (ping policing); ``parse_head(headers)`` makes ``st.head`` from a
    decoded header list (cached per distinct block, see ``_head``); ``new_stream(sid,
    window, recv_window)`` makes a stream (an ``H2Stream`` or a subclass); ``on_output()`` is
    called when frames wait in ``data_to_send()`` and none did before. ``slot``: the
    connection's at the admission, which decides whether a stream may open (the layer above
    sets the one its listener was given before ``initiate_connection``; by default one of
    ``limits.max_concurrent_streams``)."""

    def __init__(self, limits: HTTP2Limits, events: H2Events, clock: Callable[[], float],
                 parse_head: Callable[[list], Any] = list,
                 new_stream: Callable[[int, int, int], H2Stream] = H2Stream,
                 on_output: Callable[[], None] | None = None,
                 slot: ConnectionSlot | None = None) -> None:
        self.limits = limits
        self.slot = slot if slot is not None else ConnectionSlot(None, limits.max_concurrent_streams)
        self.events = events
        self.clock = clock
        self.parse_head = parse_head
        self.new_stream = new_stream
        self.on_output = on_output
        self.buf = bytearray()
        self.preface = False
        self.settled = False            # the peer's first SETTINGS arrived
        self.dead = False               # a connection error was sent (or the socket is gone)
        self.decoder = Decoder(max_header_list_size=limits.max_header_list_size)
        # header block bytes -> (the HPACK table's state it was decoded in, its head)
        self.heads: dict[bytes, tuple[Any, int, int, Any]] = {}
        self.streams: dict[int, H2Stream] = {}
        self.last_sid = 0               # the newest stream the peer opened (GOAWAY's last id)
        self.goaway_sid: int | None = None  # after our GOAWAY: streams past it are refused
        self.peer_frame = DEFAULT_FRAME
        self.peer_window = 65535        # initial window of new streams, from peer SETTINGS
        self.send_window = 65535        # connection-level
        self.recv_window = limits.connection_window     # what the peer may still send
        self.credit = 0                 # connection-level bytes not yet given back
        self.stream_refill = min(WINDOW_REFILL, limits.stream_window // 2)
        self.conn_refill = min(WINDOW_REFILL, limits.connection_window // 2)
        self.blocked: dict[int, H2Stream] = {}
        self.pending_total = 0          # response bytes held behind the peer's flow control
        self.continuing: H2Stream | None = None
        self.out: list[bytes] = []
        self.write_paused = False       # the peer does not read what we send (set by the caller)
        # flood accounting, reset each second by tick
        self.control = 0
        self.resets = 0
        self.paused_control = 0
        # pings (grpc core's policing) and keep-alive
        self.replies = 0                # answers sent: a ping after data is no strike
        self.ping_replies = -1
        self.last_ping = float("-inf")
        self.ping_strikes = 0
        self.reads = 0                  # receive_data calls, for the keep-alive check
        self.keepalive_reads = -1
        self.keepalive_at = 0.0
        self.keepalive_sent: float | None = None
        self.pings_without_data = 0
        self.pings_replies = -1
        self.born = 0.0
        self.idle_sid = -1
        self.idle_since = 0.0
        self.second = 0.0
        self.closing_at: float | None = None

    # -- output ----------------------------------------------------------------------------
    def _emit(self, data: bytes) -> None:
        out = self.out
        out.append(data)
        if len(out) == 1 and self.on_output is not None:
            self.on_output()

    def data_to_send(self) -> bytes:
        """Every frame waiting, in order (and none waits after)."""
        data = b"".join(self.out)
        self.out.clear()
        return data

    def initiate_connection(self, now: float) -> None:
        """Our SETTINGS and the connection window's first WINDOW_UPDATE; the deadlines start."""
        limits = self.limits
        max_streams = self.slot.max_streams
        settings = struct.pack(">HLHLHLHL", S_INITIAL_WINDOW_SIZE, limits.stream_window,
                               S_MAX_CONCURRENT_STREAMS,
                               MAX_WINDOW if max_streams is None else max_streams,
                               S_MAX_HEADER_LIST_SIZE, limits.max_header_list_size,
                               S_MAX_FRAME_SIZE, limits.max_frame_size)
        self._emit(frame(SETTINGS, 0, 0, settings)
                   + window_update(0, limits.connection_window - 65535))
        self.born = self.idle_since = self.second = self.keepalive_at = now

    def goaway(self, code: int, debug: bytes = b"") -> None:
        self._emit(frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_sid, code) + debug))

    def shutdown(self) -> None:
        """A graceful stop: GOAWAY(NO_ERROR); streams opened past the last one are refused."""
        self.goaway_sid = self.last_sid
        self.goaway(NO_ERROR)

    def close_connection(self, code: int = PROTOCOL_ERROR, debug: str = "") -> None:
        """A connection error: GOAWAY(code), then ``dead`` (the caller closes)."""
        if self.dead:
            return
        self.dead = True
        if code != NO_ERROR:
            log.debug("HTTP/2 connection error %#x: %s", code, debug)
        self.goaway(code, debug.encode()[:256])

    def lost(self) -> list[H2Stream]:
        """The socket is gone: the streams it had (the layer above drops them), and nothing
        held any more."""
        self.dead = True
        gone = list(self.streams.values())
        if self.continuing is not None:
            gone.append(self.continuing)
        for st in gone:
            self.pending_total -= len(st.pending)
            st.pending = bytearray()
            st.wants_drain = False
            st.block = bytearray()
        self.streams.clear()
        self.blocked.clear()
        self.continuing = None
        self.heads.clear()
        self.out.clear()
        self.buf = bytearray()
        self.pending_total = 0
        return gone

    # -- timers ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """The connection's deadlines at ``now`` (call it a few times a second)."""
        limits = self.limits
        if now - self.second >= 1.0:            # flood counters are per second
            self.second, self.control, self.resets = now, 0, 0
        if not self.settled:
            if now - self.born > limits.handshake_timeout:
                return self.close_connection(PROTOCOL_ERROR, "handshake timeout")
        # idle: no stream open and none opened since the last tick
        if self.streams or self.last_sid != self.idle_sid:
            self.idle_sid, self.idle_since = self.last_sid, now
        elif now - self.idle_since > limits.max_connection_idle:
            return self.close_connection(NO_ERROR, "max_idle")
        # age: GOAWAY, then close after the grace
        age = limits.max_connection_age
        if age is not None and self.goaway_sid is None and now - self.born > age:
            self.goaway_sid = self.last_sid
            self.goaway(NO_ERROR, b"max_age")
            grace = limits.max_connection_age_grace     # None: as grpc core, until streams end
            self.closing_at = now + grace if grace is not None else float("inf")
        if self.closing_at is not None and (now >= self.closing_at or not self.streams):
            return self.close_connection(NO_ERROR, "max_age")
        self.events.timer(now)
        # keep-alive: a ping after keepalive_time without anything read; no ACK in time: close
        if self.keepalive_sent is not None:
            if now - self.keepalive_sent > limits.keepalive_timeout:
                return self.close_connection(NO_ERROR, "keepalive timeout")
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
                self._emit(frame(PING, 0, 0, KEEPALIVE_PING))

    # -- input -----------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer: frames parsed, events raised, answers queued. A connection
        error leaves GOAWAY queued and ``dead`` set."""
        if self.dead:
            return
        self.reads += 1
        buf = self.buf
        buf += data
        if not self.preface:
            if len(buf) < 24:
                if PREFACE[:len(buf)] != bytes(buf):
                    return self.close_connection(PROTOCOL_ERROR, "not an HTTP/2 preface")
                return
            if bytes(buf[:24]) != PREFACE:
                return self.close_connection(PROTOCOL_ERROR, "not an HTTP/2 preface")
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
            return self.close_connection(err.code, str(err))
        except (OversizedHeaderListError,) as err:
            self.buf = bytearray()
            return self.close_connection(ENHANCE_YOUR_CALM, f"header list too large: {err}")
        except HPACKError as err:
            self.buf = bytearray()
            return self.close_connection(COMPRESSION_ERROR, f"HPACK: {err}")
        except Exception:  # noqa: BLE001 - a protocol error closes this connection only
            log.exception("HTTP/2 protocol error")
            self.buf = bytearray()
            return self.close_connection(PROTOCOL_ERROR, "protocol error")
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
            self._emit(frame(PING, ACK, 0, payload))
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
            st = self.streams.get(sid)
            if st is not None:
                self.forget(st)
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
        now = self.clock()
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
        self._emit(frame(SETTINGS, ACK, 0))
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
            return self.reset_stream(st, PROTOCOL_ERROR)
        st.window += inc
        if st.window > MAX_WINDOW:
            return self.reset_stream(st, FLOW_CONTROL_ERROR)
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
            st = self.new_stream(sid, self.peer_window, limits.stream_window)
            if not self.slot.open_stream(len(self.streams)) or \
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

    def _head(self, block: bytes) -> Any:
        """The decoded header block. A client repeats the same block for every call of a
        method (all fields indexed), and pure-Python HPACK was a large part of the gRPC front's
        CPU per call (see benchmarks/results/notes-frontends.md): a block that left the HPACK table as it found it decodes to the same
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
        head = self.parse_head(self.decoder.decode(block))
        if (entries[0] if entries else None) is newest and len(entries) == state[1] \
                and table.maxsize == state[2] and len(block) <= HEAD_CACHE_BLOCK:
            if len(self.heads) >= HEAD_CACHE:
                self.heads.clear()
            self.heads[block] = (*state, head)
        return head

    def _headers_done(self, st: H2Stream) -> None:
        head = self._head(bytes(st.block))
        st.block = bytearray()
        if st.refused:
            self._emit(frame(RST_STREAM, 0, st.sid, struct.pack(">L", REFUSED_STREAM)))
            return
        if st.head is not None:         # trailers of a request: ignored
            if st.ended:
                self.events.stream_ended(st)
            return
        st.head = head
        self.events.request_received(st)
        if st.ended:
            self.events.stream_ended(st)

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
            self.give_back(None)
            return
        if st.ended:
            self.give_back(None)
            return self.reset_stream(st, STREAM_CLOSED)
        st.recv_window -= size
        if st.recv_window < 0:
            self.give_back(None)
            return self.reset_stream(st, FLOW_CONTROL_ERROR)
        if flags & PADDED:
            if not size or payload[0] >= size:
                raise H2ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
            payload = payload[1:size - payload[0]]
        elif not size and not flags & END_STREAM:
            self._count_control()
        st.credit += size
        if payload:
            self.events.data_received(st, payload)
        if flags & END_STREAM:
            st.ended = True
            self.events.stream_ended(st)
        self.give_back(st)

    def give_back(self, st: H2Stream | None) -> None:
        """WINDOW_UPDATEs: a stream's window while nothing it was given waits (``waiting``)
        and it is still open; the connection's as bytes arrive."""
        updates = b""
        if st is not None and st.credit >= self.stream_refill and not st.waiting \
                and not st.ended and st.sid in self.streams:
            updates = window_update(st.sid, st.credit)
            st.recv_window += st.credit
            st.credit = 0
        if self.credit >= self.conn_refill:
            updates += window_update(0, self.credit)
            self.recv_window += self.credit
            self.credit = 0
        if updates:
            self._emit(updates)

    # -- streams ending --------------------------------------------------------------------
    def reset_stream(self, st: H2Stream, code: int) -> None:
        """A stream error: RST_STREAM(code); the stream is dropped (``stream_reset``)."""
        self._emit(frame(RST_STREAM, 0, st.sid, struct.pack(">L", code)))
        self.forget(st)

    def forget(self, st: H2Stream) -> None:
        """The stream is gone without (more of) an answer: nothing more is sent on it."""
        self.streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)
        st.trailers = b""
        self.pending_total -= len(st.pending)
        st.pending = bytearray()
        st.wants_drain = False
        st.block = bytearray()
        self.events.stream_reset(st)
        self.give_back(None)

    def close_stream(self, st: H2Stream) -> None:
        """Our answer is complete: RST_STREAM(NO_ERROR) if the peer is still sending."""
        if not st.ended:                # the client is still sending: tell it to stop
            self._emit(frame(RST_STREAM, 0, st.sid, struct.pack(">L", NO_ERROR)))
        was_open = self.streams.pop(st.sid, None) is not None
        if was_open:
            self.blocked.pop(st.sid, None)
        self.events.stream_closed(st, was_open)

    # -- sending ---------------------------------------------------------------------------
    def send_headers(self, st: H2Stream, block: bytes, end_stream: bool = False) -> None:
        """A header block in one HEADERS frame (ours are small); with ``end_stream`` the
        stream is done (a trailers-only answer)."""
        if end_stream:
            self.replies += 1
            self._emit(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, block))
            st.trailers = b""
            self.close_stream(st)
        else:
            self._emit(frame(HEADERS, END_HEADERS, st.sid, block))

    def send_whole(self, st: H2Stream, headers: bytes, data_head: bytes, data: bytes,
                   trailers: bytes) -> bool:
        """A whole answer (headers, one DATA frame of ``data_head + data``, trailers) in one
        write, if both windows and the peer's frame size allow and nothing waits before it
        (as nearly every unary call's does); False: nothing was sent."""
        n = len(data_head) + len(data)
        if n > self.send_window or n > st.window or n > self.peer_frame or st.pending:
            return False
        self.replies += 1
        self.send_window -= n
        st.window -= n
        sid = st.sid
        self._emit(b"".join((
            struct.pack(">BHBBL", 0, len(headers), HEADERS, END_HEADERS, sid), headers,
            struct.pack(">BHBBL", n >> 16, n & 0xFFFF, DATA, 0, sid), data_head, data,
            struct.pack(">BHBBL", 0, len(trailers), HEADERS, END_HEADERS | END_STREAM, sid),
            trailers)))
        st.trailers = b""
        self.close_stream(st)
        return True

    def send_data(self, st: H2Stream, body: bytes, trailers: bytes | None = None) -> None:
        """DATA as the windows allow, the rest when they open; then ``trailers`` if given."""
        st.pending += body
        self.pending_total += len(body)
        if trailers is not None:
            self.replies += 1
            st.trailers = trailers
        self._drain(st)

    def end_stream(self, st: H2Stream, trailers: bytes) -> None:
        """Trailers, once the DATA before them is out."""
        self.replies += 1
        st.trailers = trailers
        self._drain(st)

    def _drain(self, st: H2Stream) -> None:
        """Send what the windows allow; the rest waits for WINDOW_UPDATE."""
        if self.dead or st.sid not in self.streams:
            return
        pending = st.pending
        sent = 0
        while pending:
            room = min(self.send_window, st.window, self.peer_frame, len(pending))
            if room <= 0:
                break
            self._emit(frame(DATA, 0, st.sid, bytes(pending[:room])))
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
        if st.wants_drain:
            st.wants_drain = False
            self.events.stream_drained(st)
        if st.trailers:
            self._emit(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, st.trailers))
            st.trailers = b""
            self.close_stream(st)

    def _unblock(self) -> None:
        for st in list(self.blocked.values()):
            self._drain(st)
