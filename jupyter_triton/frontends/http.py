"""Triton's v2 HTTP routes as tornado handlers, written once and mounted twice: on the
Jupyter server (behind its auth, see ``serverext``) and in the standalone app (``cli``).

Handlers are mixins over an unspecified base: ``route_table(base)`` combines each with the
base class of the host (JupyterHandler or tornado's RequestHandler). Every error is
rendered here, once, as ``{"error": "..."}`` with the status its TritonError carries.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import json
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any

from tornado import web

from ..config import config_to_json
from ..protocol.errors import InvalidArgument, NotFound, TritonError
from ..protocol.http_codec import (decode_infer_request, decode_raw_infer_request,
                                   encode_infer_response)

log = logging.getLogger(__name__)

SETTINGS_KEY = "jupyter_triton"
INFER, ADMIN = "infer", "admin"          # scopes: inference keys reach INFER routes only


@dataclass
class FrontendState:
    """What handlers find in ``settings[SETTINGS_KEY]``."""
    engine: Any
    max_input_size: int = 64 * 1024 * 1024
    inference_keys: frozenset[str] = field(default_factory=frozenset)
    server_token: str = ""                  # full access to these routes only
    allow_anonymous_inference: bool = False


class V2Handler:
    """Shared behaviour of every v2 route (a mixin: the host supplies the RequestHandler)."""

    scope = INFER

    @property
    def state(self) -> FrontendState:
        return self.settings[SETTINGS_KEY]

    @property
    def engine(self):
        return self.state.engine

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj, separators=(",", ":")))

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

    def json_body(self) -> dict:
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except (ValueError, RecursionError) as err:
            raise InvalidArgument(f"failed to parse the request JSON buffer: {err}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return body


class HealthLive(V2Handler):
    def get(self) -> None:
        self.set_status(200 if self.engine.live() else 400)
        self.finish()


class HealthReady(V2Handler):
    def get(self) -> None:
        self.set_status(200 if self.engine.ready() else 400)
        self.finish()


class ServerMetadata(V2Handler):
    def get(self) -> None:
        self.send_json(self.engine.server_metadata())


class ModelMetadata(V2Handler):
    def get(self, model: str, version: str | None = None) -> None:
        self.send_json(self.engine.model_metadata(model, version or ""))


class ModelReady(V2Handler):
    def get(self, model: str, version: str | None = None) -> None:
        self.set_status(200 if self.engine.model_ready(model, version or "") else 400)
        self.finish()


class ModelConfig(V2Handler):
    def get(self, model: str, version: str | None = None) -> None:
        self.send_json(config_to_json(self.engine.model_config(model, version or "")))


class ModelStats(V2Handler):
    scope = ADMIN

    def get(self, model: str | None = None, version: str | None = None) -> None:
        self.send_json(self.engine.statistics(model or "", version or ""))


class RepositoryIndex(V2Handler):
    scope = ADMIN

    def post(self) -> None:
        body = self.json_body()
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument("'ready' must be a boolean")
        self.send_json(self.engine.repository_index(ready_only=ready))


class RepositoryLoad(V2Handler):
    scope = ADMIN

    async def post(self, model: str) -> None:
        params = self.json_body().get("parameters", {}) or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be a JSON object")
        config = params.get("config")
        if config is not None and not isinstance(config, (str, dict)):
            raise InvalidArgument("load parameter 'config' must be a JSON string")
        if isinstance(config, dict):
            config = json.dumps(config)
        files: dict[str, bytes] = {}
        for key, value in params.items():
            if key.startswith("file:"):
                if not isinstance(value, str):
                    raise InvalidArgument(f"load parameter '{key}' must be base64 text")
                try:
                    files[key] = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError):
                    raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None
        await self.engine.load_model(model, config=config, files=files)
        self.set_status(200)
        self.finish()


class RepositoryUnload(V2Handler):
    scope = ADMIN

    async def post(self, model: str) -> None:
        params = self.json_body().get("parameters", {}) or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be a JSON object")
        dependents = params.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgument("unload parameter 'unload_dependents' must be a boolean")
        await self.engine.unload_model(model, unload_dependents=dependents)
        self.set_status(200)
        self.finish()


class ModelInfer(V2Handler):
    """The data path's front door: body streamed under a cap, decoded, run, encoded."""

    streams_body = True     # route_table applies tornado's stream_request_body to the host class

    async def prepare(self) -> None:
        result = super().prepare()
        if inspect.isawaitable(result):
            await result
        if self._finished:
            return
        cap = self.state.max_input_size
        length = self.request.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise InvalidArgument(
                f"request body of {length} bytes exceeds the maximum input size of {cap} bytes "
                f"(--http-max-input-size)")
        self.request.connection.set_max_body_size(cap)
        self._chunks: list[bytes] = []

    def data_received(self, chunk: bytes) -> None:
        self._chunks.append(chunk)

    async def post(self, model: str, version: str | None = None) -> None:
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        body = self._decompress(body)
        header = self.request.headers.get("Inference-Header-Content-Length")
        version = version or ""
        if header is None:
            request = decode_infer_request(body, None, model, version)
        else:
            if not header.strip().isdigit():
                raise InvalidArgument("Inference-Header-Content-Length must be a non-negative integer")
            length = int(header)
            if length == 0:
                name, datatype, dims = self.engine.raw_input(model, version)
                request = decode_raw_infer_request(body, model, version, name, datatype, dims)
            else:
                request = decode_infer_request(body, length, model, version)
        # A task of its own, so that a client hanging up cancels it (see on_connection_close).
        self._infer_task = asyncio.ensure_future(self.engine.infer(request))
        try:
            response = await self._infer_task
        except asyncio.CancelledError:
            if self.request.connection.stream is None or self.request.connection.stream.closed():
                return
            raise
        payload, json_length = encode_infer_response(response, request)
        if json_length is not None:
            self.set_header("Inference-Header-Content-Length", str(json_length))
            self.set_header("Content-Type", "application/octet-stream")
        else:
            self.set_header("Content-Type", "application/json")
        self.finish(payload)

    def on_connection_close(self) -> None:
        # The client went away: cancelling its task drops it from the batcher's queue
        # (or discards its result), so nobody computes for a closed socket.
        task = getattr(self, "_infer_task", None)
        if task is not None and not task.done():
            task.cancel()
        super().on_connection_close()

    def _decompress(self, body: bytes) -> bytes:
        encoding = (self.request.headers.get("Content-Encoding") or "").lower()
        if not encoding or encoding == "identity":
            return body
        if encoding not in ("gzip", "deflate"):
            raise InvalidArgument(f"unsupported Content-Encoding '{encoding}'")
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, self.state.max_input_size + 1)
        except zlib.error as err:
            raise InvalidArgument(f"failed to decompress the request body: {err}") from None
        if len(out) > self.state.max_input_size:
            raise InvalidArgument("decompressed request body exceeds the maximum input size")
        return out


