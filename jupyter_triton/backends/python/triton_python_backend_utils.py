"""Triton's ``triton_python_backend_utils`` (``pb_utils``), the API a ``model.py`` imports.

Registered under its top-level name in every process that runs a ``model.py`` so that
Triton models run unchanged. Depends on numpy, the standard library and the protocol's
datatype table only: this module is what a model sees, so it must not drag the server in.
"""
from __future__ import annotations

import contextvars
import json
import logging
import threading
from typing import Any, Iterable

import numpy as np

from ...protocol.datatypes import DATATYPES

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2

# As Triton's pb_utils has them: no BF16 (numpy has no bfloat16), TYPE_BOOL as the builtin bool.
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    d.config: bool if d.name == "BOOL" else d.numpy.type
    for d in DATATYPES.values() if d.name != "BF16"}

# Triton's DataType enum values (model_config.proto), as pb_utils exposes them.
_TRITON_ENUM_TO_NUMPY: dict[int, Any] = {
    d.code: d.numpy.type for d in DATATYPES.values() if d.name != "BF16"}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _TRITON_ENUM_TO_NUMPY.get(data_type)


_NUMPY_TO_TRITON_ENUM: dict[np.dtype, int] = {
    np.dtype(t): code for code, t in _TRITON_ENUM_TO_NUMPY.items() if code != 13}


def numpy_to_triton_type(data_type: Any) -> int | None:
    dt = data_type if isinstance(data_type, np.dtype) else np.dtype(data_type)
    if dt.kind in "OS":
        return 13
    return _NUMPY_TO_TRITON_ENUM.get(dt)


