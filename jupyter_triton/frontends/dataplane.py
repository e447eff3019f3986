"""Triton's v2 HTTP operations, each written once over (method, path parameters, headers,
body bytes) -> Reply(status, headers, body bytes): admission (Host, Content-Type, credentials,
body size, bytes in flight), decode, one engine call, encode, and the error rendered as
``{"error": "..."}`` with the status its TritonError carries.

The skins (``frontends.http``: tornado handlers for the Jupyter server and the standalone
server; ``frontends.fasthttp``: the standalone's httptools front) only move bytes: they match
a route of ``ROUTES``, collect the body under ``DataPlane.admit``'s ticket, and write the
Reply that ``DataPlane.handle`` returns. A streamed Reply (``stream``: generate_stream and
OpenAI's ``stream: true``, over ``Engine.infer_stream``) is written chunk by chunk as its
events come; a client that goes away ends it, which cancels the model's request.

Besides Triton's v2 routes: the generate extension (``frontends.generate``) and OpenAI's
``v1/`` routes (``frontends.openai``), each mapping its JSON onto the same engine calls.

A data path for one request, in the order it flows: the skin (fasthttp.py or http.py), this
file, protocol/http_codec.py, engine/__init__.py (Engine.infer), the model's scheduler.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from ..config import config_to_json
from ..engine import Engine
from ..engine.observation.capture import traffic_json
from ..engine.composition.streaming import DecoupledRefused
from ..protocol.errors import Internal, InvalidArgument, NotFound, TritonError
from ..protocol import decode_infer_request, decode_raw_infer_request, encode_infer_response
from ..protocol.types import InferResponse
from ..repository.lineage import read as read_lineage
from . import openai, openai_embeddings
from .generate import (SSE_CONTENT_TYPE, close_stream, first_response, generate_events,
                       generate_request, generate_response, is_empty_final)
from ..engine.observation.trace import trace_context
from . import operations
from .admission import (HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY,
                        SHARED_MEMORY, STATISTICS, TRACE, AccessPolicy, Admission, BodyTicket, Door)

log = logging.getLogger(__name__)

JSON = "application/json"
OCTET = "application/octet-stream"
# Bodies (in or out) above this size are decoded / encoded on a codec thread, so that the
# event loop (the whole Jupyter server, when mounted there) keeps answering meanwhile.
OFFLOAD_BYTES = 1 << 20


class RequestTimeout(TritonError):
    """A client that did not send its whole body in time (the connection is closed)."""
    status = 408
    grpc_code = "DEADLINE_EXCEEDED"


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False         # the skin closes the connection after writing it
    # A streamed body (server-sent events): the skin writes ``body`` chunks as they come,
    # chunked, and closes the iterator when done or when the client goes away.
    stream: AsyncIterator[bytes] | None = None


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode(), {"Content-Type": JSON})


def error_reply(err: TritonError | str, status: int | None = None) -> Reply:
    code = status if status is not None else (err.status if isinstance(err, TritonError) else 500)
    headers = {"Content-Type": JSON}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:       # e.g. a model still loading on demand (engine/lifecycle/on_demand.py)
        headers["Retry-After"] = str(retry_after)
    return Reply(code, json.dumps({"error": str(err)}).encode(), headers,
                 close=isinstance(err, RequestTimeout))


@dataclass
class Call:
    """One request as the data plane sees it. ``headers`` is any mapping answering
    lower-case names (tornado's HTTPHeaders, or the fast front's dict); ``context``: what the
    skin's host is asked who the caller is through (a Jupyter handler; see ``admit``)."""
    method: str
    path: str
    params: dict[str, str]
    headers: Mapping[str, str]
    body: bytes | list[bytes] = b""
    ticket: "BodyTicket | None" = None
    context: Any = None

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


Operation = Callable[["DataPlane", Call], Awaitable[Reply]]


@dataclass(frozen=True)
class Route:
    pattern: str                 # relative to the mount point, tornado's regex syntax
    name: str                    # the handler class name the tornado skin gives it
    api_group: str               # admission's API group: what credential reaches it
    methods: dict[str, Operation]
    scope: str = "infer"         # serverext's older split: "infer" | "admin"
    streams_body: bool = False   # the body is received under the infer route's own cap


