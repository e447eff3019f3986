"""Traffic capture: a bounded, in-memory sample of one model's requests (when, which version
answered, the request id and trace id, its inputs and outputs, latency, status), for the
person changing the model to read back (``GET v2/models/{m}/traffic``, ``handle.traffic()``).

Off by default. ``Engine.infer`` asks one question of a request when no model is captured
(``TrafficCapture.active`` is empty); a captured model's sampled requests are copied after
they ran (a copy: a shared-memory region or a reused buffer changes later), newest kept,
oldest dropped past ``max_rows`` or ``max_bytes``. The rows are user data: the routes that
read or steer them are the model-repository group's, as loading a model is.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable

import numpy as np

from ...protocol.errors import InvalidArgument, NotFound, TritonError
from ...protocol.json_tensors import tensor_to_json
from ...protocol.types import InferRequest, InferResponse, InferTensor
from .shadow import Shadow, parse_shadow

if TYPE_CHECKING:
    from .. import Engine

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 10_000
DEFAULT_MAX_BYTES = 16 << 20
# Per model; what one POST may ask for.
MAX_ROWS = 1_000_000
MAX_BYTES = 1 << 30
_ROW_OVERHEAD = 512         # bytes a row holds besides its tensors (its record, strings)


@dataclass(frozen=True)
class CaptureSettings:
    fraction: float = 1.0           # share of the requests sampled, (0, 1]
    max_rows: int = DEFAULT_MAX_ROWS
    max_bytes: int = DEFAULT_MAX_BYTES

    def to_json(self) -> dict:
        return {"fraction": self.fraction, "max_rows": self.max_rows, "max_bytes": self.max_bytes}


# (name, datatype, shape, data): a tensor as kept, made an InferTensor only when read
Kept = tuple[str, str, tuple, "np.ndarray | None"]


@dataclass(slots=True)
class Captured:
    """One request as it was served."""
    time: float                     # when it arrived, seconds since the epoch
    model_version: str              # the version that answered ("" when none did)
    id: str                         # the client's request id
    trace_id: str                   # Triton's trace id when the request was traced
    latency_us: float
    status: int                     # 200, or the Triton status of the error it got
    error: str
    inputs: list[Kept]
    outputs: list[Kept]
    nbytes: int


@dataclass
class Capture:
    """One model's capture: its settings, whether it runs, and its sample."""
    settings: CaptureSettings
    on: bool = True
    rows: deque = field(default_factory=deque)
    bytes: int = 0
    seen: int = 0                   # requests while on
    captured: int = 0               # rows ever added
    dropped: int = 0                # rows evicted by the bounds

    async def infer(self, engine: "Engine", request: InferRequest) -> InferResponse:
        request.captured = True
        self.seen += 1
        if self.settings.fraction < 1.0 and random.random() >= self.settings.fraction:
            return await engine.infer(request)
        arrived, start = time.time(), time.monotonic_ns()
        try:
            response = await engine.infer(request)
        except asyncio.CancelledError:
            raise                   # the client went away: nothing was answered
        except TritonError as err:
            self._add(request, None, arrived, start, err.status, str(err))
            raise
        except Exception as err:    # rendered as 500 by the frontend
            self._add(request, None, arrived, start, 500, f"{type(err).__name__}: {err}")
            raise
        self._add(request, response, arrived, start, 200, "")
        return response

    async def infer_stream(self, engine: "Engine", request: InferRequest
                           ) -> AsyncGenerator[InferResponse, None]:
        """A streamed request (decoupled model, generate_stream, gRPC stream) is one row when
        its stream ends: each output its responses' pieces joined (streamed_outputs), the
        status the first error response's."""
        request.captured = True
        self.seen += 1
        stream = engine.infer_stream(request)
        if self.settings.fraction < 1.0 and random.random() >= self.settings.fraction:
            try:
                async for response in stream:
                    yield response
            finally:
                await stream.aclose()
            return
        arrived, start = time.time(), time.monotonic_ns()
        pieces: list[InferResponse] = []
        status, error, final = 200, "", False
        try:
            async for response in stream:
                if response.error is None:
                    pieces.append(response)
                elif not error:
                    status = getattr(response.error, "status", 500)
                    error = str(response.error)
                final = response.final
                yield response
        except (GeneratorExit, asyncio.CancelledError):
            # closed by the front after the final response, or the client went away (the
            # front closes or cancels the stream): what it got is the row
            if not final and not error:
                status, error = 499, "the client closed the stream before its end"
            self._add(request, streamed_outputs(pieces), arrived, start, status, error)
            raise
        except TritonError as err:
            self._add(request, streamed_outputs(pieces), arrived, start, err.status, str(err))
            raise
        except Exception as err:
            self._add(request, streamed_outputs(pieces), arrived, start, 500,
                      f"{type(err).__name__}: {err}")
            raise
        finally:
            await stream.aclose()
        self._add(request, streamed_outputs(pieces), arrived, start, status, error)

    def _add(self, request: InferRequest, response: InferResponse | None, arrived: float,
             start: int, status: int, error: str) -> None:
        latency_us = (time.monotonic_ns() - start) / 1000
        tensors = (request.inputs, response.outputs if response is not None else [])
        nbytes = _ROW_OVERHEAD + sum(_bytes(t.data) for group in tensors for t in group)
        if nbytes <= self.settings.max_bytes:
            inputs, outputs = _kept(tensors[0]), _kept(tensors[1])
        else:                       # its tensors alone are past the bound: not copied
            inputs, outputs = [], []
            error = error or f"tensors not kept: {nbytes} bytes, past max_bytes"
            nbytes = _ROW_OVERHEAD
        trace = request.trace
        row = Captured(arrived, response.model_version if response else request.model_version,
                       request.id, str(trace.id) if getattr(trace, "id", None) else "", latency_us,
                       status, error, inputs, outputs, nbytes)
        self.rows.append(row)
        self.bytes += row.nbytes
        self.captured += 1
        self._bound()

    def _bound(self) -> None:
        while self.rows and (len(self.rows) > self.settings.max_rows or
                             self.bytes > self.settings.max_bytes):
            self.bytes -= self.rows.popleft().nbytes
            self.dropped += 1

    def to_json(self) -> dict:
        return {"enabled": self.on, **self.settings.to_json(), "requests_seen": self.seen,
                "requests_captured": self.captured, "requests_dropped": self.dropped,
                "rows": len(self.rows), "bytes": self.bytes}


