"""The model side of the python backend (Triton calls it the stub): imports ``model.py``,
runs ``TritonPythonModel``'s hooks, and turns pb_utils objects into plain data and back.

It runs inside a worker process by default, or in the server process in thread mode; it
neither knows nor cares which. Everything it returns is plain data (arrays, strings, ints).
"""
from __future__ import annotations

import importlib.util
import inspect
import queue
import re
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from . import triton_python_backend_utils as pb_utils
from .model_loop import ModelLoop

PB_UTILS_NAME = "triton_python_backend_utils"


def install_pb_utils() -> None:
    """Make ``import triton_python_backend_utils`` work the way it does under Triton."""
    sys.modules.setdefault(PB_UTILS_NAME, pb_utils)


@dataclass(slots=True)
class RequestData:
    """What ``pb_utils.InferenceRequest`` is built from."""

    inputs: dict[str, np.ndarray]
    request_id: str = ""
    correlation_id: int | str = 0
    parameters: str = "{}"
    requested_output_names: list[str] = field(default_factory=list)
    flags: int = 0


@dataclass
class ResponseError:
    """A response that carried ``error=pb_utils.TritonError(...)``, or a malformed one."""

    code: int           # pb_utils.TritonError code
    message: str


class DecoupledHost(Protocol):
    """Where a decoupled model's responses leave the stub: straight to the engine's senders
    (thread mode) or over the worker's socket (process mode)."""

    def respond(self, key: Any, response: "pb_utils.InferenceResponse | None", final: bool) -> None: ...

    def cancelled(self, key: Any) -> bool: ...

    def orphaned(self, key: Any) -> None:
        """Called from a finalizer: close ``key`` soon (``OrphanCloser``), not from here."""

    def flush(self) -> None:
        """Called after execute returns: a chance to close orphans synchronously."""


BlsSpec = tuple   # (model, version, {name: array}, output names, id, correlation id, flags, timeout us, parameters JSON)


def bls_spec(request: pb_utils.InferenceRequest) -> BlsSpec:
    """A BLS request as plain data (it crosses the worker's socket)."""
    version = request.model_version()
    return (request.model_name(), "" if version is None or int(version) < 0 else str(int(version)),
            {t.name(): t.as_numpy() for t in request.inputs()},
            list(request.requested_output_names()), request.request_id(),
            request.correlation_id(), request.flags(), request.timeout(), request.parameters())


def bls_response(outputs: dict[str, np.ndarray] | None, error: tuple[int, str] | None,
                 parameters: str = "{}") -> pb_utils.InferenceResponse:
    if error is not None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(error[1], error[0]))
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, array) for name, array in (outputs or {}).items()], parameters=parameters)


class OrphanCloser:
    """Closes the requests whose sender was dropped without COMPLETE_FINAL. A finalizer may
    run in any thread at any point, even inside a send holding its lock, so it only puts the
    key on a queue (``SimpleQueue.put`` is safe there); a thread of its own sends the finals."""

    def __init__(self, close: "Callable[[Any], None]") -> None:
        self._close = close
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, key: Any) -> None:
        self._queue.put(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="pb-orphan-closer")
            try:
                self._thread.start()
            except RuntimeError:   # interpreter shutting down
                pass

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            try:
                self._close(key)
            except Exception:
                pass


class StubError(Exception):
    """A hook failed: ``stage`` is import / initialize / execute / finalize / auto_complete_config."""

    def __init__(self, stage: str, message: str, tb: str = "", code: int = pb_utils.TritonError.INTERNAL) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.traceback = tb
        self.code = code

    def to_tuple(self) -> tuple[str, str, str, int]:
        return (self.stage, self.message, self.traceback, self.code)

    @classmethod
    def from_exception(cls, stage: str, err: BaseException) -> "StubError":
        code = err.code() if isinstance(err, pb_utils.TritonError) else pb_utils.TritonError.INTERNAL
        return cls(stage, f"{type(err).__name__}: {err}",
                   "".join(traceback.format_exception(err)), code)


def module_name(model_name: str, version: str, instance: str) -> str:
    # model.py files all share one name; thread mode keeps several in one interpreter.
    return "triton_model_" + re.sub(r"\W", "_", f"{model_name}_{version}_{instance}")


def import_model_class(model_py: str, name: str) -> type:
    """Import ``model_py`` the way Triton does (its version and model dirs on sys.path)."""
    install_pb_utils()
    path = Path(model_py)
    for extra in (path.parent, path.parent.parent):
        if str(extra) not in sys.path:
            sys.path.append(str(extra))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise AttributeError(f"{path.name} defines no class TritonPythonModel")
        return cls
    except BaseException as err:  # a model.py may raise anything, SystemExit included
        sys.modules.pop(name, None)
        raise StubError.from_exception("import", err) from None


def run_auto_complete_config(model_py: str, name: str, config_json: str) -> dict:
    """Call ``TritonPythonModel.auto_complete_config`` and return the completed config dict."""
    cls = import_model_class(model_py, name)
    hook = getattr(cls, "auto_complete_config", None)
    if hook is None:
        return pb_utils.ModelConfig(config_json).as_dict()
    try:
        result = hook(pb_utils.ModelConfig(config_json))
    except BaseException as err:
        raise StubError.from_exception("auto_complete_config", err) from None
    if not isinstance(result, pb_utils.ModelConfig):
        raise StubError("auto_complete_config",
                        "auto_complete_config must return the pb_utils.ModelConfig it was given, "
                        f"got {type(result).__name__}")
    return result.as_dict()