class DataPlane:
    """The engine behind every HTTP skin, under the server's ``admission`` at the listener's
    ``door`` (an admission is made from the other arguments when none is given: a server of
    this one listener)."""

    def __init__(self, engine: Engine, *, access: AccessPolicy | None = None,
                 max_input_size: int = 64 * 1024 * 1024, max_inflight_bytes: int | None = None,
                 allowed_hosts: frozenset[str] | None = None,
                 strict_content_type: bool = False, admission: Admission | None = None,
                 door: Door | None = None) -> None:
        self.engine = engine
        if admission is None:
            admission = Admission(access, max_input_size=max_input_size,
                                  max_inflight_bytes=max_inflight_bytes)
            access = None
        self.admission = admission
        self.door = door if door is not None else Door(
            "http", access=access, hosts=allowed_hosts, strict_content_type=strict_content_type)
        self.max_input_size = admission.max_input_size
        self.budget = admission.budget
        self._codec_pool: ThreadPoolExecutor | None = None

    @property
    def allowed_hosts(self):
        """The Host values this plane's door accepts."""
        return self.door.hosts

    @allowed_hosts.setter
    def allowed_hosts(self, hosts: frozenset[str] | None) -> None:
        self.door.hosts = hosts

    # -- routing ---------------------------------------------------------------------------
    def match(self, path: str) -> tuple[Route, dict[str, str]]:
        """The route for an absolute path under '/' (the fast front's matcher)."""
        route = _EXACT.get(path)
        if route is not None:
            return route, {}
        hit = _MATCHED.get(path)
        if hit is not None:
            return hit[0], dict(hit[1])
        found: tuple[Route, dict[str, str]] = (NOT_FOUND, {})
        for regex, route in _COMPILED:
            m = regex.fullmatch(path)
            if m is not None:
                found = route, {k: v for k, v in m.groupdict().items() if v is not None}
                break
        # A client repeats its few paths: the regexes run once per path. Bounded, since
        # paths come from clients.
        if len(_MATCHED) >= 1024:
            _MATCHED.clear()
        _MATCHED[path] = found[0], dict(found[1])
        return found

    # -- admission ---------------------------------------------------------------------------
    def admit(self, route: Route, method: str, headers: Mapping[str, str],
              content_length: int | None, context: Any = None) -> BodyTicket:
        """The admission's decision on a head of ``route`` (``Admission.admit``): the ticket
        the body is received under (release it when done), or the refusal raised. A credential
        only its issuer can judge is asked while the body arrives; ``handle`` waits for the
        answer before anything else (``ticket.pending``)."""
        return self.admission.admit(self.door, route.api_group, method, headers,
                                    content_length, op=route.name, context=context)

    # -- one request ---------------------------------------------------------------------------
    async def handle(self, route: Route, call: Call) -> Reply:
        """The Reply for ``call``; never raises (except CancelledError when the skin cancels
        a request whose client went away)."""
        try:
            ticket = call.ticket
            if ticket is None:
                call.ticket = self.admit(route, call.method, call.headers, _body_size(call.body),
                                         call.context)
            elif ticket.held < (size := _body_size(call.body)):      # admitted before its body
                ticket.receive(size - ticket.held)
            if call.ticket.pending is not None:
                await call.ticket.pending
            op = route.methods.get(call.method) or (
                route.methods.get("GET") if call.method == "HEAD" else None)
            if op is None:
                return error_reply("Method Not Allowed", 405)
            return await op(self, call)
        except TritonError as err:
            log.debug("%s %s -> %d %s", call.method, call.path, err.status, err)
            return error_reply(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:        # a bug: say which, never a traceback to the client
            log.error("unhandled error in %s %s", call.method, call.path, exc_info=True)
            return error_reply(f"internal error: {type(err).__name__}", 500)
        finally:
            if call.ticket is not None:
                call.ticket.release()

    def reaches(self, call: Call, group: str) -> bool:
        """Whether ``call``'s caller may use API ``group`` too (what an answer shows beyond
        the route's own group: statistics show the lifecycle history to those who may load)."""
        return self.admission.reaches(self.door, call.ticket, group, call.headers)

    def refuse(self, err: Exception) -> Reply:
        """The Reply for an error a skin met outside ``handle`` (admission, body)."""
        if isinstance(err, TritonError):
            return error_reply(err)
        log.error("unhandled error while receiving a request", exc_info=err)
        return error_reply(f"internal error: {type(err).__name__}", 500)

    # -- codec helpers -----------------------------------------------------------------------------
    async def offload(self, large: bool, fn: Callable[..., Any], *args: Any) -> Any:
        if not large:
            return fn(*args)
        if self._codec_pool is None:
            self._codec_pool = ThreadPoolExecutor(2, thread_name_prefix="triton-codec")
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, fn, *args)

    def close(self) -> None:
        if self._codec_pool is not None:
            self._codec_pool.shutdown(wait=False)

    async def body(self, call: Call) -> bytes:
        """The request body, joined and decompressed (off the loop when large)."""
        size = _body_size(call.body)
        encoding = (call.header("content-encoding") or "").lower()
        if encoding in ("", "identity"):
            if isinstance(call.body, bytes):
                return call.body
            return await self.offload(size > OFFLOAD_BYTES, b"".join, call.body)
        if encoding not in ("gzip", "deflate"):
            raise InvalidArgument(f"unsupported Content-Encoding '{encoding}'")
        return await self.offload(size > OFFLOAD_BYTES // 8, _inflate, call.body, encoding,
                                  self.max_input_size)

    async def json_body(self, call: Call) -> dict:
        raw = await self.body(call)
        if not raw:
            return {}
        body = await self.offload(len(raw) > OFFLOAD_BYTES, _loads, raw)
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return body


