"""The standalone server's HTTP/1.1 front: httptools (the C parser uvicorn uses) on asyncio
Protocols, serving ``frontends.dataplane``. Tornado's pure-Python HTTP/1.1 costs most of a
small request's event-loop CPU; this costs a fraction of that (see
benchmarks/results/notes-frontends.md).

What it keeps from tornado's server, as the tornado skin does: keep-alive (HTTP/1.0 only when
asked), pipelined requests answered in order, a body cap, a body
deadline and an idle timeout, Content-Length and chunked bodies, ``Expect: 100-continue``,
HEAD, a client that hangs up cancelling its request, and a graceful close. What is admitted
(Host, credentials, body cap, bytes in flight) is the server's admission's to decide
(``frontends.admission``), asked once per head; so is a connection's slot, asked once when
it is accepted (past the listener's ``max_connections``, a 503 and a close).

What a peer may send is bounded by ``limits.HTTP1Limits`` (nginx's defences, counted as the
bytes arrive, before the parser has a whole head): the request line (414), each header line,
all header lines and their count (431), the head's time (``header_timeout``), the body
(the admission's ticket, chunked ones included, refused as soon as they pass the cap), idle
keep-alive time, and the replies a peer leaves unread (past ``max_pending_reply_bytes`` it is
not read; with no progress for ``send_timeout`` it is dropped). Only HTTP/1.0 and 1.1 are served. A refusal is a Triton error reply, then a close.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools

from ..protocol.errors import (HeaderTooLarge, InvalidArgument, TritonError, Unavailable,
                               URITooLong)
from .admission import ConnectionSlot
from .dataplane import Call, DataPlane, Reply, RequestTimeout, Route, error_reply
from .limits import HTTP1Limits

log = logging.getLogger(__name__)
access_log = logging.getLogger("tornado.access")   # the cli quiets this one, as for tornado

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
# Each status line with the Date header's name after it: a reply's head begins with one.
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\nDate: " % (code, reason)
                 for code, reason in _REASONS.items()}
_HEADER_LINES: dict[tuple[str, str], bytes] = {}
# Header names as received -> lower-case text, for the few names clients send (bounded).
_HEADER_NAMES: dict[bytes, str] = {}
# The longest request head a connection keeps to recognise its repeats (``_repeat``).
_KNOWN_HEAD_MAX = 4096


class _Refused(Exception):
    """Raised from a parser callback: parsing stops, ``error`` is the answer, the connection
    closes after it (httptools re-raises it as the context of an HttpParserCallbackError).
    No error: the refusal is queued already."""

    def __init__(self, error: TritonError | None) -> None:
        super().__init__(str(error))
        self.error = error


class _Date:
    """The Date header, formatted once a second."""
    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, formatdate(t, usegmt=True).encode()
        return cls.value


class _Message:
    """One request being received, then queued until its turn."""
    __slots__ = ("method", "url", "headers", "chunks", "size", "length", "route", "params",
                 "ticket", "refused", "keep_alive", "path", "head", "count", "repeated")

    def __init__(self) -> None:
        self.method = "GET"
        self.path = ""
        self.url = b""
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.length: int | None = None
        self.ticket = None
        self.refused: Reply | None = None
        self.keep_alive = True
        self.head = 0           # bytes of the header lines counted; -1 once the head is whole
        self.count = 0          # header lines counted (of guarded reads)
        self.repeated: dict[str, list[str]] | None = None   # values of repeated header names


class HTTPFront:
    """Listening sockets serving one DataPlane."""

    fixed_headers = b""         # header lines every reply carries (a host's defaults)

    def __init__(self, plane: DataPlane, *, body_timeout: float = 60.0,
                 idle_timeout: float | None = None, access_log: bool = True,
                 limits: HTTP1Limits | None = None) -> None:
        self.plane = plane
        self.limits = limits = limits or HTTP1Limits()
        # This listener's connection slots are its door's, under this front's limit.
        self.admission, self.door = plane.admission, plane.door
        self.door.max_connections = limits.max_connections
        self.body_timeout = body_timeout
        # The host's own keep-alive setting, within the limit.
        self.idle_timeout = (limits.idle_timeout if idle_timeout is None
                             else min(idle_timeout, limits.idle_timeout))
        self.header_timeout = limits.header_timeout
        self.access_log = access_log
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._emptied: asyncio.Event | None = None      # set when the last connection closes
        self._routed: dict[str, tuple[Route, dict[str, str]]] = {}

    async def listen(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (``port=0`` picks a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                                reuse_address=True, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    def route(self, path: str) -> tuple[Route, dict[str, str]]:
        """The data-plane route of a request path (and its parameters)."""
        return self.plane.match(path)

    def routed(self, path: str) -> tuple[Route, dict[str, str]]:
        """``route`` with the parameters %-decoded, kept per path: a client repeats its few
        paths (bounded: paths come from clients). The parameters are the caller's to keep,
        not to change."""
        hit = self._routed.get(path)
        if hit is None:
            route, params = self.route(path)
            hit = route, {k: unquote(v) for k, v in params.items()} if params else {}
            if len(self._routed) >= 1024:
                self._routed.clear()
            self._routed[path] = hit
        return hit

    def stop(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their reply."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()

    async def wait_closed(self, timeout: float) -> bool:
        """After ``stop``: until every connection has closed (a busy one after its reply),
        at most ``timeout`` seconds; whether they all did."""
        if self.connections:
            self._emptied = asyncio.Event()
            try:
                await asyncio.wait_for(self._emptied.wait(), timeout)
            except asyncio.TimeoutError:
                return False
        return True


class _Connection(asyncio.Protocol):
    def __init__(self, front: HTTPFront) -> None:
        self.front = front
        self.plane = front.plane
        limits = front.limits
        self.max_url = limits.max_request_line
        self.max_line = limits.max_header_line
        self.max_head = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.max_pipelined = limits.max_pipelined
        # A read no longer than this, that starts no request, holds no header line, head or
        # URL past its limit: only the header count is asked of it (once, per head).
        self.small = min(self.max_url, self.max_line, self.max_head)
        self.guarded = True         # this read's header lines are checked one by one
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.message: _Message | None = None      # being received
        self.queue: collections.deque[_Message] = collections.deque()   # received, not answered
        self.task: asyncio.Task | None = None     # answering queue[0]
        self.closing = False                      # no more requests on this connection
        self.ended = False                        # the last reply is written: closing
        self.answering = False                    # in _answer_queued's loop
        # One lazy timer: _arm only moves the deadline; the handle is rescheduled only when a
        # deadline comes earlier than it (two call_later and two cancels a request otherwise).
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None
        self.on_timeout = None
        self.peer = ""
        self.writable: asyncio.Future | None = None   # set while the transport's buffer is full
        self.head_bytes = 0                       # bytes of a head that spans reads
        self.body_seen = 0                        # body bytes of a message that spans reads
        self.framing = 0                          # bytes since, in reads with no body bytes
        self.stall: asyncio.TimerHandle | None = None  # watching a peer that does not read
        self.unsent = 0
        self.begun = 0                            # requests whose head began (counted)
        self.last: _Message | None = None         # the request completed in this read
        # The head of the parser's last request, read with its whole body in one read, and
        # what it parsed to (a plain request: Content-Length, keep-alive, nothing refused):
        # see ``_repeat``.
        self.known: tuple | None = None
        self.slot: ConnectionSlot | None = None  # the admission's, held while connected

    # -- connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport       # type: ignore[assignment]
        front = self.front
        try:
            self.slot = front.admission.connect(front.door)
        except TritonError as err:
            self._turn_away(err)
            return
        front.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        transport.set_write_buffer_limits(high=front.limits.max_pending_reply_bytes)
        # A new connection's first request head is due within the header deadline.
        self._arm(min(front.header_timeout, front.idle_timeout), self._idle)

    def _turn_away(self, err: TritonError) -> None:
        """A connection the admission refused (past ``max_connections``): its answer, then a
        close, nothing read."""
        self.closing = self.ended = True
        reply = error_reply(err)
        self.transport.write(self._head(reply, close=True, body=reply.body))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        front = self.front
        if self.slot is not None:
            self.slot.release()
        front.connections.discard(self)
        if front._emptied is not None and not front.connections:
            front._emptied.set()
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        self.closing = self.ended = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
        for m in [self.message, *self.queue]:
            if m is not None and m.ticket is not None:
                m.ticket.release()
        self.queue.clear()
        self.message = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return              # lingering after a refusal: drained, never parsed
        before = self.message
        known = self.known
        if before is None and known is not None and len(data) == known[1] and \
                data.startswith(known[0]) and self._repeat(known, data):
            return
        self.guarded = before is not None or len(data) > self.small
        begun = self.begun
        # From here on the parser's last request is not the known one (its version, asked of
        # the parser for a streamed reply, is that request's), unless it is learned below.
        self.known = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as err:
            refused = err.__context__
            if isinstance(refused, _Refused):
                if refused.error is not None:
                    self._fail(refused.error)
            else:
                self._fail(InvalidArgument(f"malformed HTTP request: {err}"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(InvalidArgument("protocol upgrades are not supported"))
            return
        except httptools.HttpParserError as err:
            self._fail(InvalidArgument(f"malformed HTTP request: {err}"))
            return
        if self.message is not None:
            self._unfinished(self.message, before, len(data))
        elif before is None and self.begun == begun + 1:
            self._learn(self.last, data)
        self.last = None

    def _learn(self, m: _Message, data: bytes) -> None:
        """Keep the head of ``m``, a request that was the whole of ``data``, head and body,
        when it is plain: a Content-Length body, keep-alive, admitted, no Expect, no repeated
        header, a head of a real client's size (what is kept lasts as long as the connection).
        (A head fed apart from its body, as shared_port.py feeds them, is not kept.)"""
        length = m.length
        if length and m.size == length and len(data) - length <= _KNOWN_HEAD_MAX and \
                m.refused is None and m.keep_alive and m.repeated is None and \
                "expect" not in m.headers and "transfer-encoding" not in m.headers:
            self.known = (data[:len(data) - length], len(data), m.method, m.url, m.path,
                          m.route, m.params, m.headers, length)

    def _repeat(self, known: tuple, data: bytes) -> bool:
        """A read that is the known head byte for byte and a body of its length is that
        request again: a client repeats its head (perf_analyzer, tritonclient, a notebook's
        loop), and llhttp reads no byte of a Content-Length body, so the parser would find
        what it found before. Its ten callbacks are skipped; admission runs as for any head.
        False: refused, so left to the parser, where refusals are answered."""
        head, _, method, url, path, route, params, headers, length = known
        try:
            ticket = self.plane.admit(route, method, headers, length)
        except Exception:
            return False
        m = _Message()
        m.method, m.url, m.path, m.route, m.params = method, url, path, route, params
        m.headers = headers             # read only, as the parameters are
        m.head, m.length, m.size, m.ticket = -1, length, length, ticket
        m.chunks.append(data[len(head):])
        self._disarm()
        try:
            self._complete(m)
        except _Refused:
            pass                        # refused and answered: nothing else in the read
        return True

    def _unfinished(self, m: _Message, before: _Message | None, received: int) -> None:
        """A request still incomplete after a read (not the fast path: a whole request
        usually comes in one). The parser holds an unfinished header line where no callback
        sees it, so its bytes are counted here: those of every read that continued a head (a
        lower bound that misses at most the read the head began in), and those of a chunked
        body's reads that brought no body bytes (chunk framing, trailer lines)."""
        continued = m is before
        if m.head >= 0:
            if not continued:
                self.head_bytes = 0
                self._arm(self.front.header_timeout, self._head_late)
                return
            self.head_bytes += received
            if self.head_bytes > self.max_url + self.max_head:     # (on_url bounds the URL)
                self._fail(HeaderTooLarge(
                    f"the request's header lines exceed {self.max_head} bytes"))
        elif m.length is None:
            if continued and m.size == self.body_seen:
                self.framing += received
                if self.framing > self.max_head:
                    self._fail(HeaderTooLarge(
                        f"the request's trailer lines exceed {self.max_head} bytes"))
            else:
                self.body_seen, self.framing = m.size, 0

    def pause_writing(self) -> None:
        # A peer that does not read what it is sent is not read either (its pipelined
        # requests would queue their replies here): reading resumes when the buffer drains.
        if self.writable is None:
            self.writable = self.loop.create_future()
        self.transport.pause_reading()
        self._watch_writes()

    def resume_writing(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.task is None and not self.ended:
            if self.queue:
                self._next()
            else:
                self._idle_again()

    def _may_read(self) -> bool:
        return True

    def _watch_writes(self) -> None:
        """Drop a peer whose unread replies make no progress for ``send_timeout`` (nginx's
        send_timeout): held back here, they would hold memory for as long as it likes."""
        if self.stall is None and self.transport is not None:
            self.unsent = self.transport.get_write_buffer_size()
            self.stall = self.loop.call_later(self.front.limits.send_timeout, self._stalled)

    def _stalled(self) -> None:
        self.stall = None
        transport = self.transport
        if transport is None:
            return
        unsent = transport.get_write_buffer_size()
        if not unsent:
            return
        if unsent < self.unsent:
            self._watch_writes()        # slow but reading
            return
        log.debug("dropping %s: %d reply bytes unread for %g s", self.peer, unsent,
                  self.front.limits.send_timeout)
        transport.abort()

    def eof_received(self) -> bool | None:
        return None             # close: a half-closed client has left (as tornado treats it)

    def shutdown(self) -> None:
        self.closing = True
        if self.task is None and self.message is None and self.transport is not None:
            self.transport.close()

    # -- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.message = _Message()
        self.begun += 1

    def on_url(self, url: bytes) -> None:
        m = self.message
        if m is not None:
            m.url += url
            if len(m.url) > self.max_url:
                raise _Refused(URITooLong(f"the request line exceeds {self.max_url} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        m = self.message
        if m is None:
            return
        if self.guarded and self._count(m, len(name) + len(value)):
            return              # a trailer line: counted, not kept (the head was admitted)
        key = _HEADER_NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            if len(_HEADER_NAMES) < 256:
                _HEADER_NAMES[name] = key
        headers = m.headers
        text = value.decode("latin-1")
        if key in headers:
            # Joined once the head is whole: joining here would copy the value so far
            # again for every repeat (quadratic in their count).
            repeated = m.repeated
            if repeated is None:
                repeated = m.repeated = {}
            values = repeated.get(key)
            if values is None:
                repeated[key] = [headers[key], text]
            else:
                values.append(text)
        else:
            headers[key] = text

    def _count(self, m: _Message, line: int) -> bool:
        """One header line of a guarded read (a large one, one that continues a request, any
        after a body's head) against the limits; True for a trailer line."""
        m.count += 1
        trailer = m.head < 0
        if not trailer:
            m.head += line + 4
        if line > self.max_line:
            raise _Refused(HeaderTooLarge(f"a header line exceeds {self.max_line} bytes"))
        if m.count > self.max_headers:
            raise _Refused(self._too_many())
        if m.head > self.max_head:
            raise _Refused(HeaderTooLarge(
                f"the request's header lines exceed {self.max_head} bytes"))
        return trailer

    def _too_many(self) -> HeaderTooLarge:
        return HeaderTooLarge(f"the request has more than {self.max_headers} header lines")

    def on_headers_complete(self) -> None:
        m = self.message
        if m is None:
            return
        m.head = -1
        if m.repeated is not None or len(m.headers) > self.max_headers:
            self._count_and_join(m)
        m.method = self.parser.get_method().decode("latin-1")
        m.keep_alive = keep = self.parser.should_keep_alive()
        # llhttp also takes 0.9 request lines (no version), and 2.0. A request that keeps its
        # connection without asking is 1.1: the version is asked of the others only.
        if (not keep or "connection" in m.headers) and \
                self.parser.get_http_version() not in ("1.1", "1.0"):
            raise _Refused(InvalidArgument(
                f"HTTP/{self.parser.get_http_version()} is not served: send HTTP/1.1"))
        self._take(m)

    def _count_and_join(self, m: _Message) -> None:
        """The header count of a whole head (its repeats included), then each repeated
        header's values joined as one."""
        repeated = m.repeated or {}
        if len(m.headers) + sum(len(v) - 1 for v in repeated.values()) > self.max_headers:
            raise _Refused(self._too_many())
        for key, values in repeated.items():
            m.headers[key] = ",".join(values)

    def _take(self, m: _Message) -> None:
        """Route and admit a whole head; what is refused is answered (and, with a body that
        is not wanted, the connection closed)."""
        url = m.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            m.path = url.decode("latin-1")      # origin-form, no query: the path itself
        else:
            try:
                m.path = httptools.parse_url(url).path.decode("latin-1")
            except httptools.HttpParserInvalidURLError:
                m.path = ""
        m.route, m.params = self.front.routed(m.path)
        self._disarm()
        if "content-length" in m.headers or "transfer-encoding" in m.headers:
            self._arm(self.front.body_timeout, self._body_late)
            self.guarded = True             # trailer lines, if any, are counted and dropped
        try:
            length = m.headers.get("content-length")
            m.length = int(length) if length is not None else None
            if m.ticket is None:        # (the fast lane on Jupyter's port admits as it claims)
                m.ticket = self.plane.admit(m.route, m.method, m.headers, m.length)
        except ValueError:
            m.refused = error_reply(InvalidArgument("malformed Content-Length"))
        except Exception as err:
            m.refused = self.plane.refuse(err)
        if m.refused is not None:
            # What a refused client still sends is not kept; a large or chunked body ends the
            # connection (as tornado does) rather than be read through.
            if (m.length > self.plane.max_input_size if m.length is not None
                    else "transfer-encoding" in m.headers):
                self._answer_then_close(m)
            return
        if m.headers.get("expect", "").lower() == "100-continue" and not self.queue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        m = self.message
        if m is None or m.refused is not None:
            return
        if m.length is None:
            # A chunked body is counted as it comes: past the cap (or the bytes in flight)
            # it is refused now, not read through to its end.
            try:
                m.ticket.receive(len(body))
            except TritonError as err:
                raise _Refused(err) from None
        m.size += len(body)
        m.chunks.append(body)

    def on_message_complete(self) -> None:
        m, self.message = self.message, None
        self._disarm()
        if m is None:
            return
        self.last = m
        self._complete(m)

    def _complete(self, m: _Message) -> None:
        """A whole request: queued to be answered in its turn."""
        if self.closing:            # stopping: a request that arrives now is not served
            if m.ticket is not None:
                m.ticket.release()
            if self.task is None and not self.queue:
                self.transport.close()
            return
        if (self.task is not None or self.writable is not None) and \
                len(self.queue) >= self.max_pipelined:
            # Pipelined (the rest of a read is parsed while reading waits): a bounded number.
            if m.ticket is not None:
                m.ticket.release()
            self._fail(Unavailable(
                f"{self.max_pipelined} pipelined requests already wait for their answers"))
            raise _Refused(None)            # the rest of the read is not parsed
        self.queue.append(m)
        if not m.keep_alive or (m.refused is not None and m.refused.close):
            self.closing = True
        if self.task is None:
            self._next()
        else:
            self.transport.pause_reading()      # pipelined: hold the rest until answered

    # -- answering ----------------------------------------------------------------------------
    def _next(self) -> None:
        m = self.queue[0]
        if m.refused is not None or self.writable is not None:
            self._answer_queued()
            return
        body = m.chunks[0] if len(m.chunks) == 1 else m.chunks
        call = Call(m.method, m.path, m.params, m.headers, body, m.ticket)
        m.chunks = []
        self.task = self.loop.create_task(self._answer(m.route, call))

    def _answer_queued(self) -> None:
        """Refusals at the queue's head are written here, in a loop (a pipeline of them
        would otherwise recurse through _sent), up to the first request to serve; nothing
        is answered while the peer leaves earlier replies unread."""
        if self.answering:
            return              # called back from _sent inside the loop below
        self.answering = True
        try:
            queue = self.queue
            while queue and self.task is None and self.writable is None and not self.ended:
                m = queue[0]
                if m.refused is None:
                    self._next()
                    break
                self._send(m, m.refused)
        finally:
            self.answering = False

    async def _answer(self, route, call: Call) -> None:
        # The reply is written from the task itself: a done callback costs a loop iteration.
        try:
            reply = await self.plane.handle(route, call)
        except asyncio.CancelledError:
            self.task = None
            raise
        except Exception as exc:
            reply = self.plane.refuse(exc)
        if reply.stream is not None:
            await self._send_stream(self.queue[0], reply)
            return
        if self.transport is None or self.transport.is_closing():
            self.task = None
            return
        self._send(self.queue[0], reply)

    async def _send_stream(self, m: _Message, reply: Reply) -> None:
        """A streamed reply, chunked, each chunk written as it comes; a client that goes
        away (the task is cancelled) or a closed transport ends the stream, which cancels
        its request."""
        stream = reply.stream
        complete = False
        # An HTTP/1.0 client knows no chunked encoding: its body ends with the connection.
        # (Asked of the parser now, not per request: a pipelining 1.0 client does not exist.)
        http10 = self.parser.get_http_version() == "1.0"
        try:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(self._head(reply, close=http10, chunked=not http10))
                async for chunk in stream:
                    if transport.is_closing():
                        break
                    if chunk:
                        transport.write(chunk if http10 else
                                        b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    if self.writable is not None:   # a slow reader holds the model back
                        await self.writable
                else:
                    if not http10:
                        transport.write(b"0\r\n\r\n")
                    complete = True
        except asyncio.CancelledError:
            self.task = None
            raise
        except Exception:       # a bug: the status line is out, so the connection ends here
            log.error("streamed reply to %s %s failed", m.method, m.path, exc_info=True)
        finally:
            await stream.aclose()
        if not complete:
            self.task = None
            if self.transport is not None:
                self.transport.close()
            return
        self._sent(m, reply, http10 or self.closing and len(self.queue) == 1 or reply.close)

    def _head(self, reply: Reply, close: bool = False, chunked: bool = False,
              body: bytes = b"") -> bytes:
        status = reply.status
        line = _STATUS_LINES.get(status)
        if line is None:
            line = b"HTTP/1.1 %d Unknown\r\nDate: " % status
        head = [line, _Date.now(),
                b"\r\nContent-Length: %d\r\n" % len(reply.body) if reply.stream is None
                else b"\r\nTransfer-Encoding: chunked\r\n" if chunked else b"\r\n",
                self.front.fixed_headers]
        for item in reply.headers.items():
            line = _HEADER_LINES.get(item)
            if line is None:
                line = b"%s: %s\r\n" % (item[0].encode("latin-1"), item[1].encode("latin-1"))
                if len(_HEADER_LINES) < 512:        # the few (name, value) pairs replies repeat
                    _HEADER_LINES[item] = line
            head.append(line)
        if close:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        if body:
            head.append(body)
        return b"".join(head)

    def _send(self, m: _Message, reply: Reply) -> None:
        if self.transport is None or self.transport.is_closing():
            self.task = None
            self.queue.popleft()
            return
        close = self.closing and len(self.queue) == 1 or reply.close
        body = reply.body
        if m.method == "HEAD" or not body:
            self.transport.write(self._head(reply, close))
        elif len(body) < 65536:                 # one send, one segment
            self.transport.write(self._head(reply, close, body=body))
        else:
            self.transport.writelines([self._head(reply, close), body])
        self._sent(m, reply, close)

    def _sent(self, m: _Message, reply: Reply, close: bool) -> None:
        """After a reply is written: log it, then the next request, or close, or idle."""
        self.task = None
        self.queue.popleft()
        status = reply.status
        if self.front.access_log:
            # tornado's levels: client errors are warnings, server errors errors
            level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
            if access_log.isEnabledFor(level):
                access_log.log(level, "%d %s %s (%s)", status, m.method, m.path, self.peer)
        if close:
            self._close_after_write()
        elif self.queue:
            if not self.answering:
                self._next()
        elif self.writable is None:
            self._idle_again()
        # else: resume_writing reads on once the peer has read its replies

    def _idle_again(self) -> None:
        """Every request answered: read the next one, and wait at most the idle timeout."""
        if self._may_read():
            self.transport.resume_reading()
        if self.deadline is None:           # no body under its deadline: idle (or slow headers)
            self._arm(self.front.idle_timeout, self._idle)

    def _answer_then_close(self, m: _Message) -> None:
        """Answer ``m`` at once (its body is not wanted) and close, after what came before."""
        self.message = None
        self.closing = True
        self._disarm()
        self.queue.append(m)
        if self.task is None:
            self._next()

    def _fail(self, err: TritonError) -> None:
        m = self.message or _Message()
        if m.ticket is not None:
            m.ticket.release()
            m.ticket = None
        m.refused = error_reply(err)
        m.chunks = []
        self._answer_then_close(m)

    def _close_after_write(self) -> None:
        # Half-close first, then drain what the client still sends for a moment: closing a
        # socket with unread data makes the kernel send a reset that can destroy the reply.
        self.closing = self.ended = True
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self._arm(2.0, transport.close)
        if transport.get_write_buffer_size():
            self._watch_writes()

    # -- timers ---------------------------------------------------------------------------------
    def _arm(self, delay: float, callback) -> None:
        self.deadline = deadline = self.loop.time() + delay
        self.on_timeout = callback
        timer = self.timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self.timer = self.loop.call_at(deadline, self._tick)

    def _disarm(self) -> None:
        self.deadline = None                # the handle stays: it finds nothing to do

    def _tick(self) -> None:
        self.timer = None
        deadline = self.deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:
            self.timer = self.loop.call_at(deadline, self._tick)
            return
        callback, self.deadline, self.on_timeout = self.on_timeout, None, None
        callback()

    def _head_pending(self) -> bool:
        m = self.message
        return m is not None and m.head >= 0

    def _idle(self) -> None:
        if self.task is None and not self.queue and self.transport is not None:
            if self._head_pending():            # a head began meanwhile: it is late
                self._head_late()
                return
            self.transport.close()
            if self.transport.get_write_buffer_size():
                self._watch_writes()

    def _head_late(self) -> None:
        if not self._head_pending():
            return
        self._fail(RequestTimeout(
            f"the request head was not received within {self.front.header_timeout:g} s"))

    def _body_late(self) -> None:
        m = self.message
        if m is None:
            return
        self._fail(RequestTimeout(
            f"the request body was not received within {self.front.body_timeout:g} s"))