class TritonError:
    """An error a model attaches to one response; ``code`` picks the status the client sees."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        self._msg = msg
        self._code = code

    def __str__(self) -> str:
        return self._msg

    def __repr__(self) -> str:
        return f"TritonError({self._msg!r}, code={self._code})"

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def __str__(self) -> str:
        return self._msg

    def message(self) -> str:
        return self._msg


class Tensor:
    """A named input or output tensor backed by a numpy array (CPU memory)."""

    # Slots, as Triton's own (pybind11) objects have no attribute dict either: every request
    # and response of every batch makes some.
    __slots__ = ("_name", "_triton_dtype", "_numpy_array", "__weakref__")

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None) -> None:
        # An ndarray of a Triton numeric type (what a model usually returns) needs no conversion.
        if triton_dtype is None and type(numpy_array) is np.ndarray:
            triton_dtype = _NUMPY_TO_TRITON_ENUM.get(numpy_array.dtype)
            if triton_dtype is not None:
                self._name = name
                self._triton_dtype = triton_dtype
                self._numpy_array = numpy_array
                return
        array = np.asarray(numpy_array)
        if array.dtype.kind == "U":
            # Triton refuses numpy unicode arrays: BYTES tensors are object arrays of bytes.
            array = np.vectorize(lambda s: s.encode("utf-8"), otypes=[np.object_])(array) \
                if array.size else array.astype(np.object_)
        if array.dtype.kind == "V":
            raise TritonModelException(
                f"Tensor '{name}': numpy dtype {array.dtype} is not supported by the Python "
                "backend; use np.object_ for BYTES")
        if triton_dtype is not None:
            np_type = triton_to_numpy_type(triton_dtype)
            if np_type is not None and array.dtype != np.dtype(np_type):
                array = array.view(np_type)
        else:
            triton_dtype = numpy_to_triton_type(array.dtype)
            if triton_dtype is None:
                raise TritonModelException(
                    f"Tensor '{name}': numpy dtype {array.dtype} has no Triton data type")
        self._name = name
        self._triton_dtype = triton_dtype
        self._numpy_array = array

    def name(self) -> str:
        return self._name

    def triton_dtype(self) -> int:
        return self._triton_dtype

    def as_numpy(self) -> np.ndarray:
        return self._numpy_array

    def shape(self) -> list[int]:
        return list(self._numpy_array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._numpy_array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor: Any) -> "Tensor":
        if hasattr(dlpack_tensor, "__dlpack__"):
            obj = dlpack_tensor
            if hasattr(obj, "detach"):   # a torch tensor, maybe on a GPU
                obj = obj.detach().cpu()
            return Tensor(name, np.from_dlpack(obj))
        import torch.utils.dlpack  # a bare capsule: torch is the usual producer
        return Tensor(name, torch.utils.dlpack.from_dlpack(dlpack_tensor).cpu().numpy())

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self._numpy_array.shape}, dtype={self._numpy_array.dtype})"


class InferenceRequest:
    """One request of a batch handed to ``execute``, or one a model builds to call another
    model (BLS: ``exec`` / ``async_exec``)."""

    __slots__ = ("_model_name", "_preferred_memory", "_inputs", "_requested_output_names", "_request_id",
                 "_correlation_id", "_model_version", "_flags", "_timeout", "_parameters",
                 "_response_sender", "__weakref__")

    def __init__(self, model_name: str = "", inputs: Iterable[Tensor] = (),
                 requested_output_names: Iterable[str] = (), request_id: str = "",
                 correlation_id: int | str = 0, model_version: int = -1, flags: int = 0,
                 timeout: int = 0, parameters: str | dict = "{}",
                 preferred_memory: "PreferredMemory | None" = None, **_: Any) -> None:
        # BLS examples pass a name read from a BYTES tensor; Triton takes it as text.
        if isinstance(model_name, (bytes, np.bytes_)):
            model_name = bytes(model_name).decode("utf-8")
        self._model_name = model_name
        self._preferred_memory = preferred_memory
        self._inputs = list(inputs)
        self._requested_output_names = list(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)
        # Set by the stub on the requests it hands to a decoupled model's execute.
        self._response_sender: InferenceResponseSender | None = None

    @classmethod
    def _of(cls, model_name: str, inputs: list[Tensor], requested_output_names: list[str],
            request_id: str, correlation_id: int | str, model_version: int, flags: int,
            parameters: str) -> "InferenceRequest":
        """The backend's own requests (a batch's, built for every request of every batch):
        the fields as they are, without the checks and conversions a model's arguments
        need; the output names are still the request's own list."""
        request = cls.__new__(cls)
        request._model_name = model_name
        request._preferred_memory = None
        request._inputs = inputs
        request._requested_output_names = list(requested_output_names)
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._model_version = model_version
        request._flags = flags
        request._timeout = 0
        request._parameters = parameters
        request._response_sender = None
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def parameters(self) -> str:
        return self._parameters

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def is_cancelled(self) -> bool:
        sender = self._response_sender
        return sender.is_cancelled() if sender is not None else False

    def get_response_sender(self) -> "InferenceResponseSender":
        if self._response_sender is None:
            # A default (non-decoupled) model may answer through a sender too (Triton 23.10+):
            # one response, kept here until execute returns None.
            self._response_sender = InferenceResponseSender(None, None, decoupled=False)
        return self._response_sender

    def exec(self, decoupled: bool = False) -> Any:
        """BLS: run this request on the server. Returns an ``InferenceResponse`` (an error is
        ``response.has_error()``, not an exception), or with ``decoupled=True`` an iterator
        of every response, the last one possibly empty (Triton's final flag)."""
        host = _BLS_HOST.get() or _default_bls_host
        if host is None:
            raise TritonModelException(
                "Unable to run the BLS request: no server to send it to (BLS works inside "
                "execute, and from the model's own threads in the default process mode)")
        return host.bls_exec(self, decoupled)

    def stream_exec(self) -> Any:
        """The older spelling of ``exec(decoupled=True)``."""
        return self.exec(decoupled=True)

    async def async_exec(self, decoupled: bool = False) -> Any:
        import asyncio
        host = _BLS_HOST.get() or _default_bls_host
        loop = asyncio.get_running_loop()
        # run_in_executor copies no context: carry the host over explicitly
        return await loop.run_in_executor(None, _exec_with_host, self, decoupled, host)


def _exec_with_host(request: InferenceRequest, decoupled: bool, host: Any) -> Any:
    token = _BLS_HOST.set(host)
    try:
        return request.exec(decoupled)
    finally:
        _BLS_HOST.reset(token)