def _body_size(body: bytes | list[bytes]) -> int:
    return len(body) if isinstance(body, bytes) else sum(map(len, body))


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise InvalidArgument(f"failed to parse the request JSON buffer: {err}") from None


def _inflate(body: bytes | list[bytes], encoding: str, limit: int) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    data = body if isinstance(body, bytes) else b"".join(body)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as err:
        raise InvalidArgument(f"failed to decompress the request body: {err}") from None
    if len(out) > limit:
        raise InvalidArgument("decompressed request body exceeds the maximum input size")
    return out


# -- the operations ---------------------------------------------------------------------------

def _version(call: Call) -> str:
    return call.params.get("version") or ""


# Triton's status codes (200, or 400 for "no"), which tritonclient and perf_analyzer read, with
# the Open Inference Protocol's bodies, which KServe's own clients parse.
def _health(key: str, yes: bool, **more: str) -> Reply:
    return json_reply({**more, key: yes}, 200 if yes else 400)


async def health_live(plane: DataPlane, call: Call) -> Reply:
    return _health("live", operations.server_live(plane.engine))


# tritonserver while it exits (here: the drain window of a graceful stop) answers readiness with
# 503 and its words; a load balancer or a Kubernetes probe stops sending.
def _exiting(**more: str) -> Reply:
    return json_reply({**more, "ready": False, "error": "Server exiting"}, 503)


async def health_ready(plane: DataPlane, call: Call) -> Reply:
    if operations.exiting(plane.engine):
        return _exiting()
    return _health("ready", operations.server_ready(plane.engine))


async def server_metadata(plane: DataPlane, call: Call) -> Reply:
    return json_reply(operations.server_metadata(plane.engine))


async def model_metadata(plane: DataPlane, call: Call) -> Reply:
    return json_reply(operations.model_metadata(plane.engine, call.params["model"], _version(call)))


async def model_ready(plane: DataPlane, call: Call) -> Reply:
    name = call.params["model"]
    if operations.exiting(plane.engine):
        return _exiting(name=name)
    return _health("ready", operations.model_ready(plane.engine, name, _version(call)), name=name)


async def model_config(plane: DataPlane, call: Call) -> Reply:
    return json_reply(config_to_json(operations.model_config(plane.engine, call.params["model"],
                                                             _version(call))))


async def model_stats(plane: DataPlane, call: Call) -> Reply:
    # the lifecycle history carries earlier configs and golden-set differences: only for a
    # caller who may load models (an inference key reaches statistics, not that)
    return json_reply(operations.statistics(plane.engine, call.params.get("model", ""),
                                            _version(call),
                                            history=plane.reaches(call, MODEL_REPOSITORY)))


async def repository_index(plane: DataPlane, call: Call) -> Reply:
    body = await plane.json_body(call)
    return json_reply(operations.repository_index(plane.engine, body.get("ready", False)))


_B64_SLICE = 4 << 20        # characters of base64 decoded per call (a multiple of 4)
# How JSON's types are named in the repository operations' refusals
PARAMETER_WORDS = operations.ParameterWords(
    config="load parameter 'config' must be a JSON string",
    file="load parameter '{key}' must be base64 text",
    flag="unload parameter '{key}' must be a boolean")


