"""The standalone server's HTTP/1.1 front: httptools (the C parser uvicorn uses) on asyncio
Protocols, serving ``frontends.dataplane``. Tornado's pure-Python HTTP/1.1 costs a few hundred
microseconds of event-loop CPU a request; this costs a fraction of that.

What it keeps from tornado's server, as the tornado skin does: keep-alive (HTTP/1.0 only when
asked), pipelined requests answered in order, a body cap (``DataPlane.admit``), a body
deadline and an idle timeout, Content-Length and chunked bodies, ``Expect: 100-continue``,
HEAD, a client that hangs up cancelling its request, and a graceful close.
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

from ..protocol.errors import InvalidArgument, TritonError
from .dataplane import Call, DataPlane, Reply, RequestTimeout, Route, error_reply

log = logging.getLogger(__name__)
access_log = logging.getLogger("tornado.access")   # the cli quiets this one, as for tornado

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
_HEADER_LINES: dict[tuple[str, str], bytes] = {}


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
                 "ticket", "refused", "keep_alive", "path")

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


class HTTPFront:
    """Listening sockets serving one DataPlane."""

    fixed_headers = b""         # header lines every reply carries (a host's defaults)

    def __init__(self, plane: DataPlane, *, body_timeout: float = 60.0,
                 idle_timeout: float = 300.0, access_log: bool = True) -> None:
        self.plane = plane
        self.body_timeout = body_timeout
        self.idle_timeout = idle_timeout
        self.access_log = access_log
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def listen(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (``port=0`` picks a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                                reuse_address=True, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    def route(self, path: str) -> tuple[Route, dict[str, str]]:
        """The data-plane route of a request path (and its parameters)."""
        return self.plane.match(path)

    def stop(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their reply."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()


class _Connection(asyncio.Protocol):
    def __init__(self, front: HTTPFront) -> None:
        self.front = front
        self.plane = front.plane
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.message: _Message | None = None      # being received
        self.queue: collections.deque[_Message] = collections.deque()   # received, not answered
        self.task: asyncio.Task | None = None     # answering queue[0]
        self.closing = False                      # no more requests on this connection
        # One lazy timer: _arm only moves the deadline; the handle is rescheduled only when a
        # deadline comes earlier than it (two call_later and two cancels a request otherwise).
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None
        self.on_timeout = None
        self.peer = ""
        self.writable: asyncio.Future | None = None   # set while the transport's buffer is full

    # -- connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport       # type: ignore[assignment]
        self.front.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        self._arm(self.front.idle_timeout, self._idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.closing = True
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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(InvalidArgument("protocol upgrades are not supported"))
        except httptools.HttpParserError as err:
            self._fail(InvalidArgument(f"malformed HTTP request: {err}"))

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def eof_received(self) -> bool | None:
        return None             # close: a half-closed client has left (as tornado treats it)

    def shutdown(self) -> None:
        self.closing = True
        if self.task is None and self.message is None and self.transport is not None:
            self.transport.close()

    # -- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.message = _Message()

    def on_url(self, url: bytes) -> None:
        if self.message is not None:
            self.message.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.message is None:
            return
        key = name.decode("latin-1").lower()
        headers = self.message.headers
        text = value.decode("latin-1")
        headers[key] = headers[key] + "," + text if key in headers else text

    def on_headers_complete(self) -> None:
        m = self.message
        if m is None:
            return
        m.method = self.parser.get_method().decode("latin-1")
        m.keep_alive = self.parser.should_keep_alive()
        url = m.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            m.path = url.decode("latin-1")      # origin-form, no query: the path itself
        else:
            try:
                m.path = httptools.parse_url(url).path.decode("latin-1")
            except httptools.HttpParserInvalidURLError:
                m.path = ""
        m.route, params = self.front.route(m.path)
        m.params = {k: unquote(v) for k, v in params.items()} if params else params
        self._disarm()
        if "content-length" in m.headers or "transfer-encoding" in m.headers:
            self._arm(self.front.body_timeout, self._body_late)
        try:
            length = m.headers.get("content-length")
            m.length = int(length) if length is not None else None
            m.ticket = self.plane.admit(m.route, m.method, m.headers, m.length)
        except ValueError:
            m.refused = error_reply(InvalidArgument("malformed Content-Length"))
        except Exception as err:
            m.refused = self.plane.refuse(err)
        if m.refused is not None:
            # What a refused client still sends is not kept; a large body ends the connection
            # (as tornado does) rather than be read through.
            if m.length is not None and m.length > self.plane.max_input_size:
                self._answer_then_close(m)
            return
        if m.headers.get("expect", "").lower() == "100-continue" and not self.queue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        m = self.message
        if m is None or m.refused is not None:
            return
        if m.length is None:
            try:
                self.plane.receive(m.ticket, m.size, len(body))
            except TritonError as err:
                m.refused, m.chunks = error_reply(err), []
                m.refused.close = True
                return
        m.size += len(body)
        m.chunks.append(body)

    def on_message_complete(self) -> None:
        m, self.message = self.message, None
        self._disarm()
        if m is None:
            return
        if self.closing:            # stopping: a request that arrives now is not served
            if m.ticket is not None:
                m.ticket.release()
            if self.task is None and not self.queue:
                self.transport.close()
            return
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
        if m.refused is not None:
            self._send(m, m.refused)
            return
        body = m.chunks[0] if len(m.chunks) == 1 else m.chunks
        call = Call(m.method, m.path, m.params, m.headers, body, m.ticket)
        m.chunks = []
        self.task = self.loop.create_task(self._answer(m.route, call))

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
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")),
                b"Date: ", _Date.now(),
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
            self._next()
        else:
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
        m.refused = error_reply(err)
        self._answer_then_close(m)

    def _close_after_write(self) -> None:
        # Half-close first, then drain what the client still sends for a moment: closing a
        # socket with unread data makes the kernel send a reset that can destroy the reply.
        self.closing = True
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self._arm(2.0, transport.close)

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

    def _idle(self) -> None:
        if self.task is None and not self.queue and self.transport is not None:
            self.transport.close()

    def _body_late(self) -> None:
        m = self.message
        if m is None:
            return
        if m.ticket is not None:
            m.ticket.release()
        m.refused = error_reply(RequestTimeout(
            f"the request body was not received within {self.front.body_timeout:g} s"))
        self._answer_then_close(m)

