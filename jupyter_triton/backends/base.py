"""The one interface every runtime implements, and the tensor-backend base class.

A backend instance is one model instance (one ``instance_group`` slot): it is created,
loaded, executed and unloaded by the engine, always off the event loop, one batch at a
time (the engine never calls ``execute`` or ``run`` concurrently on the same instance). A runtime whose
work runs in another process may also take a batch on the loop without blocking it
(``start_on_loop``).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Protocol

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import TritonError, Unavailable
from .ragged import RaggedPlan

if TYPE_CHECKING:
    from ..model_logs import ModelLogs
    from ..model_metrics import CustomMetrics

Tensors = dict[str, np.ndarray]


class BackendDead(Unavailable):
    """Raised by ``execute`` when an instance cannot serve again (a worker that keeps dying):
    the engine fails the batch and marks the model version UNAVAILABLE with this reason."""


@dataclass(frozen=True)
class InstanceSpec:
    """Where one instance runs: resolved from ``instance_group`` by the engine."""

    name: str                   # Triton's instance name, e.g. "mymodel_0_1"
    kind: str = "KIND_CPU"      # KIND_CPU or KIND_GPU (KIND_AUTO is resolved before this)
    device_id: int = 0          # GPU ordinal when kind is KIND_GPU
    index: int = 0


@dataclass
class ModelFiles:
    """What a backend needs to find its artifact."""

    model_name: str
    version: int
    model_dir: Path             # <repository>/<model>
    version_dir: Path           # <repository>/<model>/<version>
    default_filename: str = ""  # config.default_model_filename or the backend's default
    extra: dict[str, Any] = field(default_factory=dict)


class ResponseSender(Protocol):
    """Where a decoupled model's responses to one request go (made by the engine, one per
    request). Thread-safe: callable from any thread, also after ``execute_decoupled`` has
    returned, until a call with ``final=True``; a call after that raises ``TritonError``."""

    def send(self, outputs: Tensors | None = None, *, error: TritonError | None = None,
             final: bool = False) -> None:
        """One response (``outputs``), an error response (``error``), or neither: with
        ``final`` only, Triton's ``COMPLETE_FINAL`` flag without a response."""

    def is_cancelled(self) -> bool:
        """True once the client has gone away or the request was cancelled."""


class ServerCalls(Protocol):
    """The server's engine as a model sees it: BLS (a model calling other models), and where
    the model's own log lines and custom metrics go (that engine's, which its frontends show).
    Set by the engine on every backend instance before ``load`` (``Backend.server_calls``).
    Blocking; call from any thread except the server's event loop."""

    model_logs: "ModelLogs"
    custom_metrics: "CustomMetrics"

    def infer(self, request: Any, timeout_s: float | None = None) -> Any:
        """``InferRequest`` -> ``InferResponse``; raises ``TritonError``."""

    def infer_stream(self, request: Any, timeout_s: float | None = None) -> Iterator[Any]:
        """Every ``InferResponse`` of a decoupled (or any) model, the last with ``final``."""


class Backend:
    """One model instance on one runtime.

    ``execute`` receives the inputs of each request of a batch (already validated against
    the config, each with its own batch dimension when ``max_batch_size > 0``) and returns,
    per request, either its outputs or the ``TritonError`` that fails only that request.
    """

    #: names Triton uses for this runtime in config.pbtxt
    backend_name: ClassVar[str] = ""
    platforms: ClassVar[tuple[str, ...]] = ()
    default_filename: ClassVar[str] = ""

    #: True for runtimes that implement ``execute_decoupled``
    supports_decoupled: ClassVar[bool] = False

    #: (compute_input, compute_output) nanoseconds of the last ``execute``: the tensor
    #: copies in and out around the model, which Triton's statistics report apart from
    #: compute_infer. A backend that can tell them apart sets it in ``execute`` (a
    #: ``TensorBackend``: in ``run``).
    io_ns: tuple[int, int] = (0, 0)

    #: its batches execute in a process of its own (a python model's worker): while they
    #: do, the event loop may poll (engine/batching/busy_poll.py) without keeping a thread of this
    #: process from the GIL
    out_of_process: bool = False
    #: the engine's busy polling, set before ``load``: how long such a process may poll for
    #: its next batch (0: it sleeps at once)
    busy_poll_us: int = 0

    def __init__(self, config: mc.ModelConfig, files: ModelFiles, instance: InstanceSpec) -> None:
        self.config = config
        self.files = files
        self.instance = instance
        self.server_calls: ServerCalls | None = None

    @classmethod
    def auto_complete_config(cls, config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
        """Fill inputs/outputs/max_batch_size the way Triton's backend of this name does."""
        return config

    def load(self) -> None:
        raise NotImplementedError

    def execute(self, requests: list[Tensors],
                infer_requests: list | None = None) -> list[Tensors | TritonError]:
        """``infer_requests``: the InferRequest of each entry (ids, parameters, requested
        outputs), for runtimes that show them to the model (the python backend)."""
        raise NotImplementedError

    #: True where ``start_on_loop`` usually takes a batch
    executes_on_loop: ClassVar[bool] = False

    def start_on_loop(self, loop: asyncio.AbstractEventLoop,
                      done: Callable[[list | None, Callable[[], list] | None], None]) -> Any:
        """``execute`` with no thread waiting, for a runtime whose work runs elsewhere (a
        worker process). Called on the event loop ``loop``: returns a handle whose ``send(requests,
        infer_requests)``, called next on the loop, starts the batch without blocking;
        ``done(responses, None)`` then comes on the loop with what ``execute`` would return, or ``done(None,
        finish)`` where the outcome needs blocking work first (a dead worker to restart): the
        engine runs ``finish()`` on the instance's thread and its return or raise is the
        outcome. ``io_ns`` is set before ``done``. None: the engine calls ``execute`` on the
        instance's thread."""
        return None

    def execute_decoupled(self, requests: list[Tensors], infer_requests: list,
                          senders: list[ResponseSender]) -> None:
        """A decoupled model's batch (``model_transaction_policy { decoupled: true }``):
        returns when the model's execute has returned; the responses of request ``i`` go to
        ``senders[i]``, possibly later, from any thread. Raising ``TritonError`` fails every
        request whose sender is not yet closed. The instance is free again on return."""
        raise NotImplementedError

    def unload(self) -> None:
        pass


class TensorBackend(Backend):
    """A runtime that runs one merged batch (``run``: a dict of arrays in, a dict of arrays
    out). The engine merges a batch's requests for it and splits the outputs back per request
    (engine/batching/instances.py): concatenated on dim 0 and split by each request's rows, or,
    where requests may differ in shape (ragged inputs, batch inputs and outputs, padding), as
    its ``ragged`` plan says (backends/ragged.py)."""

    def __init__(self, config: mc.ModelConfig, files: ModelFiles, instance: InstanceSpec) -> None:
        super().__init__(config, files, instance)
        #: how requests that may differ in shape merge and split (None: they may not)
        self.ragged = RaggedPlan.from_config(config)

    def run(self, inputs: Tensors) -> Tensors:
        """One batch, its requests merged; may set ``io_ns`` to its own copies in and out
        (the engine adds them to its merge and split)."""
        raise NotImplementedError
