"""The standalone server's wiring: the same v2 handlers on their own tornado app, plus the
metrics port and the gRPC port. Used by ``jupyter-triton serve`` and, in a background
thread, by a kernel that finds no Jupyter server extension to talk to."""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from tornado import httpserver, netutil, web

from .engine import Engine, EngineOptions
from .frontends.http import SETTINGS_KEY, FrontendState, route_table
from .frontends.metrics import exposition, metrics_registry

log = logging.getLogger(__name__)


class _Standalone(web.RequestHandler):
    """Host base class for the v2 mixins: no auth, like tritonserver."""


class _Metrics(web.RequestHandler):
    def initialize(self, registry: CollectorRegistry) -> None:
        self.registry = registry

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
    _servers: list = field(default_factory=list)
    _grpc: object | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.http_port}"

    async def stop(self) -> None:
        for server in self._servers:
            server.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.engine.stop()

    def close(self, timeout: float = 30.0) -> None:
        """Stop a server that ``start_in_thread`` runs, from any other thread, and end its loop."""
        asyncio.run_coroutine_threadsafe(self.stop(), self.loop).result(timeout=timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _listen(app: web.Application, host: str, port: int, max_body: int) -> tuple[httpserver.HTTPServer, int]:
    # A client that stops sending mid-body must not hold a connection (and its buffer) forever.
    server = httpserver.HTTPServer(app, max_body_size=max_body, decompress_request=False,
                                   body_timeout=60.0, idle_connection_timeout=300.0)
    sockets = netutil.bind_sockets(port, address=host)
    server.add_sockets(sockets)
    return server, sockets[0].getsockname()[1]


async def start_standalone(options: EngineOptions, host: str = "0.0.0.0", http_port: int = 8000,
                           metrics_port: int | None = 8002, grpc_port: int | None = 8001,
                           access_log: bool = True) -> StandaloneServer:
    """Start the engine and its listeners on the running loop; port 0 picks a free port.
    ``access_log=False`` keeps request lines out of a notebook's cell output (in-kernel use)."""
    engine = Engine(options)
    await engine.start()
    state = FrontendState(engine=engine, max_input_size=options.max_input_size,
                          allow_anonymous_inference=True)
    quiet = {} if access_log else {"log_function": lambda handler: None}
    app = web.Application(route_table(_Standalone, "/"), **{SETTINGS_KEY: state}, **quiet)
    http, bound_http = _listen(app, host, http_port, options.max_input_size)
    result = StandaloneServer(engine, host, bound_http, _servers=[http])
    if metrics_port is not None:
        registry = metrics_registry(engine)
        mapp = web.Application([(r"/metrics", _Metrics, {"registry": registry})])
        mserver, result.metrics_port = _listen(mapp, host, metrics_port, 1024 * 1024)
        result._servers.append(mserver)
    if grpc_port is not None:
        from .frontends.grpc import start_grpc_server
        result._grpc, result.grpc_port = await start_grpc_server(engine, host, grpc_port)
    log.info("serving %s (HTTP %s, gRPC %s, metrics %s)", options.model_repository,
             result.http_port, result.grpc_port, result.metrics_port)
    return result


def start_in_thread(options: EngineOptions, host: str = "127.0.0.1", http_port: int = 0,
                    metrics_port: int | None = 0, grpc_port: int | None = None,
                    timeout: float = 60.0, access_log: bool = True) -> StandaloneServer:
    """Run a standalone server on its own loop in a daemon thread (the kernel fallback)."""
    ready: dict = {}
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            ready["server"] = loop.run_until_complete(
                start_standalone(options, host, http_port, metrics_port, grpc_port, access_log))
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
