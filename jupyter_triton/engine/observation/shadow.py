"""Shadow traffic: a copy of a share of a model's live requests sent to a staged version
(loaded by ``serve(..., stage=True)``: a canary at fraction 0, engine/lifecycle/rollout.py),
its answers compared with the served ones and never returned to a client.

The second consumer of the traffic tap ``Engine.infer`` already has for capture
(observation/capture.py's ``TrafficCapture.active``): a shadowed model's request is served
first; only then is its copy handed to a task of its own, at most ``max_in_flight`` at a time
(the rest dropped and counted), so a slow or failing staged version never delays or fails
the served answer. ``GET/POST v2/models/{m}/shadow`` reads and steers it; a promotion with
``shadow_max_diff`` reads the report (``check``).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...protocol.errors import InvalidArgument, TritonError
from ...protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput

if TYPE_CHECKING:
    from .. import Engine

log = logging.getLogger(__name__)

#: shadow requests running at once, per model; past it a copy is dropped, not queued
MAX_IN_FLIGHT = 16
#: latencies kept per side for the percentiles
LATENCY_WINDOW = 2048
#: outputs past this many bytes are compared off the event loop, which serves the answers
COMPARE_ON_LOOP_BYTES = 1 << 20


@dataclass
class OutputDiff:
    """How one output of the staged version compares with the served one, so far."""
    compared: int = 0               # requests whose output was compared
    max_abs_diff: float = 0.0
    mismatched_shape: int = 0
    mismatched_values: int = 0      # BYTES outputs: requests whose values differ
    rows: int = 0                   # classification rows compared ([batch, classes])
    agreeing_rows: int = 0          # ... whose argmax agrees
    cosine_sum: float = 0.0         # per-row cosine distance, summed (vectors)
    cosine_max: float = 0.0
    cosine_rows: int = 0

    def add(self, served: np.ndarray, shadow: np.ndarray) -> None:
        self.compared += 1
        if served.shape != shadow.shape:
            self.mismatched_shape += 1
            return
        if served.dtype.kind in "OSU" or shadow.dtype.kind in "OSU":
            self.mismatched_values += bool(np.any(served != shadow))
            return
        a, b = served.astype(np.float64), shadow.astype(np.float64)
        if a.size:
            self.max_abs_diff = max(self.max_abs_diff, float(np.nanmax(np.abs(a - b))))
        if a.ndim == 2 and a.shape[1] > 1:
            self.rows += a.shape[0]
            self.agreeing_rows += int(np.sum(a.argmax(axis=1) == b.argmax(axis=1)))
        rows_a = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
        if a.size and a.ndim and rows_a.shape[1] > 1:   # vectors: a row each (one when 1-D)
            rows_b = b.reshape(rows_a.shape)
            norms = np.linalg.norm(rows_a, axis=1) * np.linalg.norm(rows_b, axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                distance = 1.0 - np.sum(rows_a * rows_b, axis=1) / norms
            distance = distance[np.isfinite(distance)]
            if distance.size:
                self.cosine_sum += float(distance.sum())
                self.cosine_max = max(self.cosine_max, float(distance.max()))
                self.cosine_rows += int(distance.size)

    def to_json(self) -> dict:
        return {"compared": self.compared, "max_abs_diff": self.max_abs_diff,
                "agreement": self.agreeing_rows / self.rows if self.rows else None,
                "cosine_distance": ({"mean": self.cosine_sum / self.cosine_rows,
                                     "max": self.cosine_max} if self.cosine_rows else None),
                "mismatched_shape": self.mismatched_shape,
                "mismatched_values": self.mismatched_values}


@dataclass
class Shadow:
    """One model's shadow: the staged version its copies go to, and what they showed."""
    version: int
    fraction: float = 1.0
    max_in_flight: int = MAX_IN_FLIGHT
    on: bool = True
    seen: int = 0                   # served requests while on
    sent: int = 0                   # copies sent to the staged version
    dropped: int = 0                # copies past max_in_flight
    errors: int = 0                 # copies the staged version failed
    compared: int = 0               # copies answered and compared
    last_error: str = ""
    outputs: dict[str, OutputDiff] = field(default_factory=dict)
    served_latency: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    shadow_latency: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    tasks: set = field(default_factory=set)

    def offer(self, engine: "Engine", request: InferRequest, response: InferResponse,
              served_us: float) -> None:
        """After the served answer: send a copy of ``request`` to the staged version, in a
        task of its own, if this request is sampled and a slot is free."""
        if not self.on or response.model_version == str(self.version):
            return              # stopped, or the staged version answered itself (named, or promoted)
        try:                    # set aside, or unloaded: the shadow ends with it
            engine._version(request.model_name, str(self.version))
        except TritonError as err:
            self.on = False
            self.last_error = f"shadow stopped: {err}"[:500]
            return
        self.seen += 1
        if self.fraction < 1.0 and random.random() >= self.fraction:
            return
        if len(self.tasks) >= self.max_in_flight:
            self.dropped += 1
            return
        self.served_latency.append(served_us)
        # the outputs asked for, as asked (a classification too), never into a client's region
        outputs = None if request.outputs is None else [
            RequestedOutput(o.name, {k: v for k, v in o.parameters.items()
                                     if not k.startswith("shared_memory_")})
            for o in request.outputs]
        copy = InferRequest(model_name=request.model_name, model_version=str(self.version),
                            id=request.id, inputs=_copies(request.inputs), outputs=outputs,
                            parameters=dict(request.parameters))
        copy.captured = True    # its own copy is neither captured nor shadowed again
        served = {t.name: t.data.copy() for t in response.outputs if t.data is not None}
        self.sent += 1
        task = asyncio.ensure_future(self._run(engine, copy, served))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, engine: "Engine", copy: InferRequest,
                   served: dict[str, np.ndarray]) -> None:
        start = time.monotonic_ns()
        try:
            response = await engine.infer(copy)
        except asyncio.CancelledError:
            raise
        except Exception as err:    # the staged version's failure is a figure, not an error
            self.errors += 1
            self.last_error = (str(err) if isinstance(err, TritonError)
                               else f"{type(err).__name__}: {err}")[:500]
            return
        self.shadow_latency.append((time.monotonic_ns() - start) / 1000)
        self.compared += 1
        answered = {t.name: t.data for t in response.outputs if t.data is not None}
        if sum(a.nbytes for a in served.values()) <= COMPARE_ON_LOOP_BYTES:
            self._compare(served, answered)
        else:
            await asyncio.get_running_loop().run_in_executor(None, self._compare, served, answered)

    def _compare(self, served: dict[str, np.ndarray], answered: dict[str, Any]) -> None:
        for name, want in served.items():
            got = answered.get(name)
            diff = self.outputs.setdefault(name, OutputDiff())
            if got is None:
                diff.compared += 1
                diff.mismatched_shape += 1
            else:
                diff.add(want, np.asarray(got))

    def to_json(self) -> dict:
        return {"version": self.version, "enabled": self.on, "fraction": self.fraction,
                "max_in_flight": self.max_in_flight, "requests_seen": self.seen,
                "requests_sent": self.sent, "requests_dropped": self.dropped,
                "errors": self.errors, "last_error": self.last_error,
                "in_flight": len(self.tasks),
                "requests_compared": self.compared,
                "outputs": {n: d.to_json() for n, d in sorted(self.outputs.items())},
                "latency_ms": {"served": _percentiles(self.served_latency),
                               "shadow": _percentiles(self.shadow_latency)}}