class ModelStub:
    """One ``TritonPythonModel`` object and the event loop its ``async def execute`` runs on
    (``model_loop``: it runs on between executes, so tasks execute started go on)."""

    def __init__(self, model_py: str, args: dict[str, str], bls_host: Any = None) -> None:
        self.args = args
        # Thread mode: several models share this process's pb_utils, so BLS finds its way
        # back through a context variable set around each execute.
        self.bls_host = bls_host
        self.model_name = args["model_name"]
        self.model_version = int(args.get("model_version") or -1)
        cls = import_model_class(
            model_py, module_name(args["model_name"], args["model_version"], args["model_instance_name"]))
        self._loop: ModelLoop | None = None
        token = pb_utils._BLS_HOST.set(bls_host) if bls_host is not None else None
        try:
            self.model = cls()
            init = getattr(self.model, "initialize", None)
            if init is not None:
                self._await(init(args))
        except BaseException as err:
            if self._loop is not None:   # no finalize will come to stop it
                self._loop.close()
            if isinstance(err, StubError):
                raise
            raise StubError.from_exception("initialize", err) from None
        finally:
            if token is not None:
                pb_utils._BLS_HOST.reset(token)

    def _await(self, result: Any) -> Any:
        if inspect.isawaitable(result):
            if self._loop is None:
                self._loop = ModelLoop(self.args.get("model_instance_name") or self.model_name)
            return self._loop.run(result)
        return result

    def _pb_requests(self, requests: list[RequestData]) -> list[pb_utils.InferenceRequest]:
        name, version, request, tensor = self.model_name, self.model_version, pb_utils.InferenceRequest._of, pb_utils.Tensor
        return [request(name, [tensor(n, a) for n, a in r.inputs.items()], r.requested_output_names,
                        r.request_id, r.correlation_id, version, r.flags, r.parameters)
                for r in requests]

    def execute(self, requests: list[RequestData]) -> list[dict[str, np.ndarray] | ResponseError]:
        pb_requests = self._pb_requests(requests)
        token = pb_utils._BLS_HOST.set(self.bls_host) if self.bls_host is not None else None
        try:
            responses = self.model.execute(pb_requests)
            if type(responses) is not list:   # a list, the usual answer, is not awaitable
                responses = self._await(responses)
        except BaseException as err:
            raise StubError.from_exception("execute", err) from None
        finally:
            if token is not None:
                pb_utils._BLS_HOST.reset(token)
        if responses is None:   # answered through response senders (Triton 23.10+)
            return [self._sent_response(r) for r in pb_requests]
        if not isinstance(responses, (list, tuple)):
            raise StubError("execute", "execute() must return a list of pb_utils.InferenceResponse, "
                            f"got {type(responses).__name__}")
        if len(responses) != len(requests):
            raise StubError(
                "execute", "Number of InferenceResponse objects do not match number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, and "
                f"InferenceResponse(s) size is:{len(responses)}")
        return [self._response_data(r) for r in responses]

    def execute_decoupled(self, requests: list[RequestData], keys: list[Any], host: "DecoupledHost") -> None:
        """A decoupled model's batch: request ``i`` answers through ``host`` under ``keys[i]``,
        from any thread, until its sender sends COMPLETE_FINAL (or is dropped unsent, which
        closes it: a request nobody can answer any more must not stay open)."""
        pb_requests = self._pb_requests(requests)
        for i, key in enumerate(keys):
            pb_requests[i]._response_sender = pb_utils.InferenceResponseSender(host, key)
        token = pb_utils._BLS_HOST.set(self.bls_host) if self.bls_host is not None else None
        try:
            result = self._await(self.model.execute(pb_requests))
        except BaseException as err:
            raise StubError.from_exception("execute", err) from None
        finally:
            if token is not None:
                pb_utils._BLS_HOST.reset(token)
            del pb_requests   # senders the model did not keep close now, and flush sends them
            host.flush()
        if result is not None:
            raise StubError("execute", f"Python model '{self.model_name}' is using the decoupled mode "
                            "and the execute function must return None.")

    @classmethod
    def _sent_response(cls, request: pb_utils.InferenceRequest) -> dict[str, np.ndarray] | ResponseError:
        sender = request._response_sender
        if sender is None or sender._captured is None:
            return ResponseError(pb_utils.TritonError.INTERNAL,
                                 "execute() returned None but sent no response for the request "
                                 f"'{request.request_id()}' through its response sender")
        return cls._response_data(sender._captured)

    @staticmethod
    def response_data(response: Any) -> dict[str, np.ndarray] | ResponseError:
        return ModelStub._response_data(response)

    @staticmethod
    def _response_data(response: Any) -> dict[str, np.ndarray] | ResponseError:
        if not isinstance(response, pb_utils.InferenceResponse):
            return ResponseError(pb_utils.TritonError.INTERNAL,
                                 f"execute() returned a {type(response).__name__} where a "
                                 "pb_utils.InferenceResponse was expected")
        err = response.error()
        if err is not None:
            code = err.code() if isinstance(err, pb_utils.TritonError) else pb_utils.TritonError.INTERNAL
            return ResponseError(code, str(err))
        outputs = {}
        for tensor in response.output_tensors():
            if not isinstance(tensor, pb_utils.Tensor):
                return ResponseError(pb_utils.TritonError.INTERNAL,
                                     f"output_tensors holds a {type(tensor).__name__} where a "
                                     "pb_utils.Tensor was expected")
            outputs[tensor.name()] = tensor.as_numpy()
        return outputs

    def finalize(self) -> None:
        try:
            fin = getattr(self.model, "finalize", None)
            if fin is not None:
                self._await(fin())
        except BaseException as err:
            raise StubError.from_exception("finalize", err) from None
        finally:
            if self._loop is not None:   # tasks the model left pending are cancelled
                self._loop.close()
                self._loop = None
