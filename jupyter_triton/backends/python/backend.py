"""Triton's python backend: ``model.py`` with ``TritonPythonModel``, run unchanged.

Each instance runs its model in its own worker process (``EXECUTION_MODE`` "process", the
default) so that a crashing or leaking model cannot take the server down, or, when the
config asks for it, in the instance's own thread::

    parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }

Like Triton, ``execute`` gets every request of a batch and returns one response per
request; nothing is merged here.

Bounds, as config ``parameters`` (seconds, ``string_value``; "0" means no bound)::

    parameters { key: "execute_timeout_seconds" value: { string_value: "600" } }
    parameters { key: "initialize_timeout_seconds" value: { string_value: "600" } }
    parameters { key: "finalize_timeout_seconds" value: { string_value: "5" } }

- ``execute_timeout_seconds`` (default 600): a batch whose ``execute`` has not returned by
  then fails with DeadlineExceeded (504) naming the model and the bound; the worker is
  killed and a new one started, which serves the next batch. Long enough for a slow model on
  a CPU (a large batch through a big network), short enough that a model stuck in a loop
  or a lock gives its requests back.
- ``initialize_timeout_seconds`` (default 600): for ``initialize`` (and
  ``auto_complete_config``); past it the load fails with DeadlineExceeded, or a restarted
  worker counts as one that died. Loading weights from a slow disk or network takes minutes.
- ``finalize_timeout_seconds`` (default 5): unload waits this long for ``finalize``, then
  kills the worker, so that unload and server shutdown finish even with a hung model. A
  batch still executing when unload comes is not waited for (the engine has drained its
  requests before): its worker is killed and the batch fails with Unavailable.

BLAS threads of a worker process (numpy's OpenBLAS, MKL), as a config ``parameters`` entry::

    parameters { key: "blas_thread_count" value: { string_value: "1" } }

Default (ours; Triton leaves the library's own, one thread per core): 1, unless the server's
environment sets ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ``GOTO_NUM_THREADS`` or
``OMP_NUM_THREADS`` (then the environment decides). OpenBLAS's pool threads spin after
every call, and the small products a dynamic batcher forms gain nothing from them: measured
on 2 busy cores, y = x@W (W 256x256 fp32), max_batch_size 64, 500 us batch delay, one
instance, perf_analyzer c=32 over HTTP, alternating runs: the worker's CPU per inference
243-280 us with the library's default, 29-30 us with 1 thread; the server tree's
417-457 us -> 201-207 us, throughput 2,100-2,500 -> 4,350-4,660 infer/s. "0" keeps the
library's default (large products on a machine of their own); more instances
(``instance_group`` count) are the other way to use more cores. Thread mode leaves the server
process's BLAS as it is.

Timeouts need a worker to kill: in thread mode they are not enforced (a thread cannot be
stopped) and unload gives up waiting for a hung ``execute`` after ``finalize_timeout_seconds``.

A batch whose tensors do not fit in /dev/shm fails with Unavailable (503) and the reason;
the worker and the server live on.

Beyond request/response, as Triton's python backend has them:

- Decoupled models (``model_transaction_policy { decoupled: true }``): ``execute`` returns
  None and answers through ``request.get_response_sender()``, zero or more responses per
  request, from any thread, also after execute has returned, until
  ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``; ``is_cancelled()`` asks the server. A
  sender dropped without the final flag closes its request (a request nobody can answer any
  more must not stay open); a worker that dies or is killed (timeout, unload) closes every
  open request with an error response.
- BLS: ``pb_utils.InferenceRequest(...).exec()`` / ``exec(decoupled=True)`` /
  ``async_exec()`` run on this server through ``Backend.server_calls`` (the engine bounds
  depth and calls in flight); a worker process sends the call over its socket and a BLS pool
  thread runs it. In thread mode, BLS and custom metrics work from inside ``initialize`` and
  ``execute`` (threads the model starts itself have no way back to their model there).
- Custom metrics (``pb_utils.MetricFamily``): ``jupyter_triton.model_metrics``, shown on the
  metrics endpoint, released at unload.
- Model logs: ``pb_utils.Logger`` lines and a worker's stdout/stderr, per model version in
  ``jupyter_triton.model_logs`` (and in the server's own output, as before).

Worker processes are forked from a template process that has imported numpy and the
worker's modules (``launch``, ``worker_main``): a worker starts in tens of milliseconds, not
the ~0.4 s of a fresh interpreter, and is still a process of its own. A model may run its
workers in its own packed environment instead (``envs``)::

    parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }

Tensors of a batch travel through the worker's two shared-memory regions; those of decoupled
responses and BLS calls leave at any time, so past 1 MiB they travel in a region the server
lends for that one message (small ones ride inside it). A model that does none of this pays
nothing for it: its batches take the same two messages as before.
"""
from __future__ import annotations