class PreferredMemory:
    """Where a BLS call would like its outputs (CPU only here: accepted and noted)."""

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU,
                 preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceResponseSender:
    """``request.get_response_sender()``: where a decoupled model sends the responses of one
    request, from any thread, also after ``execute`` has returned, until it sends
    ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""

    def __init__(self, host: Any, key: Any, decoupled: bool = True) -> None:
        self._host = host
        self._key = key
        self._decoupled = decoupled
        self._closed = False
        self._cancelled = False
        self._lock = threading.Lock()
        self._sent = 0
        self._captured: InferenceResponse | None = None   # a non-decoupled model's one response

    def send(self, response: "InferenceResponse | None" = None, flags: int = 0) -> None:
        # Triton's checks and texts (python_backend response_sender.cc).
        if flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL and flags != 0:
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"Unable to send response. Expected an InferenceResponse, got {type(response).__name__}.")
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent > 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot "
                                               "send more than one response.")
                if response is None and final and self._sent == 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot "
                                               "send complete final before sending a response.")
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if final:
                self._closed = True
            self._sent += 1
            if not self._decoupled:
                if response is not None:
                    self._captured = response
                return
        self._host.respond(self._key, response, final)

    def is_cancelled(self) -> bool:
        if self._host is None:
            return False
        # Once cancelled, always cancelled: the server is asked only until it says so.
        if not self._cancelled and not self._closed:
            self._cancelled = bool(self._host.cancelled(self._key))
        return self._cancelled

    def __del__(self) -> None:
        # A request whose sender is dropped without COMPLETE_FINAL would stay open forever;
        # the host closes it at its next safe point (never from inside a finalizer).
        if not self._closed and self._host is not None:
            self._closed = True
            try:
                self._host.orphaned(self._key)
            except Exception:
                pass


# Where BLS calls go: the executing model's host (thread mode keeps several models in one
# process, so it is per context), else the process's one model (worker processes).
_BLS_HOST: contextvars.ContextVar[Any] = contextvars.ContextVar("pb_utils_bls_host", default=None)
_default_bls_host: Any = None


class InferenceResponse:
    __slots__ = ("_output_tensors", "_err", "_parameters", "__weakref__")

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: str | dict = "{}") -> None:
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        self._output_tensors = output_tensors
        self._err = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._err is not None

    def error(self) -> TritonError | None:
        return self._err

    def parameters(self) -> str:
        return self._parameters


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    for props in model_config.get("input", []):
        if props["name"] == name:
            return props
    return None


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    for props in model_config.get("output", []):
        if props["name"] == name:
            return props
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The object ``auto_complete_config`` receives and returns: the config as Triton's JSON,
    with setters that refuse to contradict what config.pbtxt already says."""

    _TENSOR_PROPERTIES = ("name", "data_type", "dims", "optional", "format", "is_shape_tensor",
                          "allow_ragged_batch", "reshape", "label_filename", "is_non_linear_format_io")

    def __init__(self, model_config: str | dict) -> None:
        self._model_config = json.loads(model_config) if isinstance(model_config, str) \
            else model_config
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict:
        return self._model_config

    def _name(self) -> str:
        return self._model_config.get("name", "")

    def max_batch_size(self) -> int:
        return int(self._model_config["max_batch_size"])

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config["max_batch_size"])
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}")
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._model_config.get(other):
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'")
        if not self._model_config.get("dynamic_batching"):
            self._model_config["dynamic_batching"] = {}

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model "
                    f"'{self._name()}' contains property other than 'decoupled'")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        want = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in policy and bool(policy["decoupled"]) != want:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._name()}', which is already set to {policy['decoupled']}")
        policy["decoupled"] = want

    def add_input(self, input: dict) -> None:
        self._add_tensor("input", input)

    def add_output(self, output: dict) -> None:
        self._add_tensor("output", output)

    def _add_tensor(self, kind: str, tensor: dict) -> None:
        model = self._name()
        if not isinstance(tensor, dict):
            raise ValueError(f"{kind} in auto-complete-config function for model '{model}' "
                             "must be a dict")
        if "name" not in tensor:
            raise ValueError(f"{kind} in auto-complete-config function for model '{model}' "
                             "is missing 'name' property.")
        name = tensor["name"]
        for prop in tensor:
            if prop not in self._TENSOR_PROPERTIES:
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model "
                                 f"'{model}' contains property '{prop}' which is not allowed")
        for prop in ("data_type", "dims"):
            if prop not in tensor:
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model "
                                 f"'{model}' is missing '{prop}' property.")
        tensor = dict(tensor, dims=[int(d) for d in tensor["dims"]])
        for current in self._model_config[kind]:
            if current["name"] != name:
                continue
            have_type = current.get("data_type", "TYPE_INVALID")
            if have_type != "TYPE_INVALID" and have_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype {have_type} "
                    f"for {kind} '{name}', model provides {tensor['data_type']}")
            have_dims = [int(d) for d in current.get("dims", [])]
            if have_dims and have_dims != tensor["dims"]:
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects dims {tensor['dims']} "
                    f"but the model configuration specifies dims {have_dims}")
            current.update(tensor)
            return
        self._model_config[kind].append(tensor)


class Logger:
    """``pb_utils.Logger.log_info(msg)`` and friends: into the server's log and the model's
    own log lines (``jupyter_triton.model_logs``, the server's); plain Python logging outside a
    server."""

    class LogLevel:
        INFO = logging.INFO
        WARNING = logging.WARNING
        ERROR = logging.ERROR
        VERBOSE = logging.DEBUG

    _log = logging.getLogger("jupyter_triton.python_backend.model")
    _NAMES = {logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
              logging.DEBUG: "VERBOSE"}

    @classmethod
    def log(cls, message: str, level: int = logging.INFO) -> None:
        host = _BLS_HOST.get() or _default_bls_host
        if host is not None:
            try:
                host.model_log(cls._NAMES.get(level, "INFO"), str(message))
                return
            except Exception:   # a server gone away: the line still goes somewhere
                pass
        cls._log.log(level, "%s", message)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, logging.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, logging.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, logging.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, logging.DEBUG)