@dataclass
class Tap:
    """What ``Engine.infer`` hands a tapped model's request to: its capture, its shadow
    (observation/shadow.py), or both. The shadow's copy leaves only once the served answer
    is there, and nothing it does reaches that answer."""
    capture: Capture | None = None
    shadow: Shadow | None = None

    def infer_stream(self, engine: "Engine", request: InferRequest
                     ) -> AsyncGenerator[InferResponse, None]:
        """Streams are captured; a shadow compares whole answers and sees none of them."""
        request.captured = True
        if self.capture is None:
            return engine.infer_stream(request)
        return self.capture.infer_stream(engine, request)

    async def infer(self, engine: "Engine", request: InferRequest) -> InferResponse:
        if self.shadow is None:
            return await self.capture.infer(engine, request)
        request.captured = True
        start = time.monotonic_ns()
        response = await (self.capture.infer(engine, request) if self.capture is not None
                          else engine.infer(request))
        try:
            self.shadow.offer(engine, request, response, (time.monotonic_ns() - start) / 1000)
        except Exception:           # the served answer goes out whatever the copy did
            log.exception("model '%s': shadow copy failed", request.model_name)
        return response


def streamed_outputs(pieces: list[InferResponse]) -> InferResponse | None:
    """One response standing for a stream's: each output's pieces joined along the first
    axis where their other dimensions agree (a token per response: the text), else the last
    piece; None when no response carried outputs."""
    if not pieces:
        return None
    if len(pieces) == 1:
        return pieces[0]
    joined: dict[str, list[InferTensor]] = {}
    for response in pieces:
        for t in response.outputs:
            joined.setdefault(t.name, []).append(t)
    outputs = []
    for name, parts in joined.items():
        arrays = [np.asarray(p.data) for p in parts if p.data is not None]
        last = parts[-1]
        if len(arrays) == len(parts) and all(a.ndim and a.shape[1:] == arrays[0].shape[1:]
                                             and a.dtype == arrays[0].dtype for a in arrays):
            data = np.concatenate(arrays)
            outputs.append(InferTensor(name, last.datatype, tuple(data.shape), data))
        else:
            outputs.append(last)
    return InferResponse(pieces[-1].model_name, pieces[-1].model_version, pieces[-1].id,
                         outputs)


