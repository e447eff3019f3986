"""Triton's trace extension: which requests are traced (trace settings, global and per
model), what a trace records (timestamps, tensors) and where it goes (Triton's JSON trace
file, OpenTelemetry spans).

The data path pays one attribute check while tracing is off: ``Engine.infer`` asks
``tracing.on`` and only then hands the request here. A request that is traced carries its
``Trace`` as ``request.trace``; the instance pool stamps the compute timestamps on it.
Ensemble steps find their parent's trace in a context variable (each step runs in a task
started inside the parent's request), so they become its children (``parent_id``).

Settings follow tritonserver: ``--trace-config level=TIMESTAMPS``, ``rate=N`` (every N-th
request), ``count=N`` (how many more; -1 without end), ``mode=triton|opentelemetry``,
``triton,file=PATH``, ``triton,log-frequency=N``. Over the protocol every setting but the
file and the mode may change; a model's own settings override the global ones field by
field, and clearing one (``null``) falls back to the global value (for a global one: the
startup value).
"""
from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Mapping

from ...protocol.errors import InvalidArgument, Unsupported

if TYPE_CHECKING:
    from ...protocol.types import InferRequest, InferResponse

log = logging.getLogger(__name__)

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
SETTINGS = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency",
            "trace_mode")
# Traces kept in memory for ``Tracing.recent()`` (the notebook's view; no file needed), and
# the bytes of tensor data they may hold together (TENSORS level) before the oldest go.
RECENT_TRACES = 1000
RECENT_TENSOR_BYTES = 64 << 20
# A tensor's data is written up to this many elements (a huge output must not make the
# trace file the server's largest allocation).
TENSOR_ELEMENTS = 65536

_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("jupyter_triton_trace", default=None)


class _Untraced:
    """The mark of a request that was not sampled: its steps are not traced either, and
    the instance pool's stamps do nothing."""
    __slots__ = ()

    def compute_start(self, queue_ns: int, start_ns: int, batch_size: int = 0) -> None:
        pass

    def compute_end(self, timing: tuple[int, int, int] | None) -> None:
        pass


UNTRACED = _Untraced()


@dataclass
class TraceSettings:
    """One scope's settings in Triton's units (level as a list of names)."""
    trace_level: tuple[str, ...] = ("OFF",)
    trace_rate: int = 1000
    trace_count: int = -1
    log_frequency: int = 0
    trace_file: str = ""
    trace_mode: str = "triton"

    @property
    def enabled(self) -> bool:
        return any(level != "OFF" for level in self.trace_level)

    @property
    def tensors(self) -> bool:
        return "TENSORS" in self.trace_level


def parse_trace_config(items: Iterable[str]) -> dict[str, Any]:
    """tritonserver's ``--trace-config [<mode>,]<setting>=<value>`` values as settings."""
    out: dict[str, Any] = {}
    levels: list[str] = []
    names = {"level": "trace_level", "rate": "trace_rate", "count": "trace_count",
             "mode": "trace_mode", "file": "trace_file", "log-frequency": "log_frequency",
             "log_frequency": "log_frequency"}
    for item in items:
        mode, _, rest = item.partition(",") if "," in item else ("", "", item)
        key, sep, value = rest.partition("=")
        if not sep:
            raise InvalidArgument(f"--trace-config expects [<mode>,]<setting>=<value>, got '{item}'")
        if mode and mode not in MODES:
            raise InvalidArgument(f"--trace-config: unknown trace mode '{mode}' in '{item}'")
        if mode == "opentelemetry":
            out.setdefault("opentelemetry", {})[key] = value
            continue
        name = names.get(key)
        if name is None:
            raise InvalidArgument(f"--trace-config: unknown setting '{key}' in '{item}'")
        if name == "trace_level":
            levels.append(value.upper())
        else:
            out[name] = value
    if levels:
        out["trace_level"] = levels
    return out