LogLevel = Logger.LogLevel


def _host() -> Any:
    host = _BLS_HOST.get() or _default_bls_host
    if host is None:
        raise TritonModelException("custom metrics need a server: create them in initialize or "
                                   "execute of a served model")
    return host


# What a metric call sends is plain data, checked here in the model: a worker's message to
# the server carries nothing else (the server refuses it, and the worker with it), and Triton's
# API takes these as str, dict of str to str and list of float, so anything else is the
# model's TypeError, which it may catch.
def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    return str(value)     # a str subclass (numpy.str_) travels as plain text


def _labels(labels: Any, family: str) -> dict[str, str]:
    what = f"Error when creating Metric of family '{family}'"
    if not isinstance(labels, dict):
        raise TypeError(f"{what}: labels must be a dict of str to str, not {type(labels).__name__}")
    plain = {}
    for key, value in labels.items():
        key = _text(key, f"{what}: label name {key!r}")
        plain[key] = _text(value, f"{what}: the value of label {key!r}")
    return plain


def _buckets(buckets: Any, family: str) -> list[float]:
    what = f"Error when creating Metric of family '{family}': buckets"
    try:
        bounds = list(buckets)
    except TypeError:
        raise TypeError(f"{what} must be a list of float, not {type(buckets).__name__}") from None
    for bound in bounds:
        if isinstance(bound, (bool, str, bytes)) or not isinstance(bound, (int, float, np.integer, np.floating)):
            raise TypeError(f"{what} must be a list of float; {bound!r} is a {type(bound).__name__}")
    return [float(bound) for bound in bounds]


class MetricFamily:
    """A family of custom metrics, shown on the server's metrics endpoint (Triton's API)."""

    COUNTER = "COUNTER"
    GAUGE = "GAUGE"
    HISTOGRAM = "HISTOGRAM"

    def __init__(self, name: str, description: str, kind: str) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(
                f"Error when creating MetricFamily: unknown kind {kind!r} (use "
                "pb_utils.MetricFamily.COUNTER, GAUGE or HISTOGRAM)")
        name = _text(name, "Error when creating MetricFamily: name")
        description = _text(description, f"Error when creating MetricFamily '{name}': description")
        self._name = name
        self._kind = kind
        self._host = _host()
        self._host.metric_call("family", (name, description, kind.lower()), "Error when creating MetricFamily")

    def Metric(self, labels: dict[str, str] | None = None,
               buckets: list[float] | None = None) -> "Metric":
        return Metric(self, labels or {}, buckets)


class Metric:
    """One metric (a label set) of a ``MetricFamily``: ``increment``, ``set``, ``observe``,
    ``value`` as the family's kind allows."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self._family = family
        self._name = family._name
        self._kind = family._kind
        if self._kind == MetricFamily.HISTOGRAM and buckets is None:
            raise TritonModelException("Error when creating Metric: a HISTOGRAM metric needs buckets")
        labels = _labels(labels, self._name)
        if buckets is not None:
            buckets = _buckets(buckets, self._name)
        self._key = family._host.metric_call("metric", (self._name, labels, buckets),
                                             "Error when creating Metric")

    def increment(self, value: float) -> None:
        # Checked here so that the operation itself can travel without an answer.
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to increment metric value: a HISTOGRAM metric is "
                                       "updated with observe()")
        if self._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("Failed to increment metric value: a COUNTER can only be "
                                       "incremented by a non-negative value")
        self._family._host.metric_send("increment", (self._name, self._key, float(value)))

    def set(self, value: float) -> None:
        if self._kind != MetricFamily.GAUGE:
            raise TritonModelException(f"Failed to set metric value: only a GAUGE can be set, "
                                       f"this metric is a {self._kind}")
        self._family._host.metric_send("set", (self._name, self._key, float(value)))

    def observe(self, value: float) -> None:
        if self._kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(f"Failed to observe metric value: only a HISTOGRAM "
                                       f"observes, this metric is a {self._kind}")
        self._family._host.metric_send("observe", (self._name, self._key, float(value)))

    def value(self) -> float:
        return float(self._family._host.metric_call("value", (self._name, self._key),
                                                    "Failed to get metric value"))


# Older spellings of the kinds (examples/custom_metrics of Triton 22.x / 23.x)
COUNTER = MetricFamily.COUNTER
GAUGE = MetricFamily.GAUGE
HISTOGRAM = MetricFamily.HISTOGRAM
