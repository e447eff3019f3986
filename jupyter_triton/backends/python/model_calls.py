"""What a running model asks of this server: BLS calls (``pb_utils.InferenceRequest(...)
.exec()`` / ``exec(decoupled=True)`` / ``async_exec()``) and custom metrics
(``pb_utils.MetricFamily``), with its ``pb_utils.Logger`` lines in thread mode.

A worker process sends them as side messages; a BLS call then runs on a pool thread through
``Backend.server_calls`` (the engine bounds depth and calls in flight) and its responses go
back over the worker's socket. In thread mode the model's own thread makes the call
(``ModelCalls`` is the stub's host there), and a pool thread reads a decoupled call's stream
(``_Relayed``): either way the call ends with the callee's final response, as in Triton, not
when the model reads it. A BLS call's depth, and the trace it goes on
with, come from the batch of its caller (``batch``; a decoupled model's last batch's
``depth``, since it calls on after execute has returned).
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from ...model_logs import ModelLogs
from ...model_metrics import CustomMetrics, MetricError
from ...protocol.datatypes import numpy_to_triton
from ...protocol.errors import Cancelled, InvalidArgument, NotFound, TritonError, Unavailable, Unsupported
from ...protocol.types import InferRequest, InferTensor, RequestedOutput
from ..base import InstanceSpec, ModelFiles, ServerCalls
from . import messages
from . import triton_python_backend_utils as pb_utils
from .stub import bls_response, bls_spec
from .worker import WorkerProcess

log = logging.getLogger(__name__)


class Caller(Protocol):
    """What the calls read of the instance whose model makes them (``backend.PythonBackend``,
    which imports this module); the instance is also the owner its model's custom metric
    families are counted for."""
    server_calls: ServerCalls | None
    files: ModelFiles
    instance: InstanceSpec

    @property
    def _who(self) -> str: ...

_PB_CODE_BY_ERROR: dict[type, int] = {
    InvalidArgument: pb_utils.TritonError.INVALID_ARG, NotFound: pb_utils.TritonError.NOT_FOUND,
    Unavailable: pb_utils.TritonError.UNAVAILABLE, Unsupported: pb_utils.TritonError.UNSUPPORTED,
    Cancelled: pb_utils.TritonError.CANCELLED}


def _pb_error(err: BaseException) -> tuple[int, str]:
    if isinstance(err, TritonError):
        code = next((c for cls, c in _PB_CODE_BY_ERROR.items() if isinstance(err, cls)),
                    pb_utils.TritonError.INTERNAL)
        return code, str(err)
    return pb_utils.TritonError.INTERNAL, f"{type(err).__name__}: {err}"


_BLS_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_BLS_POOL_LOCK = threading.Lock()
#: BLS calls of worker processes run on these threads (the engine bounds each caller's
#: calls in flight; past the pool's size they queue here)
BLS_THREADS = 32


def _bls_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _BLS_POOL
    if _BLS_POOL is None:
        with _BLS_POOL_LOCK:
            if _BLS_POOL is None:
                _BLS_POOL = concurrent.futures.ThreadPoolExecutor(BLS_THREADS, thread_name_prefix="triton-bls")
    return _BLS_POOL


class ModelCalls:
    """One instance's model's calls into the server."""

    def __init__(self, backend: Caller) -> None:
        self.backend = backend
        #: the batch executing: BLS calls of it take their depth and trace from it
        self.batch: list | None = None
        #: a decoupled model's last batch's depth (it calls on after execute has returned)
        self.depth = 0
        self._streams: dict[tuple[int, int], Any] = {}
        #: where the model's log lines and custom metrics go: the engine's once ``bind``
        #: has run; an instance outside an engine (a test's) keeps its own
        self.logs = ModelLogs()
        self.metrics = CustomMetrics()

    def bind(self) -> None:
        """Take the engine's log lines and metrics (``Backend.server_calls``, set before
        ``load``): its frontends show them, and only its."""
        server = self.backend.server_calls
        if server is not None:
            self.logs, self.metrics = server.model_logs, server.custom_metrics

    # -- from a worker process ------------------------------------------------------------

    def side_message(self, worker: WorkerProcess, msg: Any) -> None:
        """A worker's message that is not an answer: BLS calls, custom metrics. Never blocks:
        it runs on the thread that waits for a batch, or on a decoupled worker's reader."""
        kind = type(msg)
        if kind is messages.BlsCall:
            _bls_pool().submit(self._bls_for_worker, worker, *msg)
        elif kind is messages.BlsDropped:
            stream = self._streams.pop((id(worker), msg.call_id), None)
            if stream is not None:
                stream.close()
        elif kind is messages.Metric:
            call_id, op, args = msg
            try:
                result, ok = self.metrics.apply(op, args, self.backend), True
            except (MetricError, TypeError, ValueError) as err:
                result, ok = str(err), False
                if not call_id:
                    log.warning("%s: custom metric %s failed: %s", self.backend._who, op, err)
            if call_id:
                worker.send_side(messages.MetricReply(call_id, ok, result))
        else:
            log.warning("%s: unexpected %s from the worker", self.backend._who, kind.__name__)

    def _bls_for_worker(self, worker: WorkerProcess, call_id: int, decoupled: bool, spec: tuple) -> None:
        """On a BLS pool thread: run one call of a worker's model and relay its responses."""
        key = (id(worker), call_id)
        seq = 0
        try:
            results = self._bls_results(spec, decoupled,
                                        lambda stream: self._streams.__setitem__(key, stream))
            for outputs, error, final in results:
                if worker.closed:      # the caller is gone: stop (and cancel) its stream
                    results.close()
                    break
                worker.send_side(messages.BlsReply((call_id, seq), worker.loans.pack(outputs), error, final))
                seq += 1
        finally:
            self._streams.pop(key, None)

    # -- from the model's own thread (thread mode) ----------------------------------------

    def metric_call(self, op: str, args: tuple, what: str) -> Any:
        try:
            return self.metrics.apply(op, args, self.backend)
        except (MetricError, TypeError, ValueError) as err:
            raise pb_utils.TritonModelException(f"{what}: {err}") from None

    def metric_send(self, op: str, args: tuple) -> None:
        self.metric_call(op, args, f"Failed to {op} metric value")

    def model_log(self, level: str, message: str) -> None:
        backend = self.backend
        self.logs.record(backend.files.model_name, str(backend.files.version), level, message,
                         "logger", backend.instance.name)

    def bls_exec(self, request: "pb_utils.InferenceRequest", decoupled: bool) -> Any:
        # opened on the model's thread: the call nests under (and is traced with) its batch
        opened: list = []
        results = self._bls_results(bls_spec(request), decoupled, opened.append)
        if not decoupled:
            outputs, error, _ = next(results)
            return bls_response(outputs, error)
        return _Relayed(results, opened[0] if opened else None)

    # -- one BLS call -----------------------------------------------------------------------

    def _bls_results(self, spec: tuple, decoupled: bool,
                     register: Callable[[Any], None] | None = None) -> Iterator[tuple]:
        """``(outputs, error, final)`` of one BLS call, the last with ``final``; errors as
        ``(pb_utils code, message)``, never raised (Triton puts them in the response). The
        call is made here; a decoupled one's stream is read as the result is."""
        try:
            calls = self.backend.server_calls
            if calls is None:
                raise Unavailable(f"{self.backend._who}: BLS needs a server; this instance has none")
            request, timeout_s = self._bls_request(spec)
            if not decoupled:
                response = calls.infer(request, timeout_s)
                return _once(({t.name: t.data for t in response.outputs}, None, True))
            stream = calls.infer_stream(request, timeout_s)
        except Exception as err:
            return _once(self._bls_failed(err))
        if register is not None:
            register(stream)
        return self._bls_stream(stream)

    def _bls_stream(self, stream: Any) -> Iterator[tuple]:
        final, item = False, None
        try:
            try:
                for response in stream:
                    final = bool(response.final)
                    error = response.error
                    if error is not None:
                        item = None, _pb_error(error), final
                    else:
                        item = {t.name: t.data for t in response.outputs}, None, final
                    if final:
                        break
                    yield item
            finally:
                _close(stream)   # the call ends with its final response, before that is handed on
        except Exception as err:
            yield self._bls_failed(err)
            return
        # the stream ended without a final response: end it for the model
        yield item if final else (None, None, True)

    def _bls_failed(self, err: Exception) -> tuple:
        if not isinstance(err, TritonError):
            log.exception("%s: BLS call failed", self.backend._who)
        return None, _pb_error(err), True

    def _bls_request(self, spec: tuple) -> tuple[InferRequest, float | None]:
        model, version, inputs, names, request_id, correlation_id, flags, timeout_us, params = spec
        if not model:
            raise InvalidArgument("BLS request without a model_name")
        try:
            parameters = json.loads(params) if params else {}
        except ValueError:
            raise InvalidArgument(f"BLS request to model '{model}': parameters are not JSON") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"BLS request to model '{model}': parameters must be a JSON object")
        if correlation_id:
            parameters["sequence_id"] = correlation_id
        if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
            parameters["sequence_start"] = True
        if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
            parameters["sequence_end"] = True
        tensors = []
        for name, array in inputs.items():
            array = np.asarray(array)
            tensors.append(InferTensor(name, numpy_to_triton(array.dtype), tuple(array.shape), array))
        batch = self.batch
        depth = (self.depth if batch is None
                 else max((getattr(r, "bls_depth", 0) for r in batch), default=0)) + 1
        request = InferRequest(model, version, id=request_id or "", inputs=tensors,
                               outputs=[RequestedOutput(n) for n in names] or None,
                               parameters=parameters, bls_depth=depth)
        # a traced caller's trace goes on in its BLS calls (engine/observation/trace.py reads it); a
        # decoupled model's calls have no batch to take it from
        request.trace_parent = next((r.trace for r in batch or () if r.trace is not None), None)
        return request, (timeout_us / 1e6 if timeout_us else None)


def _once(item: tuple) -> Iterator[tuple]:
    yield item


def _close(stream: Any) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _relay(results: Iterator[tuple], items: queue.SimpleQueue) -> None:
    """On a BLS pool thread: every result of one call, as it comes (it holds nothing of the
    ``_Relayed`` it feeds, so that the model dropping that cancels the call)."""
    for item in results:
        items.put(item)


class _Relayed:
    """A decoupled BLS call of a thread-mode model, as the model iterates it. Its stream is
    read on a BLS pool thread as a worker process's is, so that the call ends when the callee
    sends its final response, as Triton releases a BLS request then, not when (or whether)
    the model reads that response; the responses wait here for the model. Dropped before the
    final one, it cancels the call."""

    def __init__(self, results: Iterator[tuple], stream: Any) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = stream
        self._done = False
        _bls_pool().submit(_relay, results, self._items)

    def __iter__(self) -> "_Relayed":
        return self

    def __next__(self) -> "pb_utils.InferenceResponse":
        if self._done:
            raise StopIteration
        outputs, error, final = self._items.get()
        self._done = final
        return bls_response(outputs, error)

    def __del__(self) -> None:
        if not self._done and self._stream is not None:
            _close(self._stream)