def _check(name: str, value: Any) -> Any:
    """A setting value from a client or a flag, in our units; InvalidArgument otherwise."""
    if name == "trace_level":
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, (list, tuple)) or not values or \
                not all(isinstance(v, str) for v in values):
            raise InvalidArgument("trace setting 'trace_level' must be a list of strings")
        levels = tuple(v.upper() for v in values)
        bad = [v for v in levels if v not in LEVELS]
        if bad:
            raise InvalidArgument(f"unknown trace level '{bad[0]}' (expected one of {', '.join(LEVELS)})")
        if "OFF" in levels and len(levels) > 1:
            raise InvalidArgument("trace level 'OFF' cannot be combined with other levels")
        return levels
    if name in ("trace_rate", "trace_count", "log_frequency"):
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidArgument(f"trace setting '{name}' must be an integer string")
        try:
            number = int(value)
        except ValueError:
            raise InvalidArgument(f"trace setting '{name}' must be an integer, got '{value}'") from None
        # rate 0: only requests that carry a client's trace context (opentelemetry mode)
        lowest = {"trace_rate": 0, "trace_count": -1, "log_frequency": 0}[name]
        if number < lowest:
            raise InvalidArgument(f"trace setting '{name}' must be {lowest} or more, got {number}")
        return number
    if name in ("trace_file", "trace_mode"):
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, str):
            raise InvalidArgument(f"trace setting '{name}' must be a string")
        if name == "trace_mode" and value not in MODES:
            raise InvalidArgument(f"unknown trace mode '{value}' (expected triton or opentelemetry)")
        return value
    raise InvalidArgument(f"unknown trace setting '{name}'")


class _Scope:
    """One set of effective settings and its sampler: which of its requests are traced."""

    def __init__(self, settings: TraceSettings) -> None:
        self.settings = settings
        self.remaining = settings.trace_count
        self.seen = 0

    def sample(self) -> bool:
        if not self.settings.enabled or self.remaining == 0 or not self.settings.trace_rate:
            return False
        self.seen += 1
        if self.seen % self.settings.trace_rate:
            return False
        if self.remaining > 0:
            self.remaining -= 1
        return True