class NotFoundRoute(V2Handler):
    def _unknown(self, *args: Any) -> None:
        raise NotFound(f"unknown route: {self.request.method} {self.request.path}")

    get = post = put = delete = _unknown


_MODEL = r"(?P<model>[^/]+)"
_VERSION = r"(?:/versions/(?P<version>[0-9]+))?"

ROUTES: list[tuple[str, type]] = [
    (r"v2/health/live", HealthLive),
    (r"v2/health/ready", HealthReady),
    (r"v2/?", ServerMetadata),
    (r"v2/models/stats", ModelStats),
    (rf"v2/models/{_MODEL}{_VERSION}/stats", ModelStats),
    (rf"v2/models/{_MODEL}{_VERSION}/ready", ModelReady),
    (rf"v2/models/{_MODEL}{_VERSION}/config", ModelConfig),
    (rf"v2/models/{_MODEL}{_VERSION}/infer", ModelInfer),
    (rf"v2/models/{_MODEL}{_VERSION}/?", ModelMetadata),
    (r"v2/repository/index", RepositoryIndex),
    (rf"v2/repository/models/{_MODEL}/load", RepositoryLoad),
    (rf"v2/repository/models/{_MODEL}/unload", RepositoryUnload),
    (r"v2/.*", NotFoundRoute),
]


HTTP_METHODS = ("get", "post", "put", "delete", "patch", "head")


def route_table(base: type, prefix: str = "/", guard=None) -> list[tuple[str, type]]:
    """The v2 routes under ``prefix``, each handler combined with the host's ``base``;
    ``guard`` (e.g. Jupyter's auth decorators) wraps every HTTP method of every route."""
    table = []
    for pattern, handler in ROUTES:
        # The mixins don't derive from RequestHandler: what they have, they define.
        methods = {m: guard(getattr(handler, m)) for m in HTTP_METHODS
                   if guard is not None and hasattr(handler, m)}
        cls = type(handler.__name__, (handler, base), {"__module__": __name__, **methods})
        if getattr(handler, "streams_body", False):
            cls = web.stream_request_body(cls)
        table.append((prefix + pattern, cls))
    return table


def route_scopes() -> dict[str, str]:
    return {pattern: handler.scope for pattern, handler in ROUTES}