import ast
import asyncio
import collections
import concurrent.futures
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                                TritonError, Unavailable, Unsupported)
# model_metrics (prometheus_client, ~100 ms to import) is imported where it is used: every
# worker process imports this module and never needs it.
from ...model_logs import LOGS
from ...protocol.datatypes import numpy_to_triton
from ...protocol.types import InferRequest, InferTensor, RequestedOutput
from ..base import Backend, BackendDead, InstanceSpec, ModelFiles, ResponseSender, Tensors
from . import triton_python_backend_utils as pb_utils
from .stub import ModelStub, OrphanCloser, RequestData, bls_response, bls_spec, ResponseError, StubError, module_name, run_auto_complete_config
from . import messages
from .envs import EXECUTION_ENV_PATH, packed_env
from .shm import SharedMemoryFull
from .worker import (LoopWatch, NeedsThread, WorkerDied, WorkerProcess, WorkerTimeout, auto_complete_in_worker,
                     describe_exit)

log = logging.getLogger(__name__)

EXECUTION_MODE = "EXECUTION_MODE"
MODES = ("process", "thread")

EXECUTE_TIMEOUT = "execute_timeout_seconds"
INITIALIZE_TIMEOUT = "initialize_timeout_seconds"
FINALIZE_TIMEOUT = "finalize_timeout_seconds"
DEFAULT_TIMEOUTS = {EXECUTE_TIMEOUT: 600.0, INITIALIZE_TIMEOUT: 600.0, FINALIZE_TIMEOUT: 5.0}

BLAS_THREADS = "blas_thread_count"
DEFAULT_BLAS_THREADS = 1

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


def triton_config_json(config: mc.ModelConfig) -> str:
    """The config as Triton hands it to ``initialize`` and ``auto_complete_config``: every
    field present (defaults too), proto field names, 64-bit integers as JSON numbers."""
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    return json.dumps(_int64_to_int(as_dict, config.DESCRIPTOR))


_INT64_TYPES = {_descriptor.FieldDescriptor.TYPE_INT64, _descriptor.FieldDescriptor.TYPE_UINT64,
                _descriptor.FieldDescriptor.TYPE_SINT64, _descriptor.FieldDescriptor.TYPE_FIXED64,
                _descriptor.FieldDescriptor.TYPE_SFIXED64}


def _int64_to_int(value: dict, desc: _descriptor.Descriptor) -> dict:
    # json_format writes int64 as strings (JSON's numbers are doubles); Triton writes numbers,
    # and models do arithmetic on config["dims"].
    for name, item in value.items():
        field = desc.fields_by_name.get(name)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            for key, sub in item.items():
                if vfield.message_type is not None:
                    _int64_to_int(sub, vfield.message_type)
                elif vfield.type in _INT64_TYPES:
                    item[key] = int(sub)
        elif field.message_type is not None:
            for sub in (item if isinstance(item, list) else [item]):
                _int64_to_int(sub, field.message_type)
        elif field.type in _INT64_TYPES:
            value[name] = [int(v) for v in item] if isinstance(item, list) else int(item)
    return value


def execution_mode(config: mc.ModelConfig) -> str:
    param = config.parameters.get(EXECUTION_MODE)
    mode = (param.string_value if param is not None else "process").strip().lower() or "process"
    if mode not in MODES:
        raise InvalidArgument(
            f"model '{config.name}': parameter {EXECUTION_MODE} must be one of "
            f"{', '.join(MODES)}, got '{param.string_value}'")
    return mode