class TrafficCapture:
    """Every model's tap, the engine's (``engine.traffic``). ``active``: the models captured
    or shadowed now, the one thing ``Engine.infer`` looks at; ``samples`` and ``shadows``:
    every capture and shadow, also those stopped (readable until cleared or replaced)."""

    def __init__(self, known: Callable[[str], bool]) -> None:
        self.known = known          # whether a name is a model of this server
        self.active: dict[str, Tap] = {}
        self.samples: dict[str, Capture] = {}
        self.shadows: dict[str, Shadow] = {}

    def _retap(self, model: str) -> None:
        capture, shadow = self.samples.get(model), self.shadows.get(model)
        tap = Tap(capture if capture is not None and capture.on else None,
                  shadow if shadow is not None and shadow.on else None)
        if tap.capture is None and tap.shadow is None:
            self.active.pop(model, None)
        else:
            self.active[model] = tap

    def control(self, model: str, body: Any) -> dict:
        """``POST v2/models/{m}/traffic``: ``{"capture": true, "fraction": 1.0, "max_rows":
        10000, "max_bytes": 16777216}`` starts a new sample (every key optional);
        ``{"capture": false}`` stops it and keeps what it holds, ``"clear": true`` drops that
        too. Returns the capture's state, as ``read`` does without its rows."""
        on, settings, clear = parse_control(body)
        self._check(model)
        if on:
            capture = self.samples[model] = Capture(settings)
        else:
            capture = self.samples.pop(model, None) if clear else self.samples.get(model)
            if capture is not None:
                capture.on = False
        self._retap(model)
        if capture is None or clear:
            return {"model_name": model, "capture": None}
        return {"model_name": model, "capture": capture.to_json()}

    def read(self, model: str) -> tuple[dict, list[Captured]]:
        """The capture's state and a snapshot of its rows, oldest first."""
        self._check(model)
        capture = self.samples.get(model)
        if capture is None:
            return {"model_name": model, "capture": None}, []
        return {"model_name": model, "capture": capture.to_json()}, list(capture.rows)

    def shadow_control(self, engine: "Engine", model: str, body: Any) -> dict:
        """``POST v2/models/{m}/shadow``: ``{"version": 2, "fraction": 1.0}`` sends a copy of
        that share of the served requests to staged version 2 (a new report);
        ``{"version": null}`` stops and keeps the report. Returns ``shadow_report``."""
        version, fraction = parse_shadow(body)
        self._check(model)
        if version is None:
            shadow = self.shadows.get(model)
            if shadow is not None:
                shadow.on = False
        else:
            engine._version(model, str(version))   # 404 / 503, as an infer naming it hears
            if any(mv.name == model and mv.version == version for mv in engine.models()):
                raise InvalidArgument(f"shadow: version {version} of '{model}' is the one "
                                      f"served; shadow a staged version (serve(..., stage=True))")
            self.shadows[model] = Shadow(version, fraction)
        self._retap(model)
        return self.shadow_report(model)

    def shadow_report(self, model: str) -> dict:
        """``GET v2/models/{m}/shadow``: the shadow's state and, per output, how the staged
        version's answers compare with the served ones (observation/shadow.py)."""
        self._check(model)
        shadow = self.shadows.get(model)
        return {"model_name": model, "shadow": shadow.to_json() if shadow is not None else None}

    def _check(self, model: str) -> None:
        if model not in self.samples and model not in self.shadows and not self.known(model):
            raise NotFound(f"Request for unknown model: '{model}' is not found")


def traffic_json(state: dict, rows: list[Captured]) -> bytes:
    """``GET v2/models/{m}/traffic``'s body: the capture's state and its rows, oldest first,
    tensors as v2 JSON (protocol/json_tensors.tensor_to_json). Non-finite floats are spelled
    NaN / Infinity, as Python's json reads them."""
    requests = [{"time": r.time, "model_version": r.model_version, "id": r.id,
                 "trace_id": r.trace_id, "latency_us": r.latency_us, "status": r.status,
                 "error": r.error, "inputs": [tensor_to_json(InferTensor(*t)) for t in r.inputs],
                 "outputs": [tensor_to_json(InferTensor(*t)) for t in r.outputs]} for r in rows]
    return json.dumps({**state, "requests": requests}, separators=(",", ":")).encode()


def parse_control(body: Any) -> tuple[bool, CaptureSettings, bool]:
    """(capture on, its settings, clear) from a control body; a 400 naming the key and the
    rule for anything else."""
    if not isinstance(body, dict):
        raise InvalidArgument("traffic capture: the body must be a JSON object")
    unknown = set(body) - {"capture", "fraction", "max_rows", "max_bytes", "clear"}
    if unknown:
        raise InvalidArgument(f"traffic capture: unknown key(s) {sorted(unknown)}; expected "
                              "capture, fraction, max_rows, max_bytes, clear")
    on, clear = body.get("capture", True), body.get("clear", False)
    for key, value in (("capture", on), ("clear", clear)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"traffic capture: '{key}' must be a boolean")
    if clear and on:
        raise InvalidArgument("traffic capture: 'clear' goes with \"capture\": false")
    fraction = body.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
            not 0 < fraction <= 1:
        raise InvalidArgument("traffic capture: 'fraction' must be a number in (0, 1]")
    bounds = {}
    for key, default, most in (("max_rows", DEFAULT_MAX_ROWS, MAX_ROWS),
                               ("max_bytes", DEFAULT_MAX_BYTES, MAX_BYTES)):
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise InvalidArgument(f"traffic capture: '{key}' must be an integer from 1 to {most}")
        bounds[key] = value
    return on, CaptureSettings(float(fraction), **bounds), clear


def _bytes(data: "np.ndarray | None") -> int:
    """What a copy of ``data`` holds (BYTES: the elements, not the pointers)."""
    if data is None:
        return 0
    if not data.dtype.hasobject:
        return data.nbytes
    return data.size * 8 + sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in data.ravel())


def _kept(tensors: list[InferTensor]) -> list[Kept]:
    """Copies: a shared-memory region or a buffer a backend reuses changes later."""
    return [(t.name, t.datatype, t.shape,
             None if t.data is None else
             t.data.copy() if type(t.data) is np.ndarray else np.array(t.data))
            for t in tensors]
