"""The fast HTTP front on a tornado server's own port: requests it is told to claim are
served by ``frontends.fasthttp`` (httptools, no tornado in the path); every other connection
goes to tornado, untouched, from the first request the front does not claim.

A connection starts here. Each request head is looked at before a byte of it is parsed as
served: ``claims(message)`` says yes (served here) or no. On a no, the connection is handed
to tornado's own ``handle_stream`` as a new IOStream over a duplicate of the socket, holding
every byte received from that request on: tornado parses it as if it had read it itself
(keep-alive, websockets, TLS-less upgrades, errors: all tornado's). Nothing a claimed
request gets differs from what the standalone fast front gives, and nothing an unclaimed one
gets differs from tornado's answer.

TLS is tornado's alone (an SSL stream is never taken). Bodies sent chunked are never claimed:
where such a body ends is the parser's business, and a later request could not be handed on.

Limits (``HTTP1Limits``): a claimed request meets fasthttp's; a head past one of them, or in a
version other than HTTP/1.0 and 1.1, is not claimed (tornado refuses it, with its own limits);
nothing is held for tornado past ``HEAD_LIMIT`` (and one read); a head not whole within
``header_timeout`` is refused here (408), as is a connection past ``max_connections`` (503:
the admission's count of this listener's door, as on fasthttp's own ports).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Callable

from tornado.iostream import IOStream, SSLIOStream

from .dataplane import NOT_FOUND, DataPlane, Reply, RequestTimeout, Route
from .fasthttp import HTTPFront, _Connection, _Message
from .limits import HTTP1Limits

log = logging.getLogger(__name__)

HEAD_LIMIT = 65536      # a head not complete by then is tornado's to refuse (its max_header_size)


class ClaimedMessage(_Message):
    __slots__ = ("start",)

    def __init__(self) -> None:
        super().__init__()
        self.start = time.monotonic()


class PrefilledIOStream(IOStream):
    """An IOStream that first reads ``data`` (what the fast front received and did not
    serve), then the socket: tornado's documented subclass hook ``read_from_fd``.

    The prefill is given in one read: tornado reads the socket again only when it is readable,
    so bytes held back here past a read would wait for the client's next ones (its reads are
    chunks of ``read_chunk_size``, raised for the first read and put back after it)."""

    def __init__(self, sock: socket.socket, data: bytes, read_chunk_size: int | None = None,
                 **kwargs) -> None:
        self._chunk_size = read_chunk_size or 65536
        super().__init__(sock, read_chunk_size=max(self._chunk_size, len(data)), **kwargs)
        self._prefill = memoryview(data)

    def read_from_fd(self, buf: bytearray | memoryview) -> int | None:
        if self._prefill:
            n = min(len(buf), len(self._prefill))
            buf[:n] = self._prefill[:n]
            self._prefill = self._prefill[n:]
            if not self._prefill:
                self.read_chunk_size = self._chunk_size
            return n
        return super().read_from_fd(buf)


class SharedPort(HTTPFront):
    """The fast front on ``http_server``'s port, mounted at ``prefix``.

    ``claims(message, route)`` decides per request (method, url, headers are set; route is
    the data-plane route of the path under ``prefix``); ``served(message, reply, seconds)`` is
    told of every reply written. ``fixed_headers`` go on every claimed reply (the host's own
    default headers)."""

    def __init__(self, plane: DataPlane, http_server, prefix: str,
                 claims: Callable[[ClaimedMessage, Route], bool], *,
                 served: Callable[[ClaimedMessage, Reply, float], None] | None = None,
                 fixed_headers: bytes = b"", body_timeout: float = 60.0,
                 idle_timeout: float | None = None, limits: HTTP1Limits | None = None) -> None:
        super().__init__(plane, body_timeout=body_timeout, idle_timeout=idle_timeout,
                         access_log=False, limits=limits)
        self.http_server = http_server
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.prefix_bytes = self.prefix.encode("latin-1")
        self.claims = claims
        self.served = served
        self.fixed_headers = fixed_headers
        self.tornado_handle_stream = None
        self.handed_off = 0          # connections given to tornado (tests and logs read it)

    def install(self) -> None:
        """Take new connections of ``http_server`` (those accepted from now on)."""
        if self.tornado_handle_stream is None:
            self.tornado_handle_stream = self.http_server.handle_stream
            self.http_server.handle_stream = self._handle_stream

    def uninstall(self) -> None:
        if self.tornado_handle_stream is not None:
            self.http_server.handle_stream = self.tornado_handle_stream
            self.tornado_handle_stream = None

    def route(self, path: str) -> tuple[Route, dict[str, str]]:
        return self.plane.match(path[len(self.prefix) - 1:])

    def _handle_stream(self, stream: IOStream, address) -> None:
        if isinstance(stream, SSLIOStream) or type(stream) is not IOStream:
            self.tornado_handle_stream(stream, address)
            return
        # The stream has read nothing and registered nothing: its socket is taken as is.
        sock = stream.socket
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(
            lambda: _ClaimingConnection(self, address), sock))
        task.add_done_callback(_report_failure)

    def hand_off(self, sock: socket.socket, data: bytes, address) -> None:
        self.handed_off += 1
        server = self.http_server
        stream = PrefilledIOStream(sock, data, max_buffer_size=server.max_buffer_size,
                                   read_chunk_size=server.read_chunk_size)
        self.tornado_handle_stream(stream, address)


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("a connection could not be taken: %s", task.exception())


class _ClaimingConnection(_Connection):
    """fasthttp's connection, fed one request head at a time so that the bytes of a request
    it does not claim are still whole for tornado."""

    front: SharedPort

    def __init__(self, front: SharedPort, address) -> None:
        super().__init__(front)
        self.address = address
        self.raw = bytearray()          # received, not yet fed to the parser
        self.body_left: int | None = None    # None: the next bytes start a request head
        self.unclaimed: bytearray | None = None   # set: going to tornado with these bytes
        self.transport_socket: socket.socket | None = None
        self.head_timed = False         # the header deadline runs for the head in ``raw``

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport_socket = transport.get_extra_info("socket")

    def on_message_begin(self) -> None:
        self.message = ClaimedMessage()

    def data_received(self, data: bytes) -> None:
        if self.unclaimed is not None:
            self.unclaimed += data
            return
        if self.closing:
            return
        left = self.body_left
        if left and not self.raw:       # the body of a claimed request: straight to the parser
            if len(data) < left:
                self.body_left = left - len(data)
                super().data_received(data)
                return
            self.body_left = None
            super().data_received(data[:left] if len(data) > left else data)
            data = data[left:]
            if not data:
                return
        self.raw += data
        self._feed()

    def _feed(self) -> None:
        raw = self.raw
        while raw and self.unclaimed is None and not self.closing:
            if self.body_left is None:
                end = raw.find(b"\r\n\r\n")
                if end < 0:
                    if len(raw) > HEAD_LIMIT:
                        self._unclaim()
                    elif not self.head_timed:       # a head in pieces: under its deadline
                        self.head_timed = True
                        self._arm(self.front.header_timeout, self._head_late)
                    return
                self.head_timed = False
                head = bytes(raw[:end + 4])
                self.body_left = 0
                self.guarded = len(head) > self.small
                try:
                    self.parser.feed_data(head)
                except Exception:       # malformed, an upgrade, a limit: tornado's to say
                    if self.unclaimed is None and not self.closing:   # (closing: refused here)
                        self._unclaim()
                if self.unclaimed is not None:
                    return
                del raw[:end + 4]
                if self.message is None:        # complete at its head (no body)
                    self.body_left = None
                continue
            n = min(self.body_left, len(raw))
            chunk = bytes(raw[:n])
            del raw[:n]
            self.body_left -= n
            if self.body_left == 0:
                self.body_left = None
            super().data_received(chunk)

    def _take(self, m: _Message) -> None:
        # A whole head within the limits, in HTTP/1.x (any other raised in the parser's
        # callbacks, and _feed handed it to tornado): claimed, or tornado's from here on.
        url = m.url
        route = None
        if (url.startswith(self.front.prefix_bytes) and b"?" not in url and b"#" not in url
                and not self.parser.should_upgrade() and "transfer-encoding" not in m.headers):
            route = self.front.route(url.decode("latin-1"))[0]
        if route is None or route is NOT_FOUND or not self.front.claims(m, route):
            self.message = None
            self._unclaim()
            return
        super()._take(m)
        length = m.length
        self.body_left = length if length else None

    def _unclaim(self) -> None:
        """From the request now at the head of ``raw`` on, the connection is tornado's."""
        self.unclaimed = self.raw
        self.raw = bytearray()
        self.message = None
        self.body_left = None
        self._disarm()
        self.transport.pause_reading()
        self._hand_off_when_idle()

    def _hand_off_when_idle(self) -> None:
        # After the replies to what came before (pipelined), once they have left the buffer.
        if self.unclaimed is None or self.task is not None or self.queue:
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.set_write_buffer_limits(high=0)     # resume_writing once it drains
            return
        data, self.unclaimed = bytes(self.unclaimed), None
        sock = self.transport_socket
        try:
            duplicate = socket.socket(sock.family, sock.type, sock.proto,
                                      fileno=os.dup(sock.fileno()))
        except OSError as err:
            log.warning("a connection could not be handed to the Jupyter server: %s", err)
            transport.abort()
            return
        self.closing = True
        # Our descriptor closes; the connection lives on in the duplicate, which tornado owns.
        transport.abort()
        self.front.hand_off(duplicate, data, self.address)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._hand_off_when_idle()

    def _may_read(self) -> bool:
        return self.unclaimed is None           # reading is tornado's once it is handed over

    def _head_pending(self) -> bool:
        return bool(self.raw) and self.body_left is None and self.unclaimed is None

    def _head_late(self) -> None:
        if self._head_pending():
            self.raw = bytearray()
            self._fail(RequestTimeout(
                f"the request head was not received within {self.front.header_timeout:g} s"))

    def _sent(self, m: _Message, reply: Reply, close: bool) -> None:
        served = self.front.served
        if served is not None and isinstance(m, ClaimedMessage):
            served(m, reply, time.monotonic() - m.start)
        if self.unclaimed is not None:
            if close:
                self.unclaimed = None       # the client asked to close: what follows is void
            super()._sent(m, reply, close)
            if not close:
                self.transport.pause_reading()
                self._hand_off_when_idle()
            return
        super()._sent(m, reply, close)
