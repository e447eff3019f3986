"""Triton's python backend: ``model.py`` with ``TritonPythonModel``, run unchanged.

Each instance runs its model in its own worker process (``EXECUTION_MODE`` "process", the
default) so that a crashing or leaking model cannot take the server down, or, when the
config asks for it, in the instance's own thread::

    parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }

Like Triton, ``execute`` gets every request of a batch and returns one response per
request; nothing is merged here. What the config's ``parameters`` set (bounds, BLAS threads)
is in ``model_config``.

A batch whose tensors do not fit in /dev/shm fails with Unavailable (503) and the reason;
the worker and the server live on.

Beyond request/response, as Triton's python backend has them:

- Decoupled models (``model_transaction_policy { decoupled: true }``): ``execute`` returns
  None and answers through ``request.get_response_sender()``, zero or more responses per
  request, from any thread, also after execute has returned, until
  ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``; ``is_cancelled()`` asks the server. A
  sender dropped without the final flag closes its request (a request nobody can answer any
  more must not stay open); a worker that dies or is killed (timeout, unload) closes every
  open request with an error response (``decoupled``).
- BLS: ``pb_utils.InferenceRequest(...).exec()`` / ``exec(decoupled=True)`` /
  ``async_exec()`` run on this server through ``Backend.server_calls`` (the engine bounds
  depth and calls in flight); a worker process sends the call over its socket and a BLS pool
  thread runs it. In thread mode, BLS and custom metrics work from inside ``initialize`` and
  ``execute`` (threads the model starts itself have no way back to their model there)
  (``model_calls``).
- Custom metrics (``pb_utils.MetricFamily``): in the engine's ``CustomMetrics``
  (``jupyter_triton.model_metrics``, handed over as ``server_calls.custom_metrics``), shown on
  its metrics endpoint, released at unload (``model_calls``).
- Model logs: ``pb_utils.Logger`` lines and a worker's stdout/stderr, per model version in
  the engine's ``ModelLogs`` (``jupyter_triton.model_logs``, ``server_calls.model_logs``) and
  in the server's own output, as before (``worker_logs``).
- ``auto_complete_config``, run in a short-lived worker (``auto_complete``).

Worker processes are forked from a template process that has imported numpy and the
worker's modules (``launch``, ``worker_main``): a worker starts in tens of milliseconds, not
the ~0.4 s of a fresh interpreter, and is still a process of its own. A model may run its
workers in its own packed environment instead (``envs``)::

    parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }

Tensors of a batch travel through the worker's two shared-memory regions; those of decoupled
responses and BLS calls leave at any time, so past 1 MiB they travel in a region the server
lends for that one message (``loans``; small ones ride inside it). A model that does none of
this pays nothing for it: its batches take the same two messages as before.

This module is the instance as the engine sees it: load, a batch's requests in and responses
out (on the event loop where it can: ``start_on_loop``), the worker's restarts, unload.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from typing import Callable

from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                                TritonError, Unavailable, Unsupported)
from ...protocol.types import InferRequest
from ..base import Backend, BackendDead, InstanceSpec, ModelFiles, ResponseSender, Tensors
from . import triton_python_backend_utils as pb_utils
from .auto_complete import auto_complete
from .decoupled import DecoupledWorker, Sink, ThreadHost
from .envs import EXECUTION_ENV_PATH, packed_env
from .model_calls import ModelCalls
from .model_config import (BLAS_THREADS, EXECUTE_TIMEOUT, EXECUTION_MODE, FINALIZE_TIMEOUT, INITIALIZE_TIMEOUT,
                           blas_threads_parameter, execution_mode, model_py_path, timeout_parameter,
                           triton_config_json)
from .shm import SharedMemoryFull
from .stub import ModelStub, OrphanCloser, RequestData, ResponseError, StubError
from .worker import LoopWatch, NeedsThread, WorkerDied, WorkerProcess, WorkerTimeout, how_it_ended

log = logging.getLogger(__name__)

# Request parameters the protocol reserves; a model's request.parameters() shows the rest.
_RESERVED_PARAMETERS = frozenset({
    "priority", "timeout", "binary_data_output", "binary_data", "binary_data_size",
    "classification", "sequence_id", "sequence_start", "sequence_end", "headers",
    "triton_enable_empty_final_response"})

_ERROR_BY_CODE: dict[int, type[TritonError]] = {
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
    pb_utils.TritonError.CANCELLED: Cancelled,
    pb_utils.TritonError.ALREADY_EXISTS: InvalidArgument,
}


class _LoopBatch:
    """One batch of a worker-process instance whose answer the event loop reads
    (``PythonBackend.start_on_loop``)."""

    __slots__ = ("backend", "done", "read", "data", "inputs", "requests")

    def __init__(self, backend: "PythonBackend", done: Callable[..., None]) -> None:
        self.backend = backend
        self.done = done                # the engine's: (responses, None) or (None, finish)
        self.read: LoopWatch | None = None
        self.data: list[RequestData] = []
        self.inputs: list[Tensors] = []
        self.requests: list = []

    def send(self, requests: list[Tensors], infer_requests: list) -> None:
        """On the loop; never raises: what goes wrong ends the batch."""
        backend = self.backend
        self.inputs, self.requests = requests, infer_requests
        t0 = time.monotonic_ns()
        try:
            self.data = [backend._request_data(inputs, request)
                         for inputs, request in zip(requests, infer_requests)]
        except Exception as err:
            self.read._end(None, err)
            return
        backend.io_ns = (time.monotonic_ns() - t0, 0)     # Triton's compute_input
        backend.calls.batch = infer_requests                # BLS calls of this batch take their depth
        self.read.send(self.data, backend._all_outputs)

    def ended(self, results: list | None, error: BaseException | None) -> None:
        """The worker's answer (``LoopWatch``'s ``done``), on the loop."""
        self.backend._executed_on_loop(self, results, error)


class PythonBackend(Backend):
    backend_name = "python"
    platforms = ()
    default_filename = "model.py"
    supports_decoupled = True

    #: a worker that dies this many times within ``death_window_s`` is not restarted again
    max_deaths: int = 3
    death_window_s: float = 60.0

    def __init__(self, config: mc.ModelConfig, files: ModelFiles, instance: InstanceSpec) -> None:
        super().__init__(config, files, instance)
        self.mode = execution_mode(config)
        self.out_of_process = self.mode == "process"
        self.model_py = model_py_path(config, files)
        self.execute_timeout_s = timeout_parameter(config, EXECUTE_TIMEOUT)
        self.initialize_timeout_s = timeout_parameter(config, INITIALIZE_TIMEOUT)
        self.finalize_timeout_s = timeout_parameter(config, FINALIZE_TIMEOUT)
        self.blas_threads = blas_threads_parameter(config)
        self.env = packed_env(config, files.model_dir)
        if self.env is not None and self.mode == "thread":
            raise InvalidArgument(f"model '{config.name}': parameter {EXECUTION_ENV_PATH} needs "
                                  f"{EXECUTION_MODE} \"process\" (a thread runs in the server's python)")
        self._all_outputs = [o.name for o in config.output]
        # implicit state: the sequence batcher takes the state outputs from the responses
        self._all_outputs += [s.output_name for s in config.sequence_batching.state
                              if s.output_name not in self._all_outputs]
        self._all_output_set = frozenset(self._all_outputs)
        self.decoupled = bool(config.model_transaction_policy.decoupled)
        self._thread_sinks: set[Sink] = set()    # thread mode: open decoupled requests
        self._orphans = OrphanCloser(lambda sink: sink.deliver(None, None, True))
        self.calls = ModelCalls(self)              # BLS and custom metrics of the model
        self._stub: ModelStub | None = None
        self._worker: WorkerProcess | None = None
        self._deaths: collections.deque[float] = collections.deque()
        self._dead: BackendDead | None = None
        self._closing = False
        self._lock = threading.Lock()

    # -- Triton's view of this instance -------------------------------------------------

    @property
    def _who(self) -> str:
        return f"model '{self.files.model_name}' instance '{self.instance.name}'"

    @property
    def worker_pid(self) -> int | None:
        """The worker process serving this instance (None in thread mode): the engine reads
        its memory for the statistics' memory_usage."""
        return self._worker.pid if self._worker is not None else None

    def triton_args(self) -> dict[str, str]:
        """``initialize``'s ``args``, spelled as Triton spells them (all strings)."""
        return {
            "model_config": triton_config_json(self.config),
            "model_instance_kind": "GPU" if self.instance.kind == "KIND_GPU" else "CPU",
            "model_instance_name": self.instance.name,
            "model_instance_device_id": str(self.instance.device_id),
            "model_repository": str(self.files.model_dir),
            "model_version": str(self.files.version),
            "model_name": self.files.model_name,
        }

    # -- Backend interface ----------------------------------------------------------------

    @classmethod
    def auto_complete_config(cls, config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
        return auto_complete(config, files)

    def load(self) -> None:
        self.calls.bind()
        if not self.model_py.is_file():
            raise InvalidArgument(f"model '{self.files.model_name}' version {self.files.version}: "
                                  f"no {self.model_py.name} in {self.model_py.parent}")
        if self.mode == "thread":
            bounds = [k for k in (EXECUTE_TIMEOUT, INITIALIZE_TIMEOUT) if k in self.config.parameters]
            if bounds:
                log.warning("%s: %s not enforced in thread mode (a thread cannot be stopped)",
                            self._who, " and ".join(bounds))
            if BLAS_THREADS in self.config.parameters:
                log.warning("%s: %s not applied in thread mode (the server process's BLAS is "
                            "shared by every model in it)", self._who, BLAS_THREADS)
            try:
                self._stub = ModelStub(str(self.model_py), self.triton_args(), bls_host=self.calls)
            except StubError as err:
                raise self._load_error(err) from None
            return
        worker = self._spawn()
        try:
            worker.wait_ready(self.initialize_timeout_s)
        except StubError as err:
            worker.close()
            raise self._load_error(err) from None
        except WorkerDied as err:
            worker.close()
            raise Internal(f"python worker for {self._who} {how_it_ended(err)} "
                           "during initialize") from None
        except WorkerTimeout as err:
            worker.close(0)
            raise DeadlineExceeded(
                f"{self._who}: TritonPythonModel.initialize did not finish within {err.seconds:g} s "
                f"(parameter {INITIALIZE_TIMEOUT}); the worker was killed") from None
        self._worker = worker

    def execute(self, requests: list[Tensors],
                infer_requests: list[InferRequest] | None = None) -> list[Tensors | TritonError]:
        """One response per request. ``infer_requests`` (same order), when the engine passes
        them, give the model each request's id, parameters and requested outputs."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            t0 = time.monotonic_ns()
            data = [self._request_data(inputs, infer_requests[i] if infer_requests else None)
                    for i, inputs in enumerate(requests)]
            self.io_ns = (time.monotonic_ns() - t0, 0)     # Triton's compute_input / output
            # BLS calls of this batch take their depth from it; not kept past it (its tensors)
            self.calls.batch = infer_requests
            try:
                if self.mode == "thread":
                    if self._stub is None:
                        raise Unavailable(f"{self._who} is not loaded")
                    try:
                        results = self._stub.execute(data)
                    except StubError as err:
                        return [self._execute_error(err)] * len(data)
                else:
                    results = self._execute_in_worker(data)
                    if isinstance(results, TritonError):
                        return [results] * len(data)
            finally:
                self.calls.batch = None
            t2 = time.monotonic_ns()
            responses = [self._response(r, d) for r, d in zip(results, data)]
            self.io_ns = (self.io_ns[0], time.monotonic_ns() - t2)
            return responses

    @property
    def executes_on_loop(self) -> bool:   # type: ignore[override]
        return self.mode == "process" and not self.decoupled

    def start_on_loop(self, loop: asyncio.AbstractEventLoop,
                      done: Callable[[list | None, Callable[[], list] | None], None]
                      ) -> "_LoopBatch | None":
        """The next batch of this instance, split in two (``WorkerProcess.watch``): the loop
        waits for its answer with no thread blocked, ``send`` sends it. None where the worker
        is not ready (a restart still initializing), the instance busy or unloading:
        ``execute`` on the thread then."""
        worker = self._worker
        if (not self.executes_on_loop or worker is None or not worker.ready or self._closing
                or self._dead is not None or not self._lock.acquire(blocking=False)):
            return None
        batch = _LoopBatch(self, done)
        try:
            batch.read = worker.watch(loop, batch.ended, self.execute_timeout_s)
        finally:
            if batch.read is None:
                self._lock.release()
        return batch if batch.read is not None else None

    def _executed_on_loop(self, batch: "_LoopBatch", results: list | None,
                          error: BaseException | None) -> None:
        self.calls.batch = None
        data = batch.data
        done = batch.done
        if error is None:
            t2 = time.monotonic_ns()
            try:
                responses = [self._response(r, d) for r, d in zip(results, data)]
            except Exception as err:       # a bug here must fail the batch, not strand it
                log.error("%s: reading the results failed", self._who, exc_info=err)
                responses = [Internal(f"{self._who}: {type(err).__name__}: {err}")] * len(data)
            finally:
                self._lock.release()
            self.io_ns = (self.io_ns[0], time.monotonic_ns() - t2)
            done(responses, None)
            return
        if isinstance(error, (StubError, SharedMemoryFull)) or (
                self._closing and isinstance(error, WorkerDied)):
            failed = self._worker_error(error, len(data))
            self._lock.release()
            done([failed] * len(data), None)
            return

        def finish() -> list:
            # blocking: a worker to restart (death, timeout) or a region to set up first
            if isinstance(error, NeedsThread):
                self._lock.release()
                return self.execute(batch.inputs, batch.requests)
            try:
                if not isinstance(error, (WorkerDied, WorkerTimeout)):
                    log.error("%s: execute failed", self._who, exc_info=error)
                    return [Internal(f"{self._who}: {type(error).__name__}: {error}")] * len(data)
                return [self._worker_error(error, len(data))] * len(data)
            finally:
                self._lock.release()
        done(None, finish)

    def execute_decoupled(self, requests: list[Tensors], infer_requests: list,
                          senders: list[ResponseSender]) -> None:
        """A decoupled model's batch: returns when its execute has returned; request ``i``'s
        responses go to ``senders[i]`` as the model sends them. Raises the ``TritonError``
        that fails every request still open (execute raised, the worker died or timed out)."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            # a decoupled model calls on after execute returns: keep the depth, not the requests
            self.calls.depth = max((r.bls_depth for r in infer_requests or ()), default=0)
            data = [self._request_data(inputs, infer_requests[i] if infer_requests else None)
                    for i, inputs in enumerate(requests)]
            sinks = [Sink(self, sender, d.requested_output_names) for sender, d in zip(senders, data)]
            if self.mode == "thread":
                if self._stub is None:
                    raise Unavailable(f"{self._who} is not loaded")
                self._thread_sinks.update(sinks)
                try:
                    self._stub.execute_decoupled(data, list(range(len(sinks))),
                                                 ThreadHost(sinks, self._orphans))
                except StubError as err:
                    raise self._execute_error(err) from None
                return
            result = self._execute_in_worker(data, sinks)
            if isinstance(result, TritonError):
                raise result

    def unload(self) -> None:
        """Bounded: a batch still executing is not waited for (its worker is killed), and
        ``finalize`` gets ``finalize_timeout_seconds``."""
        self._closing = True
        if not self._lock.acquire(blocking=False):
            worker = self._worker
            if worker is not None:   # the engine has drained; what still runs is stuck
                log.warning("%s: a batch is still executing at unload; killing its worker", self._who)
                worker.kill()
            if not self._lock.acquire(timeout=self.finalize_timeout_s or 5.0):
                log.error("%s: execute did not return at unload%s; leaving it behind", self._who,
                          " (thread mode: a thread cannot be stopped)" if self.mode == "thread" else "")
                return
        try:
            error = None
            if self._stub is not None:
                try:
                    self._stub.finalize()
                except StubError as err:
                    error = err
                self._stub = None
            if self._worker is not None:
                worker, self._worker = self._worker, None
                error = worker.stop(self.finalize_timeout_s)
            for sink in list(self._thread_sinks):
                sink.fail("closed", "the model instance was unloaded")
            self.calls.metrics.release(self)
            if self.env is not None:
                self.env.release()   # no worker of this instance runs it now
            if error is not None:
                log.warning("%s: finalize failed: %s\n%s", self._who, error.message, error.traceback)
        finally:
            self._lock.release()

    # -- worker processes -------------------------------------------------------------------

    def _spawn(self) -> WorkerProcess:
        kind = DecoupledWorker if self.decoupled else WorkerProcess
        return kind(str(self.model_py), self.triton_args(), self.instance.name,
                    side=self.calls.side_message, blas_threads=self.blas_threads, env=self.env,
                    poll_us=self.busy_poll_us, logs=self.calls.logs).start()

    def _execute_in_worker(self, data: list[RequestData],
                           sinks: list[Sink] | None = None) -> list | TritonError:
        if self._closing:
            return Unavailable(f"{self._who} is being unloaded")
        if self._worker is None:
            self._worker = self._spawn()
        worker = self._worker
        try:
            if not worker.ready:
                try:
                    worker.wait_ready(self.initialize_timeout_s)
                except StubError as err:   # a restart whose initialize failed counts as a death
                    log.error("%s: restart failed:\n%s", self._who, err.traceback)
                    return self._on_death(
                        f"python worker for {self._who} could not be restarted: {err.message}")
                except WorkerTimeout as err:
                    return self._on_death(
                        f"python worker for {self._who} could not be restarted: initialize did not "
                        f"finish within {err.seconds:g} s (parameter {INITIALIZE_TIMEOUT})")
            if sinks is not None:
                return worker.execute_decoupled(data, sinks, self.execute_timeout_s, self._all_outputs)
            return worker.execute(data, self.execute_timeout_s, self._all_outputs)
        except (StubError, SharedMemoryFull, WorkerTimeout, WorkerDied) as err:
            return self._worker_error(err, len(data))

    def _worker_error(self, err: Exception, count: int) -> TritonError:
        """What a batch of ``count`` requests failed with; a worker that timed out or died is
        restarted (blocking: not on the event loop), or given up on (``BackendDead``)."""
        if isinstance(err, StubError):
            return self._execute_error(err)
        if isinstance(err, SharedMemoryFull):
            return Unavailable(f"{self._who}: {err}; the batch of {count} request(s) was not run "
                               "(enlarge /dev/shm, e.g. docker run --shm-size, or send smaller batches)")
        if isinstance(err, WorkerTimeout):
            return self._on_timeout(err, count)
        if isinstance(err, WorkerDied):
            if self._closing:
                return Unavailable(f"{self._who} was unloaded while executing {count} request(s)")
            return self._on_death(
                f"python worker for {self._who} {how_it_ended(err)} while "
                f"executing {count} request(s)")
        raise err

    def _on_timeout(self, err: WorkerTimeout, count: int) -> DeadlineExceeded:
        """A stuck execute: the worker is already killed; restart it, not counted as a death
        (a model that is sometimes slow is not broken)."""
        self._discard_worker()
        what = (f"{self._who}: execute did not finish within {err.seconds:g} s (parameter "
                f"{EXECUTE_TIMEOUT}) for {count} request(s); the worker was killed")
        log.warning("%s; restarting it", what)
        if not self._closing:
            self._worker = self._spawn()
        return DeadlineExceeded(f"{what} and is being restarted")

    def _discard_worker(self) -> None:
        if self._worker is not None:
            self._worker.close(0)
            self._worker = None

    def _on_death(self, what: str) -> Unavailable:
        """Fail the batch, restart the worker in the background, or give up for good."""
        self._discard_worker()
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.death_window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.max_deaths:
            self._dead = BackendDead(
                f"{what}; it failed {len(self._deaths)} times within {self.death_window_s:g} s and "
                f"is not restarted again: load the model again to retry")
            log.error("%s", self._dead)
            raise self._dead
        log.warning("%s; restarting it", what)
        # Spawning returns at once; the next batch waits for initialize to finish.
        self._worker = self._spawn()
        return Unavailable(f"{what}; the worker is being restarted")

    # -- conversions --------------------------------------------------------------------------

    def _request_data(self, inputs: Tensors, request: InferRequest | None) -> RequestData:
        # shared by every request that names no outputs: pb_utils.InferenceRequest copies it
        # for the model, the worker gets its own, and nothing here changes it
        all_outputs = self._all_outputs
        if request is None:
            return RequestData(inputs=inputs, requested_output_names=all_outputs)
        params = request.parameters or {}
        if not params:
            return RequestData(inputs=inputs, request_id=request.id,
                               requested_output_names=[o.name for o in request.outputs]
                               if request.outputs else all_outputs)
        flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0) \
            | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0)
        return RequestData(
            inputs=inputs, request_id=request.id, correlation_id=params.get("sequence_id", 0),
            parameters=json.dumps({k: v for k, v in params.items() if k not in _RESERVED_PARAMETERS},
                                  default=str),
            requested_output_names=[o.name for o in request.outputs] if request.outputs else all_outputs,
            flags=flags)

    def _response(self, result: dict | ResponseError, request: RequestData | None) -> Tensors | TritonError:
        if isinstance(result, ResponseError):
            return _ERROR_BY_CODE.get(result.code, Internal)(
                f"model '{self.files.model_name}': {result.message}")
        names = request.requested_output_names
        if not names:
            return result
        wanted = self._all_output_set if names is self._all_outputs else set(names)
        if result.keys() <= wanted:   # the usual case: the model returned what was asked
            return result
        return {name: value for name, value in result.items() if name in wanted}

    def _execute_error(self, err: StubError) -> TritonError:
        log.error("%s: %s failed:\n%s", self._who, err.stage, err.traceback or err.message)
        return _ERROR_BY_CODE.get(err.code, Internal)(
            f"Failed to process the request(s) for {self._who}, message: {err.message}")

    def _load_error(self, err: StubError) -> TritonError:
        log.error("%s: %s failed:\n%s", self._who, err.stage, err.traceback or err.message)
        if err.stage == "import":
            return InvalidArgument(f"model '{self.files.model_name}': cannot import "
                                   f"{self.model_py.name}: {err.message}")
        return Internal(f"model '{self.files.model_name}': TritonPythonModel.{err.stage} failed: "
                        f"{err.message}")


__all__ = ["PythonBackend"]