class Trace:
    """One traced request; ``entries()`` are its objects of Triton's trace file."""

    __slots__ = ("id", "parent_id", "model_name", "model_version", "request_id", "tensors",
                 "stamps", "activities", "tracing", "scope", "span", "batch_size", "_waiting")

    def __init__(self, tracing: "Tracing", request: "InferRequest", scope: _Scope,
                 parent: "Trace | None") -> None:
        self.tracing = tracing
        self.scope = scope
        self.id = next(tracing._ids)
        self.parent_id = parent.id if parent is not None else 0
        self.model_name = request.model_name
        self.model_version = request.model_version
        self.request_id = request.id
        self.tensors = scope.settings.tensors
        self.stamps: list[tuple[str, int]] = [("REQUEST_START", time.monotonic_ns())]
        self.activities: list[dict] = []
        self.span: Any = None
        self.batch_size = 0
        # a stream's last response may come before the instance reports the execution's
        # end: then the trace completes at compute_end (the error it ended with, if any)
        self._waiting: tuple[BaseException | None] | None = None
        if self.tensors:
            for tensor in request.inputs:
                self._tensor("TENSOR_QUEUE_INPUT", tensor)

    # -- stamps from the instance pool (on the event loop) -------------------------------
    def compute_start(self, queue_ns: int, start_ns: int, batch_size: int = 0) -> None:
        self.batch_size = batch_size
        self.stamps.append(("QUEUE_START", queue_ns))
        self.stamps.append(("COMPUTE_START", start_ns))

    def compute_end(self, timing: tuple[int, int, int] | None) -> None:
        end = time.monotonic_ns()
        start = next((ns for name, ns in self.stamps if name == "COMPUTE_START"), end)
        compute_input, _, compute_output = timing if timing is not None else (0, 0, 0)
        # Our backends copy tensors inside execute: input end and output start come from
        # the compute_input/output durations the pool measured (zero when not measured).
        self.stamps.append(("COMPUTE_INPUT_END", start + compute_input))
        self.stamps.append(("COMPUTE_OUTPUT_START", end - compute_output))
        self.stamps.append(("COMPUTE_END", end))
        if self._waiting is not None:
            error, = self._waiting
            self._waiting = None
            self.tracing._complete(self, error)

    def response(self, response: "InferResponse") -> None:
        """One response of a stream (a decoupled model sends any number)."""
        self.stamps.append(("INFER_RESPONSE_COMPLETE", time.monotonic_ns()))
        self.model_version = response.model_version or self.model_version
        if self.tensors:
            for tensor in response.outputs:
                self._tensor("TENSOR_BACKEND_OUTPUT", tensor)

    def finish(self, response: "InferResponse | None", error: BaseException | None) -> None:
        self.stamps.append(("REQUEST_END", time.monotonic_ns()))
        if response is not None:
            self.model_version = response.model_version or self.model_version
            if self.tensors:
                for tensor in response.outputs:
                    self._tensor("TENSOR_BACKEND_OUTPUT", tensor)
        names = {name for name, _ in self.stamps}
        if "COMPUTE_START" in names and "COMPUTE_END" not in names:
            self._waiting = (error,)
            return
        self.tracing._complete(self, error)

    def _tensor(self, activity: str, tensor: Any) -> None:
        if tensor.data is None:          # in a shared memory region
            return
        flat = tensor.data.reshape(-1)[:TENSOR_ELEMENTS]
        if tensor.data.dtype.kind == "O":
            values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
        else:
            values = [str(v) for v in flat.tolist()]
        self.activities.append({"id": self.id, "activity": activity, "tensor": {
            "name": tensor.name, "data": ",".join(values),
            "shape": ",".join(str(d) for d in tensor.data.shape), "dtype": tensor.datatype}})

    def entries(self) -> list[dict]:
        head: dict[str, Any] = {"id": self.id, "model_name": self.model_name,
                                "model_version": _version_number(self.model_version)}
        if self.request_id:
            head["request_id"] = self.request_id
        if self.parent_id:
            head["parent_id"] = self.parent_id
        out = [head]
        # in time order (a stream's responses and its execution's end interleave)
        stamps = sorted(self.stamps, key=lambda stamp: stamp[1])
        out += [{"id": self.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in stamps]
        return out + self.activities


def _version_number(version: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        return -1


class _TraceFile:
    """Triton's trace file: with log_frequency 0 one JSON array in ``path``, written as
    traces complete and closed (``]``) at shutdown; with N > 0 every N traces a complete
    array in ``path.<i>``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = 0
        self.batch: list[dict] = []
        self._stream: Any = None
        self._lock = threading.Lock()

    def add(self, entries: list[dict], log_frequency: int, traces_in_batch: int) -> None:
        with self._lock:
            if log_frequency > 0:
                self.batch.extend(entries)
                if traces_in_batch >= log_frequency:
                    self._write_batch()
                return
            if self._stream is None:
                self._stream = open(self.path, "w", encoding="utf-8")
                self._stream.write("[\n")
                first = True
            else:
                first = False
            text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in entries)
            self._stream.write(("" if first else ",\n") + text)
            self._stream.flush()

    def _write_batch(self) -> None:
        with open(f"{self.path}.{self.index}", "w", encoding="utf-8") as f:
            json.dump(self.batch, f, separators=(",", ":"))
        self.index += 1
        self.batch = []

    def close(self) -> None:
        with self._lock:
            if self.batch:
                self._write_batch()
            if self._stream is not None:
                self._stream.write("\n]\n")
                self._stream.close()
                self._stream = None


class Tracing:
    """The server's trace settings and the traces they select; one per engine."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        self.otel_config: dict[str, str] = config.pop("opentelemetry", {})
        self._startup = TraceSettings(**{k: _check(k, v) for k, v in config.items()})
        self._global: dict[str, Any] = {}          # set over the protocol
        self._models: dict[str, dict[str, Any]] = {}
        self._scopes: dict[str, _Scope] = {}
        self._global_scope = _Scope(self._startup)
        self._ids = itertools.count(1)
        self._recent: deque[tuple[list[dict], int]] = deque()
        self._recent_bytes = 0
        self._file: _TraceFile | None = None
        self._in_batch = 0
        self.otel: Any = None        # engine/observation/otel.py's OpenTelemetry, in that mode
        self.on = False             # the data path's one check
        self._rebuild()

    # -- settings ------------------------------------------------------------------------
    def settings(self, model: str = "") -> dict[str, Any]:
        """The effective settings of ``model`` (or the global ones) in Triton's JSON shape:
        every value a string, trace_level a list."""
        scope = self._scopes.get(model, self._global_scope) if model else self._global_scope
        s = scope.settings
        return {"trace_level": list(s.trace_level), "trace_rate": str(s.trace_rate),
                "trace_count": str(scope.remaining), "log_frequency": str(s.log_frequency),
                "trace_file": s.trace_file, "trace_mode": s.trace_mode}

    def update(self, model: str, updates: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a client's settings (``None`` clears one) to ``model`` or, with "", globally;
        the whole update is checked before any of it applies."""
        checked: dict[str, Any] = {}
        for name, value in updates.items():
            if name == "trace_file":
                raise Unsupported("trace file location can not be updated through network protocol")
            if name == "trace_mode":
                raise Unsupported("trace mode can not be updated through network protocol")
            if name not in SETTINGS:
                raise InvalidArgument(f"unknown trace setting '{name}'")
            checked[name] = None if value is None or value == [] else _check(name, value)
        target = self._models.setdefault(model, {}) if model else self._global
        for name, value in checked.items():
            if value is None:
                target.pop(name, None)
            else:
                target[name] = value
        if model and not target:
            del self._models[model]
        self._rebuild(changed=model or None, names=set(checked))
        return self.settings(model)

    def _rebuild(self, changed: str | None = None, names: set[str] = frozenset()) -> None:
        base = {**self._startup.__dict__, **self._global}
        count_changed = "trace_count" in names or "trace_rate" in names
        settings = TraceSettings(**base)
        if changed is None and (count_changed or self._global_scope.settings != settings):
            keep = self._global_scope
            self._global_scope = _Scope(settings)
            if not count_changed:
                self._global_scope.remaining, self._global_scope.seen = keep.remaining, keep.seen
        scopes: dict[str, _Scope] = {}
        for model, own in self._models.items():
            model_settings = TraceSettings(**{**base, **own})
            old = self._scopes.get(model)
            scope = _Scope(model_settings)
            if old is not None and not (count_changed and changed in (None, model)):
                scope.remaining, scope.seen = old.remaining, old.seen
            scopes[model] = scope
        self._scopes = scopes
        self.on = self._global_scope.settings.enabled or any(
            s.settings.enabled for s in scopes.values())
        file = self._global_scope.settings.trace_file
        if file and (self._file is None or self._file.path != file):
            if self._file is not None:
                self._file.close()
            self._file = _TraceFile(file)
        mode = self._global_scope.settings.trace_mode
        if mode == "opentelemetry" and self.otel is None:
            from .otel import OpenTelemetry
            self.otel = OpenTelemetry(self.otel_config)

    # -- the data path (tracing on) ------------------------------------------------------
    async def infer(self, engine: Any, request: "InferRequest") -> "InferResponse":
        """``engine.infer(request)`` with ``request`` traced if it is sampled (or if it is a
        step of a traced request)."""
        parent = _CURRENT.get()
        if parent is None:                  # a BLS call: its caller's trace (bls_parent)
            parent = getattr(request, "trace_parent", None)
        if parent is UNTRACED:
            request.trace = UNTRACED
            return await engine.infer(request)
        scope = self._scopes.get(request.model_name, self._global_scope)
        if parent is None and not self._sampled(scope, request):
            request.trace = UNTRACED
            token = _CURRENT.set(UNTRACED)
            try:
                return await engine.infer(request)
            finally:
                _CURRENT.reset(token)
        trace = Trace(self, request, scope, parent)
        if self.otel is not None:
            trace.span = self.otel.start(request, parent.span if parent is not None else None)
        request.trace = trace
        token = _CURRENT.set(trace)
        try:
            response = await engine.infer(request)
        except BaseException as err:
            trace.finish(None, err)
            raise
        finally:
            _CURRENT.reset(token)
        trace.finish(response, None)
        return response

    async def infer_stream(self, engine: Any, request: "InferRequest") -> AsyncIterator["InferResponse"]:
        """``engine.infer_stream(request)`` traced if sampled: one trace for the request, an
        INFER_RESPONSE_COMPLETE stamp per response. (A stream's consumer may iterate from
        several tasks, so no context variable is set: an ensemble behind a stream traces its
        steps on their own.)"""
        parent = _CURRENT.get()
        if parent is None:
            parent = getattr(request, "trace_parent", None)
        scope = self._scopes.get(request.model_name, self._global_scope)
        if parent is UNTRACED or (parent is None and not self._sampled(scope, request)):
            request.trace = UNTRACED
            trace = None
        else:
            trace = Trace(self, request, scope, parent)
            if self.otel is not None:
                trace.span = self.otel.start(request, parent.span if parent is not None else None)
            request.trace = trace
        responses = engine.infer_stream(request)
        error: BaseException | None = None
        try:
            async for response in responses:
                if trace is not None:
                    trace.response(response)
                    if response.error is not None and response.final:
                        error = response.error
                yield response
        except BaseException as err:
            error = err
            raise
        finally:
            await responses.aclose()
            if trace is not None:
                trace.finish(None, error)

    def _sampled(self, scope: _Scope, request: "InferRequest") -> bool:
        if self.otel is not None and self.otel.has_remote_parent(request):
            return True          # Triton: a propagated context is always traced
        return scope.sample()

    def _complete(self, trace: Trace, error: BaseException | None) -> None:
        if trace.span is not None:
            self.otel.end(trace, error)
        if trace.scope.settings.trace_mode != "triton":
            return
        entries = trace.entries()
        size = sum(len(a["tensor"]["data"]) for a in trace.activities)
        self._recent.append((entries, size))
        self._recent_bytes += size
        while len(self._recent) > RECENT_TRACES or (
                self._recent_bytes > RECENT_TENSOR_BYTES and len(self._recent) > 1):
            self._recent_bytes -= self._recent.popleft()[1]
        if self._file is not None:
            self._in_batch += 1
            frequency = trace.scope.settings.log_frequency
            try:
                self._file.add(entries, frequency, self._in_batch)
            except OSError as err:
                log.error("cannot write the trace file %s: %s", self._file.path, err)
            if frequency and self._in_batch >= frequency:
                self._in_batch = 0

    # -- reading -------------------------------------------------------------------------
    def recent(self) -> list[dict]:
        """The last traces (up to RECENT_TRACES) as Triton's trace file entries."""
        return [entry for entries, _ in list(self._recent) for entry in entries]

    def close(self) -> None:
        """Write what the trace file still lacks (the server stops)."""
        if self._file is not None:
            self._file.close()
        if self.otel is not None:
            self.otel.shutdown()


def bls_parent(requests: Iterable["InferRequest"]) -> Any:
    """The trace a BLS call made while executing ``requests`` continues: a traced one's
    (Triton links a BLS child to its parent's trace), else the mark that they are untraced,
    else None (tracing was off when they came)."""
    marks = [r.trace for r in requests if r.trace is not None]
    return next((t for t in marks if isinstance(t, Trace)), marks[0] if marks else None)


def trace_context(headers: Mapping[str, str]) -> dict[str, str] | None:
    """A client's W3C trace context (``traceparent``, ``tracestate``) from its HTTP headers
    or gRPC metadata (lower-case names), or None: what continues its trace here."""
    parent = headers.get("traceparent")
    if not parent:
        return None
    carrier = {"traceparent": parent}
    state = headers.get("tracestate")
    if state:
        carrier["tracestate"] = state
    return carrier


def trace_file_entries(path: str | os.PathLike) -> list[dict]:
    """Read a trace file written here (or by Triton)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
