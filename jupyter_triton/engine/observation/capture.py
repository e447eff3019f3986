"""Traffic capture: a bounded, in-memory sample of one model's requests (when, which version
answered, the request id and trace id, its inputs and outputs, latency, status), for the
person changing the model to read back (``GET v2/models/{m}/traffic``, ``handle.traffic()``).

Off by default. ``Engine.infer`` asks one question of a request when no model is captured
(``TrafficCapture.active`` is empty); a captured model's sampled requests are copied after
they ran into one ``bytes`` each (``Capture.add`` says why), newest kept, oldest dropped past
``max_rows`` or ``max_bytes``. The rows are user data: the routes that read or steer them are
the model-repository group's, as loading a model is.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, NamedTuple

import numpy as np

from ...protocol.datatypes import deserialize_bytes_tensor, serialize_bytes_tensor
from ...protocol.errors import InvalidArgument, NotFound, TritonError
from ...protocol.json_tensors import tensor_to_json
from ...protocol.types import InferRequest, InferResponse, InferTensor
from .shadow import Shadow, parse_shadow

if TYPE_CHECKING:
    from .. import Engine

log = logging.getLogger(__name__)
_monotonic_ns = time.monotonic_ns

DEFAULT_MAX_ROWS = 10_000
DEFAULT_MAX_BYTES = 16 << 20
# Per model; what one POST may ask for.
MAX_ROWS = 1_000_000
MAX_BYTES = 1 << 30
_ROW_OVERHEAD = 48          # what a row costs besides its bytes: the object's header, its slot


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
    seen: int = 0                   # requests while on
    captured: int = 0               # rows ever added (those not in ``rows`` were evicted)
    # the epoch time of monotonic 0: a row's arrival is read off the monotonic clock it
    # was timed with (one clock read a request, not two)
    epoch: float = field(default_factory=lambda: time.time() - time.monotonic_ns() / 1e9)
    # a served row's strings and counts (``_tail``), by (version, inputs): the same for each
    # row of a version whose request has no id, no trace and no error
    tails: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the settings a row reads, as attributes of their own: ``add`` runs for every request
        self.every = self.settings.fraction >= 1.0
        self.max_rows, self.max_bytes = self.settings.max_rows, self.settings.max_bytes
        # The rows (one ``bytes`` each: see ``add``), oldest first. While they all have one
        # size (``size``: a model's rows, request after request), the deque's own bound
        # (``maxlen``) is both of the capture's and evicts in C; else (``size`` 0) ``_append``
        # counts their bytes (``mixed_bytes``) row by row, until one size holds again.
        self.rows: deque = deque()
        self.size = 0
        self.mixed_bytes = 0
        self.newest_size = self.newest_run = 0     # the newest rows' size, and how many

    @property
    def bytes(self) -> int:
        """What the rows hold, as ``max_bytes`` counts it."""
        return len(self.rows) * (self.size + _ROW_OVERHEAD) if self.size else self.mixed_bytes

    @property
    def dropped(self) -> int:
        """Rows evicted by the bounds: a row leaves the sample no other way."""
        return self.captured - len(self.rows)

    def sampled(self) -> bool:
        """Counts a request, and says whether it is one of the share kept."""
        self.seen += 1
        return self.every or random.random() < self.settings.fraction

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

        A row is one ``bytes`` (its layout is under ``_COUNTS``; ``_row`` reads it back): a copy
        of the tensors, so that a row holds nothing of the request's. Keeping the arrays
        themselves held what they are views of: a request's whole body, or its batch's whole
        output, so that a sample of one request a batch held 31 times its ``max_bytes``
        (tests/test_capture_rows.py). Its size is what ``max_bytes`` counts, and the collector
        never sees it. This runs on the event loop for every request kept: each step a lookup
        where the same model's rows repeat (a tensor's description, a version's strings)."""
        end = _monotonic_ns()
        inputs = request.inputs
        parts: list = []
        described = _DESCRIBED
        for t in (inputs if response is None else (*inputs, *response.outputs)):
            data = t.data
            key = (t.name, t.datatype, t.shape, None if data is None else data.dtype)
            try:
                head, variable = described[key]
            except (KeyError, TypeError):       # new, or a shape given as a list
                head, variable = _describe(key)
            parts.append(head)
            if variable:                        # BYTES: as on the wire, after its length
                data = serialize_bytes_tensor(data)
                parts += (_LENGTH.pack(len(data)), data)
            elif data is not None:
                parts.append(data)
        if response is not None and request.trace is None and not error and not request.id:
            key = (response.model_version, len(inputs))
            tail = self.tails.get(key)
            if tail is None:
                tail = _tail(key[0], "", "", "", key[1])
                if len(self.tails) < _TAILS_MOST:
                    self.tails[key] = tail
        else:
            tail = _tail_of(request, response, error, len(inputs))
        parts += (tail, _TIMES.pack(start, end - start, status))
        try:
            row = b"".join(parts)
        except TypeError:                       # an array not C-contiguous: its copy that is
            row = b"".join(part if type(part) is bytes else np.ascontiguousarray(part)
                           for part in parts)
        if len(row) + _ROW_OVERHEAD > self.max_bytes:        # past the bound: no tensors
            row = (_tail_of(request, response,
                            error or f"tensors not kept: {len(row)} bytes, past max_bytes", 0)
                   + _TIMES.pack(start, end - start, status))
        if len(row) == self.size:       # the size of every row kept: the deque evicts
            self.rows.append(row)
        else:
            self._append(row)
        self.captured += 1

    def _append(self, row: bytes) -> None:
        """A row of another size than those kept (or the first): the oldest rows go while
        past either bound, counted row by row; once every row kept has this one's size, the
        deque's bound takes over (``__post_init__``)."""
        rows, n = self.rows, len(row)
        if self.size:                   # the sizes differ from here
            self.mixed_bytes = len(rows) * (self.size + _ROW_OVERHEAD)
            self.newest_size, self.newest_run = self.size, len(rows)
            self.rows = rows = deque(rows)
            self.size = 0
        if n == self.newest_size:
            self.newest_run += 1
        else:
            self.newest_size, self.newest_run = n, 1
        rows.append(row)
        total = self.mixed_bytes + n + _ROW_OVERHEAD
        while rows and (len(rows) > self.max_rows or total > self.max_bytes):
            total -= len(rows.popleft()) + _ROW_OVERHEAD
        self.mixed_bytes = total
        if rows and self.newest_run >= len(rows):   # one size again
            self.size = n
            self.rows = deque(rows, maxlen=min(self.max_rows,
                                               self.max_bytes // (n + _ROW_OVERHEAD)))

    def snapshot(self) -> list[Captured]:
        """The rows, oldest first."""
        return [_row(row, self.epoch) for row in self.rows]

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
        capture = self.capture
        if capture is not None:             # ``Capture.sampled``, inline: every request asks
            capture.seen += 1
            if capture.every or random.random() < capture.settings.fraction:
                return True, _monotonic_ns()
        if self.shadow is None:
            return None
        return False, _monotonic_ns()

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


# A row (``Capture.add``): per tensor, inputs first, its description (_TENSOR, then its name,
# datatype, numpy dtype and shape) and its elements (a BYTES tensor's as on the wire, after
# their length: _LENGTH); then the four strings (version, request id, trace id, error),
# _COUNTS (the inputs, the strings' lengths) and _TIMES (arrival and latency, monotonic ns;
# status). A tensor not kept (in a shared-memory region) has the dtype "" and no elements.
_COUNTS = struct.Struct("<HIIII")
_TIMES = struct.Struct("<qqi")
_HEAD = struct.Struct("<HIIIIqqi")      # the two, as ``_row`` reads them
_TAILS_MOST = 64                        # (version, inputs) pairs a capture remembers
_TENSOR = struct.Struct("<IHHH")        # name, datatype, dtype lengths; dimensions
_LENGTH = struct.Struct("<q")
_VARIABLE = "|O"                        # the dtype a BYTES tensor is kept as
# A tensor's (description, variable length), by (name, datatype, shape, dtype): one lookup a
# tensor where the same tensors come again
_DESCRIBED: dict[tuple, tuple[bytes, bool]] = {}
_DESCRIBED_MOST = 4096                  # distinct tensors remembered (then forgotten)


def _tail(version: str, request_id: str, trace_id: str, error: str, inputs: int) -> bytes:
    """A row's four strings and ``_COUNTS``: what comes before its ``_TIMES``."""
    strings = [version.encode(), request_id.encode(), trace_id.encode(), error.encode()]
    return b"".join(strings) + _COUNTS.pack(inputs, *map(len, strings))


def _tail_of(request: InferRequest, response: InferResponse | None, error: str,
             inputs: int) -> bytes:
    """``_tail`` of a request's own strings."""
    trace = request.trace
    return _tail(request.model_version if response is None else response.model_version,
                 request.id, "" if trace is None else str(getattr(trace, "id", "") or ""),
                 error, inputs)


def _describe(key: tuple) -> tuple[bytes, bool]:
    name, datatype, shape, dtype = key
    variable = dtype is not None and dtype.kind in "OSU"
    kind = "" if dtype is None else _VARIABLE if variable else dtype.str
    name, datatype, kind, shape = name.encode(), datatype.encode(), kind.encode(), tuple(shape)
    described = (_TENSOR.pack(len(name), len(datatype), len(kind), len(shape)) + name + datatype
                 + kind + struct.pack(f"<{len(shape)}q", *shape), variable)
    if type(key[2]) is tuple:
        if len(_DESCRIBED) >= _DESCRIBED_MOST:     # a client's thousands of names: a bound
            _DESCRIBED.clear()
        _DESCRIBED[key] = described
    return described


def _row(row: bytes, epoch: float) -> Captured:
    """A row as read: each tensor with its name, datatype, shape and array (None where it
    was not kept; a read-only view of the row, whose memory never changes); ``epoch``: the
    epoch time of monotonic 0."""
    n_inputs, *lengths, start, latency, status = _HEAD.unpack_from(row, len(row) - _HEAD.size)
    end = len(row) - _HEAD.size - sum(lengths)
    at, strings = end, []
    for length in lengths:
        strings.append(row[at:at + length].decode())
        at += length
    at, tensors = 0, []
    while at < end:
        name_n, datatype_n, dtype_n, ndim = _TENSOR.unpack_from(row, at)
        at += _TENSOR.size
        name = row[at:at + name_n].decode()
        datatype = row[at + name_n:at + name_n + datatype_n].decode()
        dtype = row[at + name_n + datatype_n:at + name_n + datatype_n + dtype_n].decode()
        at += name_n + datatype_n + dtype_n
        shape = struct.unpack_from(f"<{ndim}q", row, at)
        at += 8 * ndim
        count = int(np.prod(shape))
        data = None
        if dtype == _VARIABLE:
            (length,) = _LENGTH.unpack_from(row, at)
            at += _LENGTH.size
            data = deserialize_bytes_tensor(memoryview(row)[at:at + length], count,
                                            name).reshape(shape)
            at += length
        elif dtype:
            data = np.frombuffer(row, dtype, count, at).reshape(shape)
            at += data.nbytes
        tensors.append((name, datatype, shape, data))
    version, request_id, trace_id, error = strings
    return Captured(epoch + start / 1e9, version, request_id, trace_id, latency / 1000, status,
                    error, tuple(tensors[:n_inputs]), tuple(tensors[n_inputs:]),
                    len(row) + _ROW_OVERHEAD)