def _copies(tensors: list[InferTensor]) -> list[InferTensor]:
    """The inputs as they were served: a shared-memory region or a reused buffer changes
    once the client has its answer."""
    return [InferTensor(t.name, t.datatype, tuple(t.shape),
                        None if t.data is None else np.array(t.data, copy=True))
            for t in tensors]


def _percentiles(latencies_us: deque) -> dict:
    if not latencies_us:
        return {"p50": None, "p99": None, "count": 0}
    values = np.fromiter(latencies_us, dtype=np.float64) / 1000
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "count": int(values.size)}


def parse_shadow(body: Any) -> tuple[int | None, float]:
    """(the staged version, the share of requests) from ``POST v2/models/{m}/shadow``'s body:
    ``{"version": 2, "fraction": 1.0}``; ``{"version": null}`` stops. A 400 naming the key."""
    if not isinstance(body, dict):
        raise InvalidArgument("shadow: the body must be a JSON object")
    unknown = set(body) - {"version", "fraction"}
    if unknown:
        raise InvalidArgument(f"shadow: unknown key(s) {sorted(unknown)}; expected version, fraction")
    if "version" not in body:
        raise InvalidArgument("shadow: 'version' is required: the staged version to shadow, "
                              "or null to stop")
    version = body["version"]
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version < 1):
        raise InvalidArgument(f"shadow: 'version' must be a version number or null, not {version!r}")
    fraction = body.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
            not 0 < fraction <= 1:
        raise InvalidArgument(f"shadow: 'fraction' must be a number in (0, 1], not {fraction!r}")
    return version, float(fraction)


def check(report: dict | None, model: str, version: int | None, bound: float) -> None:
    """A promotion's ``shadow_max_diff``: InvalidArgument naming the first output whose max
    absolute difference is past ``bound``, or why the report cannot say."""
    if version is None:
        raise InvalidArgument(f"failed to promote '{model}': 'shadow_max_diff' promotes a "
                              f"staged version: give it ('promote': <version>), no files")
    refused = f"promotion of '{model}' version {version} refused: "
    if report is None or report.get("version") != version:
        raise InvalidArgument(refused + f"no shadow of version {version} was run "
                              f"(POST v2/models/{model}/shadow, handle.shadow({version}))")
    outputs = report.get("outputs", {})
    if not outputs:
        raise InvalidArgument(refused + "its shadow compared no request yet")
    for name, diff in outputs.items():
        if diff["mismatched_shape"] or diff["mismatched_values"]:
            raise InvalidArgument(refused + f"shadow output '{name}' differs in shape or values "
                                  f"({diff['mismatched_shape']} shape, {diff['mismatched_values']}"
                                  f" value mismatches of {diff['compared']})")
        if not diff["max_abs_diff"] <= bound:
            raise InvalidArgument(refused + f"shadow output '{name}' max |diff| "
                                  f"{diff['max_abs_diff']:.6g} > shadow_max_diff {bound:g} "
                                  f"({diff['compared']} requests compared)")
