"""Triton's v2 HTTP routes as tornado handlers: a thin skin over ``frontends.dataplane``,
mounted on the Jupyter server (behind its auth, see ``serverext``) and, with
``http_front="tornado"``, on the standalone server.

Handlers are mixins over an unspecified base: ``route_table(base)`` combines each with the
base class of the host (JupyterHandler or tornado's RequestHandler). The data plane renders
every error of the v2 operations; ``write_error`` renders those tornado raises itself (405,
the host's auth) in the same ``{"error": "..."}`` shape.

Where the listener is ours (the standalone server's HTTP port with this skin, its metrics
port), it is an ``AdmittedHTTPServer``: each connection takes its slot at the admission as
the fast front's do. Jupyter's own port is jupyter_server's listener, not ours: a cap there
would refuse the notebook's own connections (kernels, the lab) for a reason of ours.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from tornado import httpserver, httputil, web
from tornado.ioloop import IOLoop
from tornado.iostream import IOStream, StreamClosedError

from ..engine import Engine
from ..protocol.errors import TritonError
from .admission import AccessPolicy, Admission, ConnectionSlot, Door
from .dataplane import (ADMIN, INFER, BodyTicket, Call, DataPlane, Reply, RequestTimeout, Route,
                        error_reply)
from .dataplane import ROUTES as PLANE_ROUTES
from .limits import HTTP1Limits

log = logging.getLogger(__name__)

SETTINGS_KEY = "jupyter_triton"
__all__ = ["ADMIN", "INFER", "SETTINGS_KEY", "AdmittedHTTPServer", "FrontendState", "ROUTES",
           "route_table", "route_scopes"]


@dataclass
class FrontendState:
    """What handlers find in ``settings[SETTINGS_KEY]``; ``plane`` is built from it on first
    use (set every field before the server takes requests). With ``admission`` (the server's,
    shared with its other listeners), the size, bytes-in-flight and Host fields are its own."""
    engine: Engine
    max_input_size: int = 64 * 1024 * 1024
    inference_keys: frozenset[str] = field(default_factory=frozenset)
    server_token: str = ""                  # full access to these routes only
    allow_anonymous_inference: bool = False
    access: AccessPolicy | None = None      # None: open (the host's own auth decides)
    max_inflight_bytes: int | None = None   # None: 4 x max_input_size
    body_timeout: float | None = 60.0       # seconds a streamed infer body may take
    allowed_hosts: frozenset[str] | None = None
    strict_content_type: bool = False
    admission: Admission | None = None
    door: Door | None = None                # with ``admission``: these routes' door

    @cached_property
    def plane(self) -> DataPlane:
        if self.admission is not None:
            return DataPlane(self.engine, admission=self.admission, door=self.door or Door(
                "http", access=self.access if self.access is not None else AccessPolicy.open(),
                strict_content_type=self.strict_content_type))
        return DataPlane(self.engine, access=self.access, max_input_size=self.max_input_size,
                         max_inflight_bytes=self.max_inflight_bytes,
                         allowed_hosts=self.allowed_hosts,
                         strict_content_type=self.strict_content_type)


class V2Handler:
    """Shared behaviour of every v2 route (a mixin: the host supplies the RequestHandler)."""

    route: Route
    api_group: str
    scope = INFER
    _ticket: BodyTicket | None = None       # where the host admitted the request (Jupyter's)

    @property
    def state(self) -> FrontendState:
        return self.settings[SETTINGS_KEY]

    @property
    def engine(self) -> Engine:
        return self.state.engine

    async def _serve(self, body: bytes | list[bytes], ticket=None, **params: str | None) -> None:
        call = Call(self.request.method or "GET", self.request.path,
                    {k: v for k, v in params.items() if v is not None},
                    self.request.headers, body, ticket or self._ticket, self)
        self.write_reply(await self.state.plane.handle(self.route, call))

    def write_reply(self, reply: Reply) -> None:
        self.set_status(reply.status)
        for name, value in reply.headers.items():
            self.set_header(name, value)
        done = self.finish(reply.body)
        if reply.close:
            connection = self.request.connection
            done.add_done_callback(lambda _: connection.close())

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, TritonError):
            message = str(exc)
        elif isinstance(exc, web.HTTPError):
            message = exc.log_message or exc.reason or self._reason
        elif exc is not None:
            log.error("unhandled error in %s", self.request.path, exc_info=kwargs["exc_info"])
            message = f"internal error: {type(exc).__name__}"
        else:
            message = self._reason
        self.set_header("Content-Type", "application/json")
        self.clear_header("Inference-Header-Content-Length")
        self.finish(json.dumps({"error": message}))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, TritonError):
            status_code = exc.status
            kwargs["reason"] = None
        super().send_error(status_code, **kwargs)

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, TritonError):
            log.debug("%s %s -> %d %s", self.request.method, self.request.path, value.status, value)
            return
        super().log_exception(typ, value, tb)


class StreamedBody(V2Handler):
    """The infer route: its body is received under the data plane's admission (cap, bytes in
    flight, credentials checked before a byte is read), within a deadline, and a client that
    hangs up cancels its request."""

    _task: asyncio.Future | None = None
    _deadline: object | None = None
    _body_ended = False

    def finish(self, chunk=None):
        # Answered before its body ended (refused on its head, or its body too slow): tornado
        # closes such a connection rather than read the rest, but decides so only after the
        # status line is out, without ``Connection: close``. A proxy that reuses the connection
        # (JupyterHub's) then gets a reset and tells some other user their server is down.
        unread = (not self._body_ended and not self._headers_written
                  and (self.request.headers.get("Content-Length", "0") != "0"
                       or "Transfer-Encoding" in self.request.headers))
        if unread:
            self.set_header("Connection", "close")
        done = super().finish(chunk)
        if unread:
            connection = self.request.connection
            done.add_done_callback(lambda _: connection.close())
        return done

    async def prepare(self) -> None:
        self._chunks: list[bytes] = []
        self._received = 0
        self._body_error: Exception | None = None
        plane = self.state.plane
        length = self.request.headers.get("Content-Length")
        self._length = int(length) if length is not None and length.isdigit() else None
        try:
            result = super().prepare()
            if inspect.isawaitable(result):
                await result
            if self._finished:
                return
            if self._ticket is None:
                self._ticket = plane.admit(self.route, self.request.method or "POST",
                                           self.request.headers, self._length, self)
        except (web.HTTPError, TritonError) as err:
            if self._length is None or self._length > plane.max_input_size:
                raise           # answered now; the connection closes (finish)
            # A refused head whose body is small is answered once the body has passed, unread
            # (as the fast front does): the connection stays usable, no reset for a proxy.
            self._body_error = err
        self.request.connection.set_max_body_size(plane.max_input_size)
        timeout = self.state.body_timeout
        if timeout is not None:
            self._deadline = IOLoop.current().call_later(timeout, self._body_timed_out, timeout)

    def data_received(self, chunk: bytes) -> None:
        if self._body_error is not None:
            return
        if self._length is None:
            try:
                self._ticket.receive(len(chunk))
            except TritonError as err:      # answered once the body has ended
                self._body_error, self._chunks = err, []
                return
        self._received += len(chunk)
        self._chunks.append(chunk)

    def _body_timed_out(self, timeout: float) -> None:
        if not self._finished:
            self.write_reply(error_reply(RequestTimeout(
                f"the request body was not received within {timeout:g} s")))
            self._ticket.release()

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            IOLoop.current().remove_timeout(self._deadline)
            self._deadline = None

    async def _serve(self, body: bytes | list[bytes], ticket=None, **params: str | None) -> None:
        self._body_ended = True
        self._stop_clock()
        if self._body_error is not None:
            raise self._body_error
        chunks, self._chunks = self._chunks, []
        body = chunks[0] if len(chunks) == 1 else chunks
        call = Call(self.request.method or "POST", self.request.path,
                    {k: v for k, v in params.items() if v is not None},
                    self.request.headers, body, self._ticket, self)
        # A task of its own, so that a client hanging up cancels it (see on_connection_close).
        self._task = asyncio.ensure_future(self.state.plane.handle(self.route, call))
        try:
            reply = await self._task
            if reply.stream is not None:        # the same for the stream's writing
                self._task = asyncio.ensure_future(self._write_stream(reply))
                await self._task
                return
        except asyncio.CancelledError:
            if self.request.connection.stream is None or self.request.connection.stream.closed():
                return
            raise
        self.write_reply(reply)

    async def _write_stream(self, reply: Reply) -> None:
        """A streamed reply (server-sent events), each chunk flushed as it comes; the client
        going away ends it (and so cancels its request)."""
        stream = reply.stream
        try:
            self.set_status(reply.status)
            for name, value in reply.headers.items():
                self.set_header(name, value)
            async for chunk in stream:
                self.write(chunk)
                await self.flush()      # waits for a slow reader: the model waits too
            self.finish()
        except StreamClosedError:
            pass
        except Exception:       # a bug: the status line is out, so the connection ends here
            log.error("streamed reply to %s failed", self.request.path, exc_info=True)
            self.request.connection.close()
        finally:
            await stream.aclose()

    def on_connection_close(self) -> None:
        # The client went away: cancelling its task drops it from the batcher's queue
        # (or discards its result), so nobody computes for a closed socket.
        self._release()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        super().on_connection_close()

    def on_finish(self) -> None:
        self._release()
        super().on_finish()

    def _release(self) -> None:
        self._stop_clock()
        if self._ticket is not None:
            self._ticket.release()


HTTP_METHODS = ("get", "post", "put", "delete", "patch", "head")


def _method(verb: str) -> Callable:
    async def serve(self: V2Handler, *args: str, **params: str | None) -> None:
        await self._serve(self.request.body or b"", **params)
    serve.__name__ = verb.lower()
    return serve


def _mixin(route: Route) -> type:
    verbs = list(route.methods) + (["HEAD"] if "GET" in route.methods else [])
    base = StreamedBody if route.streams_body else V2Handler
    return type(route.name, (base,), {"route": route, "api_group": route.api_group,
                                      "scope": route.scope, "__module__": __name__,
                                      **{v.lower(): _method(v) for v in verbs}})


ROUTES: list[tuple[str, type]] = [(route.pattern, _mixin(route)) for route in PLANE_ROUTES]


def route_table(base: type, prefix: str = "/", guard=None) -> list[tuple[str, type]]:
    """The v2 routes under ``prefix``, each handler combined with the host's ``base``;
    ``guard`` (e.g. Jupyter's auth decorators) wraps every HTTP method of every route."""
    table = []
    for pattern, handler in ROUTES:
        # The mixins don't derive from RequestHandler: what they have, they define.
        methods = {m: guard(vars(handler)[m]) for m in HTTP_METHODS
                   if guard is not None and m in vars(handler)}
        cls = type(handler.__name__, (handler, base), {"__module__": __name__, **methods})
        if handler.route.streams_body:
            cls = web.stream_request_body(cls)
        table.append((prefix + pattern, cls))
    return table


def route_scopes() -> dict[str, str]:
    return {pattern: handler.scope for pattern, handler in ROUTES}


class AdmittedHTTPServer(httpserver.HTTPServer):
    """tornado's HTTP server on a listener of ours: each connection it accepts asks
    ``admission.connect(door)`` for its slot (the door's ``max_connections``: ``limits``', set
    here as the fast front sets its own) and gives it back once tornado is done with it; past
    the cap, the admission's refusal (a 503) and a close, nothing read."""

    def initialize(self, *args: Any, admission: Admission, door: Door,
                   limits: HTTP1Limits | None = None, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self.admission, self.door = admission, door
        door.max_connections = (limits or HTTP1Limits()).max_connections
        self.slots: dict[IOStream, ConnectionSlot] = {}

    def handle_stream(self, stream: IOStream, address: tuple) -> None:
        try:
            slot = self.admission.connect(self.door)
        except TritonError as err:
            _turn_away(stream, err)
            return
        self.slots[stream] = slot
        super().handle_stream(stream, address)

    def on_close(self, server_conn: Any) -> None:
        # tornado's end of a connection's request loop (a close, either side's): once each
        slot = self.slots.pop(server_conn.stream, None)
        if slot is not None:
            slot.release()
        super().on_close(server_conn)


def _turn_away(stream: IOStream, err: TritonError) -> None:
    """A connection the admission refused: its answer, then a close."""
    reply = error_reply(err)
    head = [f"HTTP/1.1 {reply.status} {httputil.responses.get(reply.status, 'Unknown')}"]
    head += [f"{name}: {value}" for name, value in reply.headers.items()]
    head += [f"Content-Length: {len(reply.body)}", "Connection: close", "", ""]
    stream.write("\r\n".join(head).encode("latin-1") + reply.body).add_done_callback(
        functools.partial(_close_after, stream))


def _close_after(stream: IOStream, written: asyncio.Future) -> None:
    if not written.cancelled():
        written.exception()     # a peer gone first: its write failed, tornado closed the stream
    stream.close()
