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
import datetime
import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, NamedTuple

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


class Captured(NamedTuple):
    """One request as it was served, as ``Capture.snapshot`` reads it (the sample holds
    flat tuples, ``Capture.add`` says why)."""
    time: float                     # when it arrived, seconds since the epoch
    model_version: str              # the version that answered ("" when none did)
    id: str                         # the client's request id
    trace_id: str                   # Triton's trace id when the request was traced
    latency_us: float
    status: int                     # 200, or the Triton status of the error it got
    error: str
    inputs: tuple[Kept, ...]
    outputs: tuple[Kept, ...]
    nbytes: int


@dataclass
class Capture:
    """One model's capture: its settings, whether it runs, and its sample."""
    settings: CaptureSettings
    on: bool = True
    rows: deque = field(default_factory=deque)     # flat tuples: see ``add``
    bytes: int = 0
    seen: int = 0                   # requests while on
    captured: int = 0               # rows ever added
    dropped: int = 0                # rows evicted by the bounds
    # the epoch time of monotonic 0: a row's arrival is read off the monotonic clock it
    # was timed with (one clock read a request, not two)
    epoch: float = field(default_factory=lambda: time.time() - time.monotonic_ns() / 1e9)

    def sampled(self) -> bool:
        """Counts a request, and says whether it is one of the share kept."""
        self.seen += 1
        fraction = self.settings.fraction
        return fraction >= 1.0 or random.random() < fraction

    async def infer_stream(self, engine: "Engine", request: InferRequest
                           ) -> AsyncGenerator[InferResponse, None]:
        """A streamed request (decoupled model, generate_stream, gRPC stream) is one row when
        its stream ends: each output its responses' pieces joined (streamed_outputs), the
        status the first error response's."""
        request.captured = True
        stream = engine.infer_stream(request)
        if not self.sampled():
            try:
                async for response in stream:
                    yield response
            finally:
                await stream.aclose()
            return
        start = time.monotonic_ns()
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
            self.add(request, streamed_outputs(pieces), start, status, error)
            raise
        except TritonError as err:
            self.add(request, streamed_outputs(pieces), start, err.status, str(err))
            raise
        except Exception as err:
            self.add(request, streamed_outputs(pieces), start, 500,
                      f"{type(err).__name__}: {err}")
            raise
        finally:
            await stream.aclose()
        self.add(request, streamed_outputs(pieces), start, status, error)

    def add(self, request: InferRequest, response: InferResponse | None, start: int,
            status: int, error: str) -> None:
        """The row of a request served (``response``) or refused (``status``, ``error``)
        that arrived at ``start`` (monotonic ns).

        A row is one flat tuple: Captured's fields up to ``nbytes``, the number of inputs,
        then each tensor's name, datatype and array (or its shape where it has none), inputs
        first. Strings, numbers and arrays only: the collector stops tracking the row at its
        first young collection. (A tuple made per row inside it would be examined after its
        row and keep it tracked into the oldest generation, where each such row counts
        toward the next full collection.)"""
        latency_us = (time.monotonic_ns() - start) / 1000
        inputs = request.inputs
        trace = request.trace
        row = [self.epoch + start / 1e9,
               request.model_version if response is None else response.model_version,
               request.id, "" if trace is None else str(getattr(trace, "id", "") or ""),
               latency_us, status, error, 0, len(inputs)]
        nbytes = _ROW_OVERHEAD
        copies = None
        for t in (inputs if response is None else (*inputs, *response.outputs)):
            data = t.data
            if data is None:
                row += (t.name, t.datatype, tuple(t.shape))
                continue
            nbytes += data.nbytes if t.datatype != "BYTES" else _object_bytes(data)
            if type(data.base) is not bytes and not _unchanging(data):
                copies = [len(row) + 2] if copies is None else [*copies, len(row) + 2]
            row += (t.name, t.datatype, data)
        settings = self.settings
        if nbytes > settings.max_bytes:     # its tensors alone are past the bound: none is kept
            del row[_KEPT:]
            row[_INPUTS] = 0
            row[_ERROR] = error or f"tensors not kept: {nbytes} bytes, past max_bytes"
            nbytes = _ROW_OVERHEAD
        elif copies is not None:            # memory that may change later: a copy is kept
            for i in copies:
                data = row[i]
                row[i] = data.copy() if type(data) is np.ndarray else np.array(data)
        row[_NBYTES] = nbytes
        rows = self.rows
        rows.append(tuple(row))
        self.bytes += nbytes
        self.captured += 1
        if self.bytes > settings.max_bytes or len(rows) > settings.max_rows:
            self.bytes -= rows.popleft()[_NBYTES]       # a full sample: the oldest goes
            self.dropped += 1
            if self.bytes > settings.max_bytes:
                self._bound()

    def _bound(self) -> None:
        rows, settings = self.rows, self.settings
        while rows and (len(rows) > settings.max_rows or self.bytes > settings.max_bytes):
            self.bytes -= rows.popleft()[_NBYTES]
            self.dropped += 1

    def snapshot(self) -> list[Captured]:
        """The rows, oldest first."""
        return [_captured(row) for row in self.rows]

    def to_json(self) -> dict:
        return {"enabled": self.on, **self.settings.to_json(), "requests_seen": self.seen,
                "requests_captured": self.captured, "requests_dropped": self.dropped,
                "rows": len(self.rows), "bytes": self.bytes}