def timeout_parameter(config: mc.ModelConfig, key: str) -> float | None:
    """Seconds from config ``parameters`` (the default when absent); None means no bound."""
    param = config.parameters.get(key)
    text = param.string_value.strip() if param is not None else ""
    if not text:
        seconds = DEFAULT_TIMEOUTS[key]
    else:
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise InvalidArgument(f"model '{config.name}': parameter {key} must be a number of "
                                  f"seconds (0 for no bound), got '{param.string_value}'")
    return seconds or None


def blas_threads_parameter(config: mc.ModelConfig) -> int:
    """A worker's BLAS threads: the config's, else 1 unless the environment chose; 0 leaves
    the library's own default."""
    param = config.parameters.get(BLAS_THREADS)
    text = param.string_value.strip() if param is not None else ""
    if not text:
        from .blas import user_chose
        return 0 if user_chose() else DEFAULT_BLAS_THREADS
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise InvalidArgument(f"model '{config.name}': parameter {BLAS_THREADS} must be a number of "
                              f"threads (0 for the library's default), got '{param.string_value}'")
    return count


def model_py_path(config: mc.ModelConfig, files: ModelFiles) -> Path:
    return files.version_dir / (files.default_filename or config.default_model_filename or "model.py")


def _defines_auto_complete(model_py: Path) -> bool:
    """Read, not import: the server process never runs a model's code just to find out."""
    try:
        tree = ast.parse(model_py.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel"
               and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and f.name == "auto_complete_config" for f in node.body)
               for node in tree.body)


