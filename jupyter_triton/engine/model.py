"""One loaded version of a model: its instances, its scheduler, its statistics, its state,
and its config as each request meets it: the inputs a request is checked against before it
is queued (``InputPlan``), the outputs its response is built from (``OutputPlan``)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..backends import InstanceSpec, ModelFiles, backend_class
from ..backends.base import BackendDead
from ..backends.devices import resolve_kind
from ..backends.signature import int_parameter
from ..config.padding import padding
from ..protocol.datatypes import config_to_triton, triton_to_numpy
from ..protocol.errors import Internal, InvalidArgument, TritonError, Unavailable, Unsupported
from ..protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput
from ..repository.identity import VersionIdentity
from .batching.batcher import DynamicBatcher
from .classification import classify
from .composition.bls import Bls
from .batching.busy_poll import BusyPoll
from .composition.ensemble import BACKEND as ENSEMBLE_BACKEND, EnsembleScheduler, InferFn, LookupConfig, plan
from .batching.instances import Instance, InstancePool, run_in_daemon_thread
from .lifecycle.memory import LoadProbe
from .batching.rate_limiter import RateLimiter, instance_resources
from .batching.pending import Pending
from .batching.scheduler import DirectScheduler, Scheduler
from .composition.sequence import SequenceBatcher, check_supported
from .observation.statistics import ModelStatistics, failure_reason, mark_failure
from .composition.streaming import (DEFAULT_MAX_BUFFERED, DEFAULT_MAX_OPEN_STREAMS, ResponseStream,
                        decoupled_refusal)
from .lifecycle.warmup import warm_up

log = logging.getLogger(__name__)

# Triton's model states
UNAVAILABLE, LOADING, READY, UNLOADING = "UNAVAILABLE", "LOADING", "READY", "UNLOADING"


@dataclass
class VersionStatus:
    state: str
    reason: str = ""


def instance_specs(config: mc.ModelConfig) -> list[tuple[InstanceSpec, mc.ModelInstanceGroup | None]]:
    """Expand instance_group the way Triton does: count instances per listed GPU (or count
    instances on the CPU), named <group>_<i>; each with the group it came from."""
    specs: list[tuple[InstanceSpec, mc.ModelInstanceGroup | None]] = []
    for g, group in enumerate(config.instance_group):
        kind = resolve_kind(mc.ModelInstanceGroup.Kind.Name(group.kind))
        group_name = group.name or f"{config.name}_{g}"
        count = group.count or 1
        devices = list(group.gpus) if kind == "KIND_GPU" and group.gpus else [0] if kind == "KIND_GPU" else [None]
        i = 0
        for device in devices:
            for _ in range(count):
                specs.append((InstanceSpec(name=f"{group_name}_{i}", kind=kind,
                                           device_id=device or 0, index=len(specs)), group))
                i += 1
    if not specs:
        specs.append((InstanceSpec(name=f"{config.name}_0_0", kind=resolve_kind("KIND_AUTO")), None))
    return specs


# ---- the config as each request meets it -----------------------------------------------

MAX_DIM = 1 << 32      # the codecs' element limit: no dimension of a real tensor exceeds it

_BATCH_NOTE = (". NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
               "dimension to be prepended to each input shape. If you want to specify the full "
               "shape including the batch dim in your input dims config, try setting "
               "max_batch_size to zero. See the model configuration docs for more info on "
               "max_batch_size.")


class InputPlan:
    """A version's inputs as each request is checked against them, with Triton's error text,
    before the request is queued: a bad request never reaches a batch (and never fails the
    good requests batched with it). Computed once per loaded version (protobuf field access
    and enum names cost microseconds on every request otherwise)."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.model = config.name
        self.max_batch_size = config.max_batch_size
        self.expected = {i.name: i for i in config.input}
        self.required = [n for n, i in self.expected.items() if not i.optional]
        self.datatypes = {i.name: config_to_triton(mc.DataType.Name(i.data_type)) for i in config.input}
        self.dims = {i.name: list(i.dims) for i in config.input}
        lead = [-1] if config.max_batch_size > 0 else []
        self.full = {name: lead + dims for name, dims in self.dims.items()}
        self.reshape = {i.name: list(i.reshape.shape) for i in config.input if i.HasField("reshape")}
        self.known_outputs = frozenset(o.name for o in config.output)
        # ragged_batching "pad" with max_length (config/padding.py): input -> (its length
        # dimension, the longest length it may have)
        pad = padding(config)
        self.max_length = ({name: (axis, pad.max_length) for name, axis in pad.axes.items()}
                           if pad is not None and pad.max_length else {})
        # (name, datatype, shape) of inputs found valid -> their batch rows (0: unbatched):
        # clients repeat a few shapes, each checked once (bounded: shapes come from clients).
        self.accepted: dict[tuple, int] = {}

    def check(self, request: InferRequest) -> tuple[dict[str, np.ndarray], int]:
        """The backend's input dict (reshaped where the config says so) and the request's
        batch size; raises InvalidArgument."""
        model = self.model
        expected = self.expected
        given = {t.name: t for t in request.inputs}
        for name in given:
            if name not in expected:
                raise InvalidArgument(f"unexpected inference input '{name}' for model '{model}'")
        for required in self.required:      # (a loop: any() over a generator costs more)
            if required not in given:
                missing = [n for n, i in expected.items() if n not in given and not i.optional]
                raise InvalidArgument(
                    f"{_rid(request)}expected {len(expected)} inputs but got {len(given)} inputs "
                    f"for model '{model}'. Got input(s) {sorted(given)}, but missing required "
                    f"input(s) {missing}. Please provide all required input(s).")
        max_batch_size = self.max_batch_size
        batch = 0
        inputs: dict[str, np.ndarray] = {}
        accepted = self.accepted
        for name, tensor in given.items():
            key = (name, tensor.datatype, tensor.shape) if type(tensor.shape) is tuple else None
            rows = accepted.get(key) if key is not None else None
            if rows is None:
                rows = self._check_input(request, name, tensor, batch)
                if key is not None:
                    if len(accepted) >= 64:
                        accepted.clear()
                    accepted[key] = rows
            elif batch and rows != batch:
                raise _disagree(model, name, rows, batch)
            batch = rows
            data = tensor.data
            target = self.reshape.get(name)
            if target is not None:
                lead = [batch] if max_batch_size > 0 else []
                data = data.reshape(lead + target)
            inputs[name] = data
        known_outputs = self.known_outputs
        for out in request.outputs or ():
            if out.name not in known_outputs:
                raise InvalidArgument(f"unexpected inference output '{out.name}' for model '{model}'")
        return inputs, (batch if max_batch_size > 0 else 1)

    def _check_input(self, request: InferRequest, name: str, tensor: InferTensor, batch: int) -> int:
        """Raise unless ``tensor`` fits input ``name``; its batch rows (0: unbatched model).
        ``batch``: the rows of the inputs checked before it (0: none)."""
        model, max_batch_size = self.model, self.max_batch_size
        want = self.datatypes[name]
        if tensor.datatype != want:
            raise InvalidArgument(
                f"{_rid(request)}inference input '{name}' data-type is '{tensor.datatype}', but "
                f"model '{model}' expects '{want}'")
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 or d > MAX_DIM for d in shape):
            # requests made in-process (ensemble steps, python models' BLS) skip the codecs'
            # checks: an absurd dimension must still be a 400, not numpy's error later
            raise InvalidArgument(
                f"input '{name}' of model '{model}' has shape {_fmt(shape)}: each dimension "
                f"must be between 0 and {MAX_DIM}")
        if max_batch_size > 0:
            if not shape:
                raise InvalidArgument(
                    f"inference input '{name}' of model '{model}' has no batch dimension; "
                    f"expected shape {_fmt([-1] + self.dims[name])}")
            rows = shape[0]
            if batch and rows != batch:
                raise _disagree(model, name, rows, batch)
            if rows < 1 or rows > max_batch_size:
                raise InvalidArgument(
                    f"{_rid(request)}inference request batch-size must be <= {max_batch_size} "
                    f"for '{model}'" if rows > 0 else
                    f"{_rid(request)}inference request batch-size must be >= 1 for '{model}'")
        full = self.full[name]
        if not _matches(shape, full):
            raise InvalidArgument(
                f"{_rid(request)}unexpected shape for input '{name}' for model '{model}'. "
                f"Expected {_fmt(full)}, got {_fmt(shape)}" + (_BATCH_NOTE if max_batch_size > 0 else ""))
        limit = self.max_length.get(name)
        if limit is not None and shape[limit[0]] > limit[1]:
            raise InvalidArgument(
                f"{_rid(request)}input '{name}' of model '{model}' has length {shape[limit[0]]} "
                f"(shape {_fmt(shape)}), longer than the model allows: max_length {limit[1]}")
        return shape[0] if max_batch_size > 0 else 0