@dataclass
class Tap:
    """What ``Engine.infer`` asks of a tapped model's request, before and after serving
    it: its capture, its shadow (observation/shadow.py), or both. The shadow's copy leaves
    only once the served answer is there, and nothing it does reaches that answer."""
    capture: Capture | None = None
    shadow: Shadow | None = None

    def infer_stream(self, engine: "Engine", request: InferRequest
                     ) -> AsyncGenerator[InferResponse, None]:
        """Streams are captured; a shadow compares whole answers and sees none of them."""
        request.captured = True
        if self.capture is None:
            return engine.infer_stream(request)
        return self.capture.infer_stream(engine, request)

    def begin(self, request: InferRequest) -> "tuple[bool, int] | None":
        """``Engine.infer`` on a tapped model's request, before serving it: marks it (it is
        not tapped twice: the shadow's copy, a traced request coming back) and returns what
        ``served`` or ``failed`` takes, None when neither the capture nor the shadow wants it."""
        request.captured = True
        keep = self.capture is not None and self.capture.sampled()
        if not keep and self.shadow is None:
            return None
        return keep, time.monotonic_ns()

    def served(self, engine: "Engine", request: InferRequest, mark: tuple[bool, int],
               response: InferResponse) -> None:
        keep, start = mark
        if keep:
            self.capture.add(request, response, start, 200, "")
        if self.shadow is not None:
            try:
                self.shadow.offer(engine, request, response, (time.monotonic_ns() - start) / 1000)
            except Exception:       # the served answer goes out whatever the copy did
                log.exception("model '%s': shadow copy failed", request.model_name)

    def failed(self, request: InferRequest, mark: tuple[bool, int], err: BaseException) -> None:
        """A refusal is a row; a request the client gave up on (cancelled) is not: nothing
        was answered."""
        keep, start = mark
        if not keep or isinstance(err, (asyncio.CancelledError, GeneratorExit)):
            return
        if isinstance(err, TritonError):
            self.capture.add(request, None, start, err.status, str(err))
        elif isinstance(err, Exception):    # rendered as 500 by the frontend
            self.capture.add(request, None, start, 500, f"{type(err).__name__}: {err}")


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
        return {"model_name": model, "capture": capture.to_json()}, capture.snapshot()

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


def _object_bytes(data: np.ndarray) -> int:
    """What a copy of a BYTES tensor holds: the elements, not only the pointers."""
    return data.size * 8 + sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in data.ravel())


_ERROR, _NBYTES, _INPUTS, _KEPT = 6, 7, 8, 9    # a row's fields (``Capture.add``)


def _captured(row: tuple) -> Captured:
    """A row as read: each tensor with its name, datatype, shape and array (None where it
    was not kept)."""
    tensors = tuple((name, datatype, kept, None) if type(kept) is tuple else
                    (name, datatype, tuple(kept.shape), kept)
                    for name, datatype, kept in zip(row[_KEPT::3], row[_KEPT + 1::3],
                                                    row[_KEPT + 2::3]))
    n = row[_INPUTS]
    return Captured(*row[:_NBYTES], tensors[:n], tensors[n:], row[_NBYTES])


# the type of a C library's buffer handed to numpy (types.CapsuleType from Python 3.13)
_CAPSULE = type(datetime.datetime_CAPI)


def _unchanging(data: Any) -> bool:
    """Whether ``data``'s memory cannot change, so that a row may keep the array itself: a
    bytes object's (the body as it came off the wire), which nothing can write through, or
    an array's that its maker handed over read-only with memory of its own (none, or a
    runtime's buffer: a capsule), as ONNX Runtime's outputs are (backends/onnxruntime.py).
    A read-only view of a shared-memory region or a mapped file may change: its writer
    writes it again."""
    if type(data) is not np.ndarray:
        return False
    owner = data
    root = data.base
    while type(root) is np.ndarray:
        owner, root = root, root.base
    if type(root) is memoryview:
        root = root.obj
    return type(root) is bytes or (not owner.flags.writeable
                                   and (root is None or type(root) is _CAPSULE))