def _load_files(params: dict) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for key, value in params.items():
        if key.startswith("file:"):
            if not isinstance(value, str):
                raise InvalidArgument(f"load parameter '{key}' must be base64 text")
            try:
                # In slices: one b64decode of a large file would hold the GIL throughout.
                files[key] = b"".join(base64.b64decode(value[i:i + _B64_SLICE], validate=True)
                                      for i in range(0, len(value), _B64_SLICE))
            except (binascii.Error, ValueError):
                raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None
    return files


async def _repository_parameters(plane: DataPlane, call: Call) -> dict:
    params = (await plane.json_body(call)).get("parameters", {}) or {}
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    return params


async def repository_load(plane: DataPlane, call: Call) -> Reply:
    params = await _repository_parameters(plane, call)
    if isinstance(params.get("config"), dict):      # JSON's own object, sent as it is
        params["config"] = json.dumps(params["config"])
    files = await plane.offload(_body_size(call.body) > OFFLOAD_BYTES, _load_files, params)
    await operations.load(plane.engine, call.params["model"], {**params, **files},
                          PARAMETER_WORDS)
    return Reply(200)


async def repository_unload(plane: DataPlane, call: Call) -> Reply:
    params = await _repository_parameters(plane, call)
    await operations.unload(plane.engine, call.params["model"], params, PARAMETER_WORDS)
    return Reply(200)


async def model_infer(plane: DataPlane, call: Call) -> Reply:
    """The data path's front door: decode, run, encode."""
    headers = call.headers
    body = call.body
    if type(body) is not bytes or headers.get("content-encoding"):
        body = await plane.body(call)
    model, version = call.params["model"], _version(call)
    header = headers.get("inference-header-content-length")
    large = len(body) > OFFLOAD_BYTES
    # (small bodies, the common case, are decoded and encoded here: no coroutine of offload's)
    if header is None:
        request = (await plane.offload(True, decode_infer_request, body, None, model, version)
                   if large else decode_infer_request(body, None, model, version))
    else:
        if not header.strip().isdigit():
            raise InvalidArgument("Inference-Header-Content-Length must be a non-negative integer")
        length = int(header)
        if length == 0:
            name, datatype, dims = plane.engine.raw_input(model, version)
            request = await plane.offload(large, decode_raw_infer_request, body, model, version,
                                          name, datatype, dims)
        elif large:
            request = await plane.offload(True, decode_infer_request, body, length, model, version)
        else:
            request = decode_infer_request(body, length, model, version)
    if call.ticket is not None:
        call.ticket.release()           # decoded: its bytes no longer count as in flight
    if plane.engine.tracing.on:         # engine/observation/trace.py: a client's W3C trace context
        request.trace_context = trace_context(headers)
    try:
        response = await plane.engine.infer(request)
    except DecoupledRefused as err:
        raise operations.decoupled_unsupported(err, "HTTP end point") from None
    if _output_bytes(response) > OFFLOAD_BYTES:
        payload, json_length = await plane.offload(True, encode_infer_response, response, request)
    else:
        payload, json_length = encode_infer_response(response, request)
    if json_length is None:
        return Reply(200, payload, {"Content-Type": JSON})
    return Reply(200, payload, {"Content-Type": OCTET,
                                "Inference-Header-Content-Length": str(json_length)})


def _output_bytes(response: InferResponse) -> int:
    # BYTES outputs are object arrays (8 bytes a pointer): count them as 16 bytes an element.
    # (A loop, not sum() over a generator: asked of every response.)
    total = 0
    for t in response.outputs:
        data = t.data
        if data is not None:
            total += data.nbytes if data.dtype.kind != "O" else 16 * data.size
    return total