class OutputPlan:
    """A version's outputs as each response is built from what its backend returned: only
    the requested outputs, in the config's datatypes, with Triton's classification extension
    (engine/classification.py). Computed once per loaded version.

    ``max_output_size`` (bytes, 0: no bound): outputs together larger than this fail the
    request with Unavailable before anything is encoded."""

    def __init__(self, config: mc.ModelConfig, version: int, model_dir: Path,
                 max_output_size: int = 0) -> None:
        self.model = config.name
        self.version = str(version)
        self.model_dir = model_dir
        self.max_output_size = max_output_size
        self.names = [o.name for o in config.output]
        self.by_name = {o.name: o for o in config.output}
        self.datatypes = {o.name: config_to_triton(mc.DataType.Name(o.data_type)) for o in config.output}
        self.dtypes = {name: triton_to_numpy(dt) for name, dt in self.datatypes.items()}
        self.reshape = {o.name: list(o.dims) for o in config.output if o.HasField("reshape")}
        self.batched = config.max_batch_size > 0

    def build(self, request: InferRequest, outputs: dict[str, np.ndarray]) -> InferResponse:
        model = self.model
        max_output_size = self.max_output_size
        wanted = request.outputs
        tensors = []
        total = 0
        for item in self.names if wanted is None else wanted:
            if wanted is None:
                name, params = item, None
            else:
                name, params = item.name, item.parameters
            if name not in outputs:
                raise Internal(f"model '{model}' did not produce output '{name}'")
            datatype = self.datatypes[name]
            value = outputs[name]
            if type(value) is not np.ndarray:
                value = np.asarray(value)
            dims = self.reshape.get(name)
            if dims is not None and value.ndim:
                lead = [value.shape[0]] if self.batched else []
                value = value.reshape(lead + dims)
            want = self.dtypes[name]
            if value.dtype is not want and value.dtype != want:
                value = value.astype(want)
            k = int(params.get("classification", 0) or 0) if params else 0
            if k:
                value, datatype = classify(value, k, self.batched, self.model_dir, self.by_name[name])
            if max_output_size:
                total += _nbytes(value)
                if total > max_output_size:
                    raise Unavailable(
                        f"model '{model}' returned outputs larger than the server's limit of "
                        f"{max_output_size} bytes (at output '{name}'); the limit is the engine "
                        f"option max_output_size")
            tensors.append(InferTensor(name, datatype, value.shape, value))
        return InferResponse(model, self.version, request.id, tensors)


