"""The standalone server's wiring: the v2 data plane on its own HTTP port (the httptools front,
or the tornado skin with ``http_front="tornado"``), plus the metrics port and the gRPC port.
Used by ``jupyter-triton serve`` and, in a background thread, by a kernel that finds no
Jupyter server extension to talk to (with a token, ``check_host`` and
``strict_content_type``: a browser page or another local user must not reach it)."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from tornado import netutil, web

from .engine import Engine, EngineOptions
from .engine.observation.server_log import ServerLog
from .frontends.admission import STATISTICS, AccessPolicy, Admission, Door
from .frontends.dataplane import DataPlane
from .frontends.fasthttp import HTTPFront
from .frontends.grpc_options import GrpcTLS
from .frontends.http import SETTINGS_KEY, AdmittedHTTPServer, FrontendState, route_table
from .frontends.limits import HTTP2Limits
from .frontends.metrics import exposition, metrics_registry
from .protocol.errors import TritonError

HTTP_FRONTS = ("fast", "tornado")
# A client that stops sending mid-body must not hold a connection (and its buffer) forever.
BODY_TIMEOUT_S, IDLE_TIMEOUT_S = 60.0, 300.0

log = logging.getLogger(__name__)


class _Standalone(web.RequestHandler):
    """Host base class for the v2 mixins: no auth, like tritonserver."""


class _Metrics(web.RequestHandler):
    """Prometheus text. Model names and counts are the ``statistics`` group's (Triton has no
    group of its own for metrics): where the HTTP port needs a credential, so does this. The
    server's admission decides, at this port's door."""

    def initialize(self, registry: CollectorRegistry, admission: Admission, door: Door) -> None:
        self.registry, self.admission, self.door = registry, admission, door

    def prepare(self) -> None:
        try:
            self.admission.admit(self.door, STATISTICS, "GET", self.request.headers, 0,
                                 op="Metrics").release()
        except TritonError as err:
            self.set_status(err.status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"error": str(err)}))

    def get(self) -> None:
        body, content_type = exposition(self.registry)
        self.set_header("Content-Type", content_type)
        self.finish(body)


@dataclass
class StandaloneServer:
    engine: Engine
    host: str
    http_port: int
    metrics_port: int | None = None
    grpc_port: int | None = None
    plane: DataPlane | None = None
    _servers: list = field(default_factory=list)
    _grpc: object | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.http_port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Close the listeners and stop the engine while the calls in flight finish: an HTTP
        request as its model drains (within the exit timeout), its reply written; a gRPC call
        within ``grace`` seconds (a health Watch never ends by itself)."""
        for server in self._servers:
            server.stop()
        bound = self.engine.options.exit_timeout_secs
        waits = [self.engine.stop(), *(server.wait_closed(bound) for server in self._servers
                                       if isinstance(server, HTTPFront))]
        if self._grpc is not None:
            waits.append(self._grpc.stop(grace=grace))
        await asyncio.gather(*waits)
        if self.plane is not None:
            self.plane.close()

    async def shutdown(self, drain_secs: float = 0.0, cut_short: asyncio.Event | None = None
                       ) -> None:
        """A graceful stop (``jupyter-triton serve --shutdown-drain-secs``): not ready but
        serving for ``drain_secs`` (engine.drain; ``cut_short``: a second signal ends it),
        then ``stop``, where gRPC calls in flight have the exit timeout too. 0: ``stop``."""
        if drain_secs <= 0:
            return await self.stop()
        await self.engine.drain(drain_secs, cut_short)
        log.info("drained: closing the listeners; requests in flight have %g s",
                 self.engine.options.exit_timeout_secs)
        await self.stop(grace=self.engine.options.exit_timeout_secs)

    def close(self, timeout: float = 30.0) -> None:
        """Stop a server that ``start_in_thread`` runs, from any other thread, and end its loop."""
        asyncio.run_coroutine_threadsafe(self.stop(), self.loop).result(timeout=timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _listen(app: web.Application, host: str, port: int, max_body: int, admission: Admission,
            door: Door) -> tuple[AdmittedHTTPServer, int]:
    sockets = netutil.bind_sockets(port, address=host)
    return _serve_on(app, sockets, max_body, admission, door), sockets[0].getsockname()[1]


def _serve_on(app: web.Application, sockets: list, max_body: int, admission: Admission,
              door: Door) -> AdmittedHTTPServer:
    """tornado on ``sockets``, each connection a slot of ``door`` at the admission."""
    server = AdmittedHTTPServer(app, max_body_size=max_body, decompress_request=False,
                                body_timeout=BODY_TIMEOUT_S, idle_connection_timeout=IDLE_TIMEOUT_S,
                                admission=admission, door=door)
    server.add_sockets(sockets)
    return server


def _loopback_hosts(host: str, port: int) -> frozenset[str]:
    """The Host header values a client of ``host:port`` sends; a page served from another
    name (DNS rebinding) sends its own and is refused."""
    names = {"127.0.0.1", "localhost", "[::1]"}
    if host not in ("", "0.0.0.0", "::"):
        names.add(f"[{host}]" if ":" in host else host)
    return frozenset(f"{name}:{port}".lower() for name in names)


async def start_standalone(options: EngineOptions, host: str = "0.0.0.0", http_port: int = 8000,
                           metrics_port: int | None = 8002, grpc_port: int | None = 8001,
                           access_log: bool = True, *, access: AccessPolicy | None = None,
                           grpc_access: AccessPolicy | None = None, grpc_host: str | None = None,
                           check_host: bool = False, strict_content_type: bool = False,
                           http_front: str = "fast", max_inflight_bytes: int | None = None,
                           grpc_limits: HTTP2Limits | None = None, grpc_ssl: GrpcTLS | None = None,
                           server_log: ServerLog | None = None) -> StandaloneServer:
    """Start the engine and its listeners on the running loop; port 0 picks a free port.

    ``access`` guards the HTTP routes and ``grpc_access`` the gRPC port (None: open, as
    tritonserver). ``check_host`` refuses (403) a Host header other than the loopback names and
    the bound address with the bound port; ``strict_content_type`` refuses (415) a POST whose
    Content-Type is neither JSON nor octet-stream (a browser's ``text/plain`` form); the metrics
    port takes ``access`` too (as the ``statistics`` group) and ``check_host``. ``http_front``:
    "fast" (httptools) or "tornado". ``max_inflight_bytes`` bounds the request body bytes being
    received or decoded at once, server-wide (None: 4 x max_input_size; past it, 503).
    ``grpc_limits`` (keep-alive, connection age: tritonserver's gRPC flags) and ``grpc_ssl``
    (TLS) are the gRPC port's. ``server_log``: log settings installed before the server
    (tritonserver's --log-* flags; None: the engine's own, Python logging's output).
    ``access_log=False`` keeps request lines out of a
    notebook's cell output (in-kernel use)."""
    if http_front not in HTTP_FRONTS:
        raise ValueError(f"http_front must be one of {HTTP_FRONTS}, got {http_front!r}")
    engine = Engine(options, server_log=server_log)
    await engine.start()
    state = FrontendState(engine=engine, max_input_size=options.max_input_size,
                          allow_anonymous_inference=True, access=access,
                          max_inflight_bytes=max_inflight_bytes,
                          body_timeout=BODY_TIMEOUT_S, strict_content_type=strict_content_type)
    plane = state.plane
    quiet = {} if access_log else {"log_function": lambda handler: None}
    # HTTP listens last, as tritonserver starts gRPC before HTTP: a client that saw
    # v2/health/ready over HTTP finds the other ports listening.
    result = StandaloneServer(engine, host, 0, plane=plane)
    try:
        if grpc_port is not None:
            from .frontends.grpc import start_grpc_server
            result._grpc, result.grpc_port = await start_grpc_server(
                engine, grpc_host if grpc_host is not None else host, grpc_port, access=grpc_access,
                limits=grpc_limits, ssl=grpc_ssl, admission=plane.admission)
        if metrics_port is not None:
            registry = metrics_registry(engine)
            sockets = netutil.bind_sockets(metrics_port, address=host)
            result.metrics_port = sockets[0].getsockname()[1]
            guard = {"registry": registry, "admission": plane.admission, "door": Door(
                "metrics", hosts=_loopback_hosts(host, result.metrics_port) if check_host else None)}
            mapp = web.Application([(r"/metrics", _Metrics, guard)], **quiet)
            result._servers.append(_serve_on(mapp, sockets, 1024 * 1024, plane.admission,
                                             guard["door"]))
        if http_front == "fast":
            front = HTTPFront(plane, body_timeout=BODY_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S,
                              access_log=access_log)
            result.http_port = await front.listen(host, http_port)
            result._servers.append(front)
        else:
            app = web.Application(route_table(_Standalone, "/"), **{SETTINGS_KEY: state}, **quiet)
            http, result.http_port = _listen(app, host, http_port, options.max_input_size,
                                             plane.admission, plane.door)
            result._servers.append(http)
        if check_host:
            plane.allowed_hosts = _loopback_hosts(host, result.http_port)
    except BaseException:
        await result.stop()     # a port taken: what did start does not outlive the error
        raise
    log.info("serving %s (HTTP %s [%s], gRPC %s, metrics %s; event loop: %s)",
             options.model_repository, result.http_port, http_front, result.grpc_port,
             result.metrics_port, type(asyncio.get_running_loop()).__module__.partition(".")[0])
    return result


def start_in_thread(options: EngineOptions, host: str = "127.0.0.1", http_port: int = 0,
                    metrics_port: int | None = 0, grpc_port: int | None = None,
                    timeout: float = 60.0, access_log: bool = True, *,
                    access: AccessPolicy | None = None, grpc_access: AccessPolicy | None = None,
                    grpc_host: str | None = None, check_host: bool = False,
                    strict_content_type: bool = False, http_front: str = "fast",
                    max_inflight_bytes: int | None = None, grpc_limits: HTTP2Limits | None = None,
                    grpc_ssl: GrpcTLS | None = None, server_log: ServerLog | None = None
                    ) -> StandaloneServer:
    """Run a standalone server on its own loop in a daemon thread (the kernel fallback);
    the keywords are ``start_standalone``'s."""
    keywords = dict(access=access, grpc_access=grpc_access, grpc_host=grpc_host,
                    check_host=check_host, strict_content_type=strict_content_type,
                    http_front=http_front, max_inflight_bytes=max_inflight_bytes,
                    grpc_limits=grpc_limits, grpc_ssl=grpc_ssl, server_log=server_log)
    ready: dict = {}
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            ready["server"] = loop.run_until_complete(
                start_standalone(options, host, http_port, metrics_port, grpc_port, access_log,
                                 **keywords))
            ready["loop"] = loop
        except BaseException as err:  # handed to the caller
            ready["error"] = err
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="jupyter-triton-server", daemon=True)
    thread.start()
    if not started.wait(timeout):
        raise TimeoutError(f"standalone server did not start within {timeout} s")
    if "error" in ready:
        raise ready["error"]
    server: StandaloneServer = ready["server"]
    server.loop = ready["loop"]
    server.thread = thread
    return server