# Events as they come: not cached, and not held back by a buffering proxy (nginx in front of
# a JupyterHub reads X-Accel-Buffering).
SSE_HEADERS = {"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def _generate_request(plane: DataPlane, call: Call) -> tuple[Any, bool]:
    model, version = call.params["model"], _version(call)
    config = plane.engine.model_config(model, version)
    request = generate_request(config, model, version, await plane.json_body(call))
    if plane.engine.tracing.on:         # engine/observation/trace.py: a client's W3C trace context
        request.trace_context = trace_context(call.headers)
    return request, config.max_batch_size > 0


async def model_generate(plane: DataPlane, call: Call) -> Reply:
    """Triton's generate extension: one JSON object in, the model's one response out (a
    decoupled model that sends none or more is told to use generate_stream)."""
    request, batched = await _generate_request(plane, call)
    responses = plane.engine.infer_stream(request)
    found: InferResponse | None = None
    try:
        async for response in responses:
            if response.error is not None:
                raise response.error if isinstance(response.error, TritonError) else \
                    Internal(f"model '{request.model_name}' failed: {response.error}")
            if is_empty_final(response):
                continue
            if found is not None:
                break
            found = response
        else:
            if found is not None:
                return json_reply(generate_response(found, batched))
    finally:
        await close_stream(responses)
    # Triton's words (it sends them with status 200; a client error is a 400 here)
    raise InvalidArgument(
        f"generate expects model to produce exactly 1 response, use generate stream for model "
        f"that generates various number of responses (model '{request.model_name}')")


async def model_generate_stream(plane: DataPlane, call: Call) -> Reply:
    """Triton's generate_stream: server-sent events, one per response. A request refused
    before inference begins is a JSON error with its status, as any other route's."""
    request, batched = await _generate_request(plane, call)
    responses = plane.engine.infer_stream(request)
    first = await first_response(responses)
    return Reply(200, headers=SSE_HEADERS,
                 stream=generate_events(first, responses, batched))


async def model_logs_route(plane: DataPlane, call: Call) -> Reply:
    """What a model said (``pb_utils.Logger`` lines, its worker's stdout/stderr), oldest
    first, from the engine's bounded buffer (jupyter_triton/model_logs.py); the lines outlive
    an unload, so a model the repository still has is found unloaded too."""
    model, version = call.params["model"], _version(call)
    lines = plane.engine.model_logs.lines(model, version)
    if not lines and model not in {m["name"] for m in plane.engine.repository_index()}:
        raise NotFound(f"Request for unknown model: '{model}' is not found")
    return json_reply({"name": model, "version": version, "lines": lines})


async def model_traffic(plane: DataPlane, call: Call) -> Reply:
    """A model's captured requests (GET) and its capture's switch (POST: engine/observation/capture.py's
    ``TrafficCapture.control``); a name that is not a model: 404, nothing kept."""
    model = call.params["model"]
    if call.method == "POST":
        return json_reply(plane.engine.traffic.control(model, await plane.json_body(call)))
    state, rows = plane.engine.traffic.read(model)
    body = await plane.offload(len(rows) > 16, traffic_json, state, rows)
    return Reply(200, body, {"Content-Type": JSON})


async def model_shadow(plane: DataPlane, call: Call) -> Reply:
    """A model's shadow of a staged version (engine/observation/shadow.py): GET its report,
    POST ``{"version": v, "fraction": f}`` to start it or ``{"version": null}`` to stop."""
    model = call.params["model"]
    traffic = plane.engine.traffic
    if call.method == "POST":
        return json_reply(traffic.shadow_control(plane.engine, model, await plane.json_body(call)))
    return json_reply(traffic.shadow_report(model))


async def model_lineage(plane: DataPlane, call: Call) -> Reply:
    """What a notebook served a version from (repository/lineage.py): the version named, else
    the newest on disk; ``"lineage": null`` for a version served without one. User data: the
    model-repository group's, as the traffic is."""
    model, version = call.params["model"], _version(call)
    record, version = await plane.offload(True, _read_lineage, plane.engine.repository, model,
                                          version)
    return json_reply({"name": model, "version": str(version), "lineage": record})


def _read_lineage(repository: Any, model: str, version: str) -> tuple[dict | None, int]:
    number = int(version) if version else max(repository.versions_on_disk(model), default=0)
    if not number:
        raise NotFound(f"model '{model}' has no version in the model repository")
    return read_lineage(repository.version_dir(model, number)), number


async def openai_models(plane: DataPlane, call: Call) -> Reply:
    try:
        if "model" in call.params:
            return json_reply(openai.model_card(plane.engine, call.params["model"]))
        return json_reply(openai.model_list(plane.engine))
    except TritonError as err:
        return json_reply(openai.error_body(err), err.status)


async def openai_completions(plane: DataPlane, call: Call) -> Reply:
    return await _openai(plane, call, chat=False)


async def openai_chat_completions(plane: DataPlane, call: Call) -> Reply:
    return await _openai(plane, call, chat=True)


async def openai_embeddings_route(plane: DataPlane, call: Call) -> Reply:
    """OpenAI's embeddings over a text-in, vector-out model (frontends/openai_embeddings.py)."""
    try:
        job = await openai_embeddings.prepare(plane.engine, await plane.json_body(call))
        return json_reply(await openai_embeddings.embed(plane.engine, job))
    except TritonError as err:
        return json_reply(openai.error_body(err), err.status)


async def _openai(plane: DataPlane, call: Call, chat: bool) -> Reply:
    """OpenAI's completions over the engine (frontends/openai.py maps both ways); its
    errors in OpenAI's shape."""
    try:
        job = await openai.prepare(plane.engine, await plane.json_body(call), chat)
        responses = plane.engine.infer_stream(job.request)
        if not job.stream:
            return json_reply(await openai.complete(job, responses))
        first = await first_response(responses)
        return Reply(200, headers=SSE_HEADERS,
                     stream=openai.events(job, first, responses))
    except TritonError as err:
        return json_reply(openai.error_body(err), err.status)


async def shm_status(plane: DataPlane, call: Call) -> Reply:
    return json_reply(operations.shm_status(plane.engine, call.params.get("region", "")))


async def shm_register(plane: DataPlane, call: Call) -> Reply:
    body = await plane.json_body(call)
    operations.shm_register(plane.engine, call.params["region"], body.get("key"),
                            body.get("offset", 0), body.get("byte_size"))
    return Reply(200)


async def shm_unregister(plane: DataPlane, call: Call) -> Reply:
    operations.shm_unregister(plane.engine, call.params.get("region", ""))
    return Reply(200)


async def cuda_shm_status(plane: DataPlane, call: Call) -> Reply:
    return json_reply(operations.cuda_shm_status(plane.engine, call.params.get("region", "")))


async def cuda_shm_register(plane: DataPlane, call: Call) -> Reply:
    await plane.json_body(call)
    operations.cuda_shm_register(plane.engine, call.params["region"])
    return Reply(200)


async def cuda_shm_unregister(plane: DataPlane, call: Call) -> Reply:
    operations.cuda_shm_unregister(plane.engine, call.params.get("region", ""))
    return Reply(200)


async def trace_setting(plane: DataPlane, call: Call) -> Reply:
    updates = await plane.json_body(call) if call.method == "POST" else None
    return json_reply(operations.trace_setting(plane.engine, call.params.get("model", ""), updates))


async def log_settings(plane: DataPlane, call: Call) -> Reply:
    updates = await plane.json_body(call) if call.method == "POST" else None
    return json_reply(operations.log_settings(plane.engine, updates))


async def unknown_route(plane: DataPlane, call: Call) -> Reply:
    raise NotFound(f"unknown route: {call.method} {call.path}")


# -- the route table --------------------------------------------------------------------------

_MODEL = r"(?P<model>[^/]+)"
_VERSION = r"(?:/versions/(?P<version>[0-9]+))?"
_REGION = r"(?:/region/(?P<region>[^/]+))?"
_REGION1 = r"/region/(?P<region>[^/]+)"
INFER, ADMIN = "infer", "admin"

ROUTES: list[Route] = [
    Route(r"v2/health/live", "HealthLive", HEALTH, {"GET": health_live}),
    Route(r"v2/health/ready", "HealthReady", HEALTH, {"GET": health_ready}),
    Route(r"v2/?", "ServerMetadata", METADATA, {"GET": server_metadata}),
    Route(r"v2/models/stats", "ModelStats", STATISTICS, {"GET": model_stats}, ADMIN),
    Route(rf"v2/models/{_MODEL}{_VERSION}/stats", "ModelStats", STATISTICS, {"GET": model_stats}, ADMIN),
    Route(rf"v2/models/{_MODEL}{_VERSION}/ready", "ModelReady", HEALTH, {"GET": model_ready}),
    Route(rf"v2/models/{_MODEL}{_VERSION}/config", "ModelConfig", MODEL_CONFIG, {"GET": model_config}),
    Route(rf"v2/models/{_MODEL}{_VERSION}/infer", "ModelInfer", INFERENCE, {"POST": model_infer},
          streams_body=True),
    Route(rf"v2/models/{_MODEL}{_VERSION}/generate", "ModelGenerate", INFERENCE,
          {"POST": model_generate}, streams_body=True),
    Route(rf"v2/models/{_MODEL}{_VERSION}/generate_stream", "ModelGenerateStream", INFERENCE,
          {"POST": model_generate_stream}, streams_body=True),
    Route(rf"v2/models/{_MODEL}{_VERSION}/logs", "ModelLogs", LOGGING, {"GET": model_logs_route},
          ADMIN),
    Route(rf"v2/models/{_MODEL}/traffic", "ModelTraffic", MODEL_REPOSITORY,
          {"GET": model_traffic, "POST": model_traffic}, ADMIN),
    Route(rf"v2/models/{_MODEL}/shadow", "ModelShadow", MODEL_REPOSITORY,
          {"GET": model_shadow, "POST": model_shadow}, ADMIN),
    Route(rf"v2/models/{_MODEL}{_VERSION}/lineage", "ModelLineage", MODEL_REPOSITORY,
          {"GET": model_lineage}, ADMIN),
    Route(rf"v2/models/{_MODEL}{_VERSION}/?", "ModelMetadata", METADATA, {"GET": model_metadata}),
    Route(r"v2/repository/index", "RepositoryIndex", MODEL_REPOSITORY, {"POST": repository_index}, ADMIN),
    Route(rf"v2/repository/models/{_MODEL}/load", "RepositoryLoad", MODEL_REPOSITORY,
          {"POST": repository_load}, ADMIN),
    Route(rf"v2/repository/models/{_MODEL}/unload", "RepositoryUnload", MODEL_REPOSITORY,
          {"POST": repository_unload}, ADMIN),
    Route(rf"v2/systemsharedmemory{_REGION}/status", "SystemSharedMemoryStatus", SHARED_MEMORY,
          {"GET": shm_status}),
    Route(rf"v2/systemsharedmemory{_REGION1}/register", "SystemSharedMemoryRegister", SHARED_MEMORY,
          {"POST": shm_register}),
    Route(rf"v2/systemsharedmemory{_REGION}/unregister", "SystemSharedMemoryUnregister",
          SHARED_MEMORY, {"POST": shm_unregister}),
    Route(rf"v2/cudasharedmemory{_REGION}/status", "CudaSharedMemoryStatus", SHARED_MEMORY,
          {"GET": cuda_shm_status}),
    Route(rf"v2/cudasharedmemory{_REGION1}/register", "CudaSharedMemoryRegister", SHARED_MEMORY,
          {"POST": cuda_shm_register}),
    Route(rf"v2/cudasharedmemory{_REGION}/unregister", "CudaSharedMemoryUnregister", SHARED_MEMORY,
          {"POST": cuda_shm_unregister}),
    # OpenAI's routes, under the same base as v2/ (frontends/openai.py)
    Route(r"v1/models", "OpenAIModels", METADATA, {"GET": openai_models}),
    Route(rf"v1/models/{_MODEL}", "OpenAIModel", METADATA, {"GET": openai_models}),
    Route(r"v1/completions", "OpenAICompletions", INFERENCE, {"POST": openai_completions},
          streams_body=True),
    Route(r"v1/chat/completions", "OpenAIChatCompletions", INFERENCE,
          {"POST": openai_chat_completions}, streams_body=True),
    Route(r"v1/embeddings", "OpenAIEmbeddings", INFERENCE, {"POST": openai_embeddings_route},
          streams_body=True),
    Route(r"v2/trace/setting", "TraceSetting", TRACE, {"GET": trace_setting, "POST": trace_setting},
          ADMIN),
    Route(rf"v2/models/{_MODEL}/trace/setting", "ModelTraceSetting", TRACE,
          {"GET": trace_setting, "POST": trace_setting}, ADMIN),
    Route(r"v2/logging", "LogSettings", LOGGING, {"GET": log_settings, "POST": log_settings}, ADMIN),
    Route(r"v2/.*", "NotFoundRoute", HEALTH, {m: unknown_route for m in ("GET", "POST", "PUT", "DELETE")}),
]
NOT_FOUND = ROUTES[-1]

# The fast front's matcher: static paths by dict, the rest by regex in table order.
_EXACT = {"/" + r.pattern: r for r in ROUTES if not any(c in r.pattern for c in "()?*+[\\.")}
_EXACT.update({"/v2": ROUTES[2], "/v2/": ROUTES[2]})
_COMPILED = [(re.compile("/" + r.pattern), r) for r in ROUTES]
_MATCHED: dict[str, tuple[Route, dict[str, str]]] = {}