def _fmt(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _matches(shape: tuple[int, ...], dims: list[int]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims))


def _rid(request: InferRequest) -> str:
    # tritonserver 2.51 opens its request-validation errors with the request's id
    return f"[request id: {request.id or '<id_unknown>'}] "


def _nbytes(value: np.ndarray) -> int:
    if value.dtype != object:
        return int(value.nbytes)
    # BYTES: what the wire carries, a 4-byte length and the bytes of each element
    return sum(4 + (len(v) if isinstance(v, (bytes, str)) else 8) for v in value.flat)


def _disagree(model: str, name: str, rows: int, batch: int) -> InvalidArgument:
    return InvalidArgument(
        f"inputs of model '{model}' disagree on the batch size: input '{name}' has "
        f"{rows}, another input has {batch}")


# ---- one loaded version ---------------------------------------------------------------

class ModelVersion:
    # engine/cache.py's ModelCache when the config enables the server's response cache
    response_cache = None

    def __init__(self, config: mc.ModelConfig, backend: str, version: int, model_dir: Path,
                 rate_limiter: RateLimiter | None = None,
                 ensemble: tuple[LookupConfig, InferFn] | None = None, *,
                 max_output_size: int = 0, server_calls: Bls | None = None,
                 busy_poll: BusyPoll | None = None,
                 identity: VersionIdentity | None = None) -> None:
        self.config = config
        # what this version is (number, files, config), as the repository minted it when the
        # lifecycle read it: a reload keeps a version whose identity is unchanged, and the
        # response cache keys its answers on it (repository/identity.py). None: not read
        # from a repository (a test's own version)
        self.identity = identity
        # model_transaction_policy { decoupled: true }: zero or more responses per request,
        # only through infer_stream
        self.decoupled = bool(config.model_transaction_policy.decoupled)
        self.server_calls = server_calls      # BLS: how this model's backends call other models
        self.max_buffered = DEFAULT_MAX_BUFFERED
        self.max_open_streams = DEFAULT_MAX_OPEN_STREAMS
        self.max_output_size = max_output_size
        # the engine's (--busy-poll-us): a request's arrival keeps the loop polling. Only
        # for models that execute in processes of their own (load), and not decoupled ones:
        # their responses come through a thread of this process, which a polling loop
        # would keep from the GIL.
        self.busy_poll = busy_poll if not self.decoupled else None
        self.ensemble = ensemble      # an ensemble's ways to see and run its composing models
        self.name = config.name
        self.version = version
        self.backend_name = backend
        self.model_dir = model_dir
        self.rate_limiter = rate_limiter
        self.stats = ModelStatistics(self.name, str(version))
        self._inputs = InputPlan(config)
        self._outputs = OutputPlan(config, version, model_dir, max_output_size)
        self.status = VersionStatus(LOADING)
        self.pool: InstancePool | None = None
        self.scheduler: Scheduler | None = None
        self.load_seconds = 0.0
        self._inflight = 0
        self._futures: set[asyncio.Future] = set()     # unload fails what a hung model holds
        self._loop: asyncio.AbstractEventLoop | None = None    # the loop that serves it (infer)
        self._streams: set[ResponseStream] = set()     # ... and ends the streams still open
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def pending_count(self) -> int:
        """Triton's pending requests: queued, not yet handed to an instance."""
        return self.stats.pending

    @property
    def ready(self) -> bool:
        return self.status.state == READY

    @property
    def idle(self) -> bool:
        """Nothing queued, executing or streaming: what unload drains (an eviction waits
        for it)."""
        return not self._inflight and not self.stats.pending and not self._streams

    async def wait_idle(self) -> None:
        """Until no request is in flight (a new one may come right after)."""
        await self._idle.wait()

    async def load(self) -> None:
        """Create and load every instance off the loop, warm them up, then start scheduling."""
        start = time.monotonic()
        if self.backend_name == ENSEMBLE_BACKEND:     # no instances: steps run on composing models
            lookup, infer = self.ensemble
            steps = plan(self.config, lookup)
            if any(step.decoupled for step in steps) and not self.decoupled:
                # tritonserver (ValidateEnsembleConfig) makes an ensemble with a streaming
                # step decoupled itself; its config then says so, as Triton's does
                self.decoupled = True
                self.config.model_transaction_policy.decoupled = True
            self.scheduler = EnsembleScheduler(self.config, steps, infer, self.stats)
            self.busy_poll = None      # each step's model polls, or not, for its own requests
            self.status = VersionStatus(READY)
            return
        if self.config.HasField("sequence_batching"):
            check_supported(self.config, self.model_dir)
        cls = backend_class(self.backend_name)
        if self.decoupled and not cls.supports_decoupled:
            raise Unsupported(
                f"failed to load '{self.name}' version {self.version}: the {self.backend_name} "
                f"backend does not support models with decoupled transaction policy "
                f"(model_transaction_policy {{ decoupled: true }})")
        if self.decoupled:
            # how far a model's responses may run ahead of a slow client before it waits
            self.max_buffered = self._positive_parameter("max_buffered_responses",
                                                         DEFAULT_MAX_BUFFERED)
            # streams open at once (queued, executing, or still sending after execute
            # returned); the scheduler's queue bound does not see the last kind
            self.max_open_streams = self._positive_parameter("max_open_streams",
                                                             DEFAULT_MAX_OPEN_STREAMS)
        files = ModelFiles(self.name, self.version, self.model_dir, self.model_dir / str(self.version),
                           self.config.default_model_filename or cls.default_filename)
        loop = asyncio.get_running_loop()
        calls = self.server_calls.for_model(self.name) if self.server_calls is not None else None

        def make(spec: InstanceSpec, group: mc.ModelInstanceGroup | None) -> Instance:
            backend = cls(self.config, files, spec)
            backend.server_calls = calls
            if self.busy_poll is not None:
                backend.busy_poll_us = self.busy_poll.worker_window_us(self.config)
            backend.load()
            instance = Instance(backend)
            if (group is not None and group.HasField("rate_limiter") and self.rate_limiter is not None
                    and self.rate_limiter.enabled):
                instance.resources = instance_resources(group, spec.device_id)
                instance.rate_priority = group.rate_limiter.priority
                self.rate_limiter.register(instance.resources, self.name)
            return instance

        probe = LoadProbe()
        results = await asyncio.gather(
            *(loop.run_in_executor(None, make, spec, group) for spec, group in instance_specs(self.config)),
            return_exceptions=True)
        instances = [r for r in results if isinstance(r, Instance)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for inst in instances:
                await loop.run_in_executor(None, inst.close)
            raise errors[0]
        if not all(inst.backend.out_of_process for inst in instances):
            self.busy_poll = None    # a polling loop would keep its instance threads from the GIL
        self.pool = InstancePool(instances, self.stats, self.rate_limiter)
        self.pool.decoupled = self.decoupled
        try:
            self.stats.record_warmup(await warm_up(self.config, self.model_dir, instances,
                                                   self.decoupled))
        except BaseException:
            await loop.run_in_executor(None, self.pool.close)   # no worker outlives a failed load
            raise
        self.stats.memory = probe.finish([inst.backend for inst in instances])
        if self.config.HasField("sequence_batching"):
            self.scheduler = SequenceBatcher(self.config, self.pool, self.stats, self.model_dir)
        else:
            self.scheduler = (DynamicBatcher(self.config, self.pool, self.stats)
                              if self.config.HasField("dynamic_batching") else DirectScheduler(self.pool, self.config))
            if self.busy_poll is not None and isinstance(self.scheduler, DynamicBatcher):
                self.scheduler.on_wait = self.busy_poll.rest
        self.load_seconds = time.monotonic() - start
        self.stats.load_seconds = self.load_seconds
        self.status = VersionStatus(READY)

    async def infer(self, request: InferRequest) -> InferResponse:
        if self.status.state != READY or self.scheduler is None:
            raise Unavailable(f"Request for unknown model: '{self.name}' version {self.version} is not at ready state")
        if self.decoupled:
            raise decoupled_refusal(self.name, self.version)
        start = time.monotonic_ns()
        try:
            inputs, rows = self._inputs.check(request)
            priority, timeout_ns = _schedule_params(request) if request.parameters else (0, 0)
        except TritonError as err:          # Triton counts refused requests too (reason OTHER)
            self.stats.record_failure(failure_reason(err), time.monotonic_ns() - start)
            raise
        # its engine's one loop, held (get_running_loop() is a getpid() syscall a call on
        # Python 3.11)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        busy_poll = self.busy_poll
        if busy_poll is not None:
            busy_poll.touch(loop)
        future = loop.create_future()
        pending = Pending(request, inputs, rows, future, priority=priority, timeout_ns=timeout_ns)
        self._inflight += 1
        self._futures.add(future)
        self.stats.pending += 1
        self._idle.clear()
        try:
            await self.scheduler.submit(pending)
            outputs = await future
            response = self._outputs.build(request, outputs)
        except asyncio.CancelledError as err:
            future.cancel()
            self.stats.record_failure(failure_reason(err), time.monotonic_ns() - start)
            raise
        except TritonError as err:
            if isinstance(err, BackendDead):
                self.status = VersionStatus(UNAVAILABLE, str(err))
            self.stats.record_failure(failure_reason(err), time.monotonic_ns() - start)
            raise
        finally:
            if busy_poll is not None:
                busy_poll.left()
            self._inflight -= 1
            self._futures.discard(future)
            if not pending.started:
                self.stats.pending -= 1
            if not self._inflight:
                self._idle.set()
        self.stats.record_success(time.monotonic_ns() - start)
        return response

    def _build(self, request: InferRequest, outputs: dict) -> InferResponse:
        if request.outputs is None and len(outputs) < len(self._outputs.names):
            # a response without some outputs nobody asked for by name: it carries the ones
            # the model sent, as Triton's do (a decoupled model's responses often differ)
            request = dataclasses.replace(request, outputs=[
                RequestedOutput(name) for name in self._outputs.names if name in outputs])
        return self._outputs.build(request, outputs)

    def _positive_parameter(self, key: str, default: int) -> int:
        value = int_parameter(self.config, key)
        if value is not None and value < 1:
            raise InvalidArgument(f"model '{self.name}': parameter '{key}' must be 1 or more, "
                                  f"got {value}")
        return value or default

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Every response of ``request``, the last with ``final``. A non-decoupled model's
        one response (its errors raise, as from ``infer``). A decoupled model's refusals
        (validation, a full queue) raise on the first ``__anext__``; what goes wrong later
        (execute raising, its worker dying, unload) is the final response's ``error``.
        Closing the iterator early cancels the request: its sender's ``is_cancelled()``."""
        if not self.decoupled:
            yield await self.infer(request)
            return
        if self.status.state != READY or self.scheduler is None:
            raise Unavailable(f"Request for unknown model: '{self.name}' version {self.version} is not at ready state")
        start = time.monotonic_ns()
        try:
            inputs, rows = self._inputs.check(request)
            priority, timeout_ns = _schedule_params(request) if request.parameters else (0, 0)
            if len(self._streams) >= self.max_open_streams:
                raise mark_failure(Unavailable(
                    f"Exceeds maximum open streams: model '{self.name}' already has "
                    f"{len(self._streams)} requests open (max_open_streams "
                    f"{self.max_open_streams})"), "REJECTED")
        except TritonError as err:
            self.stats.record_failure(failure_reason(err), time.monotonic_ns() - start)
            raise
        loop = asyncio.get_running_loop()
        stream = ResponseStream(loop, request, self._build, self.stats, start, self.max_buffered,
                                str(self.version))
        future = loop.create_future()
        future.add_done_callback(functools.partial(self._executed, stream, start))
        pending = Pending(request, inputs, rows, future, priority=priority, timeout_ns=timeout_ns,
                          stream=stream)
        self._inflight += 1
        self._futures.add(future)
        self._streams.add(stream)
        self.stats.pending += 1
        self._idle.clear()
        try:
            await self.scheduler.submit(pending)
            while True:
                response = await stream.get()
                if response.final:
                    break
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # the reader went away (aclose, a cancelled task): the model sees is_cancelled()
            stream.cancel()
            future.cancel()                 # counted CANCELED by _executed
            raise
        except TritonError as err:          # refused by the scheduler: nothing ran
            stream.cancel()
            self.stats.record_failure(failure_reason(err), time.monotonic_ns() - start)
            raise
        finally:
            self._inflight -= 1
            self._futures.discard(future)
            self._streams.discard(stream)
            if not pending.started:
                self.stats.pending -= 1
            if not self._inflight:
                self._idle.set()
        if isinstance(response.error, BackendDead):
            self.status = VersionStatus(UNAVAILABLE, str(response.error))
        yield response

    def _executed(self, stream: ResponseStream, start: int, future: asyncio.Future) -> None:
        """A decoupled request's execute ended. Counted as Triton counts it: by how execute
        ended (success though some responses were errors, or come later), from arrival to
        then. If it failed (execute raised, the worker died, unload gave up on it), the
        stream ends with that error unless the model already sent its final response."""
        ns = time.monotonic_ns() - start
        if future.cancelled():
            self.stats.record_failure("CANCELED", ns)
            return
        err = future.exception()
        if err is None:
            self.stats.record_success(ns)
            return
        self.stats.record_failure(failure_reason(err), ns)
        if isinstance(err, BackendDead):
            self.status = VersionStatus(UNAVAILABLE, str(err))
        stream.close(err if isinstance(err, TritonError) else Internal(f"{type(err).__name__}: {err}"))

    async def unload(self, drain_seconds: float = 30.0, close_seconds: float = 5.0) -> None:
        """Let requests in flight finish (bounded), then free the instances (bounded).

        A thread-mode backend stuck in execute cannot be killed: past the bounds its
        requests fail with Unavailable, the stuck thread is left behind (a daemon thread,
        so it does not hold the process at exit) and unloading moves on."""
        self.status = VersionStatus(UNLOADING)
        if self.response_cache is not None:
            self.response_cache.forget()    # its cached answers go with it (engine/cache.py)
        if isinstance(self.scheduler, SequenceBatcher):
            self.scheduler.unloading()      # a backlogged sequence would hold the drain
        try:
            await asyncio.wait_for(self._idle.wait(), drain_seconds)
        except asyncio.TimeoutError:
            log.warning("unloading %s v%s: %d requests still in flight after %.1f s; failing them",
                        self.name, self.version, self._inflight, drain_seconds)
            error = Unavailable(f"model '{self.name}' version {self.version} was unloaded before "
                                f"the request finished (it ran past {drain_seconds:g} s)")
            for future in list(self._futures):
                if not future.done():
                    future.set_exception(error)
            for stream in list(self._streams):
                stream.close(error)
        if self.scheduler is not None:
            await self._bounded(asyncio.ensure_future(self.scheduler.close()), close_seconds,
                                "stopping its scheduler")
        if self.pool is not None:
            await self._bounded(run_in_daemon_thread(self.pool.close), close_seconds,
                                "closing its instances")
        self.status = VersionStatus(UNAVAILABLE, "unloaded")

    async def _bounded(self, future: asyncio.Future, seconds: float, what: str) -> None:
        done, _ = await asyncio.wait({future}, timeout=max(seconds, 0.05))
        if not done:
            log.error("unloading %s v%s: %s did not finish within %.1f s (a hung model?); "
                      "moving on", self.name, self.version, what, seconds)
        elif not future.cancelled() and future.exception() is not None:
            log.error("unloading %s v%s: %s failed: %r", self.name, self.version, what,
                      future.exception())


def _schedule_params(request: InferRequest) -> tuple[int, int]:
    """Triton's schedule_policy extension: request parameters 'priority' and 'timeout' (us)."""
    params = request.parameters
    try:
        priority = int(params.get("priority", 0) or 0)
        timeout_us = int(params.get("timeout", 0) or 0)
    except (TypeError, ValueError):
        raise InvalidArgument("request parameters 'priority' and 'timeout' must be integers") from None
    if priority < 0 or timeout_us < 0:
        raise InvalidArgument("request parameters 'priority' and 'timeout' must not be negative")
    return priority, timeout_us * 1000