class _Sink:
    """One decoupled request's way back to the engine's ``ResponseSender``: tensors cut to
    the requested outputs, errors given their Triton status, closed once."""

    __slots__ = ("backend", "sender", "wanted", "closed", "_lock")

    def __init__(self, backend: "PythonBackend", sender: ResponseSender, wanted: list[str]) -> None:
        self.backend = backend
        self.sender = sender
        self.wanted = wanted
        self.closed = False
        self._lock = threading.Lock()

    def deliver(self, outputs: dict | None, error: tuple[int, str] | None, final: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = final
        err = None
        if error is not None:
            err = self.backend._response(ResponseError(*error), None)
            outputs = None
        elif outputs is not None:
            wanted = self.wanted
            outputs = {n: v for n, v in outputs.items() if not wanted or n in wanted}
        self._send(outputs, err, final)

    def fail(self, kind: str, message: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        cls = DeadlineExceeded if kind == "timeout" else Unavailable
        self._send(None, cls(f"{self.backend._who}: {message}"), True)

    def cancelled(self) -> bool:
        try:
            return bool(self.sender.is_cancelled())
        except Exception:
            return True

    def _send(self, outputs: dict | None, error: TritonError | None, final: bool) -> None:
        try:
            self.sender.send(outputs, error=error, final=final)
        except TritonError as err:   # the engine closed it first (its own error, a cancel)
            log.debug("%s: response not delivered: %s", self.backend._who, err)
        if final:
            self.backend._thread_sinks.discard(self)


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
        backend._batch_requests = infer_requests            # BLS calls of this batch take their depth
        self.read.send(self.data, backend._all_outputs)

    def ended(self, results: list | None, error: BaseException | None) -> None:
        """The worker's answer (``LoopWatch``'s ``done``), on the loop."""
        self.backend._executed_on_loop(self, results, error)


class _ThreadHost:
    """Thread mode's ``DecoupledHost``: the stub's senders write straight to the sinks."""

    def __init__(self, sinks: list[_Sink], orphans: OrphanCloser) -> None:
        self.sinks = sinks
        self._orphans = orphans

    def respond(self, key: int, response: "pb_utils.InferenceResponse | None", final: bool) -> None:
        if response is None:
            self.sinks[key].deliver(None, None, final)
            return
        data = ModelStub.response_data(response)
        if isinstance(data, ResponseError):
            self.sinks[key].deliver(None, (data.code, data.message), final)
        else:
            self.sinks[key].deliver(data, None, final)

    def cancelled(self, key: int) -> bool:
        return self.sinks[key].cancelled()

    def orphaned(self, key: int) -> None:
        self._orphans.put(self.sinks[key])

    def flush(self) -> None:
        pass


class _ThreadBls:
    """Thread mode's host for BLS and custom metrics: the calling thread does it itself."""

    def __init__(self, backend: "PythonBackend") -> None:
        self.backend = backend

    def metric_call(self, op: str, args: tuple, what: str) -> Any:
        from ... import model_metrics
        try:
            return model_metrics.apply(op, args, self.backend)
        except (model_metrics.MetricError, TypeError, ValueError) as err:
            raise pb_utils.TritonModelException(f"{what}: {err}") from None

    def metric_send(self, op: str, args: tuple) -> None:
        self.metric_call(op, args, f"Failed to {op} metric value")

    def model_log(self, level: str, message: str) -> None:
        backend = self.backend
        LOGS.record(backend.files.model_name, str(backend.files.version), level, message, "logger",
                    backend.instance.name)

    def bls_exec(self, request: "pb_utils.InferenceRequest", decoupled: bool) -> Any:
        results = self.backend._bls_results(bls_spec(request), decoupled)
        if not decoupled:
            outputs, error, _ = next(results)
            return bls_response(outputs, error)
        return (bls_response(outputs, error) for outputs, error, _ in results)


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
        self._thread_sinks: set[_Sink] = set()   # thread mode: open decoupled requests
        self._orphans = OrphanCloser(lambda sink: sink.deliver(None, None, True))
        self._batch_requests: list | None = None   # the batch executing: BLS depth comes from it
        self._bls_depth = 0                          # a decoupled model's last batch's depth
        self._bls_streams: dict[tuple[int, int], Any] = {}
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
        model_py = model_py_path(config, files)
        if not model_py.is_file() or not _defines_auto_complete(model_py):
            return config
        module = module_name(files.model_name, str(files.version), "auto_complete_config")
        try:
            if execution_mode(config) == "thread":
                completed = run_auto_complete_config(str(model_py), module, triton_config_json(config))
            else:
                completed = auto_complete_in_worker(str(model_py), module, triton_config_json(config),
                                                    timeout_parameter(config, INITIALIZE_TIMEOUT),
                                                    packed_env(config, files.model_dir))
        except StubError as err:
            log.error("model '%s': auto_complete_config failed:\n%s", files.model_name, err.traceback)
            raise InvalidArgument(
                f"model '{files.model_name}': TritonPythonModel.auto_complete_config failed: "
                f"{err.message}") from None
        except WorkerDied as err:
            raise Internal(f"python worker for model '{files.model_name}' died ({describe_exit(err.exitcode)}) "
                           "while running auto_complete_config") from None
        except WorkerTimeout as err:
            raise DeadlineExceeded(
                f"model '{files.model_name}': TritonPythonModel.auto_complete_config did not finish "
                f"within {err.seconds:g} s (parameter {INITIALIZE_TIMEOUT}); the worker was killed") from None
        try:
            return json_format.ParseDict(completed, mc.ModelConfig())
        except json_format.ParseError as err:
            raise InvalidArgument(f"model '{files.model_name}': auto_complete_config returned an "
                                  f"invalid model configuration: {err}") from None

    def load(self) -> None:
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
                self._stub = ModelStub(str(self.model_py), self.triton_args(), bls_host=_ThreadBls(self))
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
            raise Internal(f"python worker for {self._who} died ({describe_exit(err.exitcode)}) "
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
            self._batch_requests = infer_requests
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
                self._batch_requests = None
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
        self._batch_requests = None
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
            self._bls_depth = max((r.bls_depth for r in infer_requests or ()), default=0)
            data = [self._request_data(inputs, infer_requests[i] if infer_requests else None)
                    for i, inputs in enumerate(requests)]
            sinks = [_Sink(self, sender, d.requested_output_names) for sender, d in zip(senders, data)]
            if self.mode == "thread":
                if self._stub is None:
                    raise Unavailable(f"{self._who} is not loaded")
                self._thread_sinks.update(sinks)
                try:
                    self._stub.execute_decoupled(data, list(range(len(sinks))),
                                                 _ThreadHost(sinks, self._orphans))
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
            from ... import model_metrics
            model_metrics.REGISTRY.release(self)
            if self.env is not None:
                self.env.release()   # no worker of this instance runs it now
            if error is not None:
                log.warning("%s: finalize failed: %s\n%s", self._who, error.message, error.traceback)
        finally:
            self._lock.release()

    # -- worker processes -------------------------------------------------------------------

    def _spawn(self) -> WorkerProcess:
        return WorkerProcess(str(self.model_py), self.triton_args(), self.instance.name,
                             decoupled=self.decoupled, side=self._side_message,
                             blas_threads=self.blas_threads, env=self.env,
                             poll_us=self.busy_poll_us).start()

    def _side_message(self, worker: WorkerProcess, msg: Any) -> None:
        """A worker's message that is not an answer: BLS calls, custom metrics. Never blocks:
        it runs on the thread that waits for a batch, or on a decoupled worker's reader."""
        kind = type(msg)
        if kind is messages.BlsCall:
            _bls_pool().submit(self._bls_for_worker, worker, *msg)
        elif kind is messages.BlsDropped:
            stream = self._bls_streams.pop((id(worker), msg.call_id), None)
            if stream is not None:
                stream.close()
        elif kind is messages.Metric:
            call_id, op, args = msg
            from ... import model_metrics
            try:
                result, ok = model_metrics.apply(op, args, self), True
            except (model_metrics.MetricError, TypeError, ValueError) as err:
                result, ok = str(err), False
                if not call_id:
                    log.warning("%s: custom metric %s failed: %s", self._who, op, err)
            if call_id:
                worker.send_side(messages.MetricReply(call_id, ok, result))
        else:
            log.warning("%s: unexpected %s from the worker", self._who, kind.__name__)

    # -- BLS ----------------------------------------------------------------------------------

    def _bls_for_worker(self, worker: WorkerProcess, call_id: int, decoupled: bool, spec: tuple) -> None:
        """On a BLS pool thread: run one call of a worker's model and relay its responses."""
        key = (id(worker), call_id)
        seq = 0
        try:
            results = self._bls_results(spec, decoupled,
                                        lambda stream: self._bls_streams.__setitem__(key, stream))
            for outputs, error, final in results:
                if worker.closed:      # the caller is gone: stop (and cancel) its stream
                    results.close()
                    break
                worker.send_side(messages.BlsReply((call_id, seq), worker.pack(outputs), error, final))
                seq += 1
        finally:
            self._bls_streams.pop(key, None)

    def _bls_results(self, spec: tuple, decoupled: bool,
                     register: Callable[[Any], None] | None = None) -> Iterator[tuple]:
        """``(outputs, error, final)`` of one BLS call, the last with ``final``; errors as
        ``(pb_utils code, message)``, never raised (Triton puts them in the response)."""
        try:
            calls = self.server_calls
            if calls is None:
                raise Unavailable(f"{self._who}: BLS needs a server; this instance has none")
            request, timeout_s = self._bls_request(spec)
            if not decoupled:
                response = calls.infer(request, timeout_s)
                yield {t.name: t.data for t in response.outputs}, None, True
                return
            stream = calls.infer_stream(request, timeout_s)
            if register is not None:
                register(stream)
            final = False
            try:
                for response in stream:
                    final = bool(response.final)
                    error = response.error
                    if error is not None:
                        yield None, _pb_error(error), final
                    else:
                        yield {t.name: t.data for t in response.outputs}, None, final
                    if final:
                        break
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            if not final:   # the stream ended without a final response: end it for the model
                yield None, None, True
        except Exception as err:
            if not isinstance(err, TritonError):
                log.exception("%s: BLS call failed", self._who)
            yield None, _pb_error(err), True

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
        batch = self._batch_requests
        depth = (self._bls_depth if batch is None
                 else max((getattr(r, "bls_depth", 0) for r in batch), default=0)) + 1
        request = InferRequest(model, version, id=request_id or "", inputs=tensors,
                               outputs=[RequestedOutput(n) for n in names] or None,
                               parameters=parameters, bls_depth=depth)
        # a traced caller's trace goes on in its BLS calls (engine/trace.py reads it)
        request.trace_parent = next((r.trace for r in batch if r.trace is not None), None)
        return request, (timeout_us / 1e6 if timeout_us else None)

    def _execute_in_worker(self, data: list[RequestData],
                           sinks: list[_Sink] | None = None) -> list | TritonError:
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
                f"python worker for {self._who} died ({describe_exit(err.exitcode)}) while "
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


__all__ = ["PythonBackend", "execution_mode", "triton_config_json"]
