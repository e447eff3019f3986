"""One loaded version of a model: its instances, its scheduler, its statistics, its state."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from tritonclient.grpc import model_config_pb2 as mc

from ..backends import InstanceSpec, ModelFiles, backend_class
from ..backends.base import BackendDead
from ..backends.devices import resolve_kind
from ..backends.signature import int_parameter
from ..protocol.errors import Internal, InvalidArgument, TritonError, Unavailable, Unsupported
from ..protocol.types import InferRequest, InferResponse, RequestedOutput
from .batching.batcher import DynamicBatcher
from .composition.bls import Bls
from .batching.busy_poll import BusyPoll
from .composition.ensemble import BACKEND as ENSEMBLE_BACKEND, EnsembleScheduler, InferFn, LookupConfig, plan
from .batching.instances import Instance, InstancePool, run_in_daemon_thread
from .lifecycle.memory import LoadProbe
from .batching.rate_limiter import RateLimiter, instance_resources
from .response import OutputPlan, build_response
from .batching.pending import Pending
from .batching.scheduler import DirectScheduler, Scheduler
from .composition.sequence import SequenceBatcher, check_supported
from .observation.statistics import ModelStatistics, failure_reason, mark_failure
from .composition.streaming import (DEFAULT_MAX_BUFFERED, DEFAULT_MAX_OPEN_STREAMS, CollectingSender,
                        ResponseStream, decoupled_refusal)
from .validation import InputPlan, check_request
from .lifecycle.warmup import warmup_samples

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


class ModelVersion:
    # engine/cache.py's ModelCache when the config enables the server's response cache
    response_cache = None
    # the lifecycle's digest of the config and files this version loaded: a reload keeps a
    # version whose digest is unchanged
    stamp: str = ""

    def __init__(self, config: mc.ModelConfig, backend: str, version: int, model_dir: Path,
                 rate_limiter: RateLimiter | None = None,
                 ensemble: tuple[LookupConfig, InferFn] | None = None, *,
                 max_output_size: int = 0, server_calls: Bls | None = None,
                 busy_poll: BusyPoll | None = None) -> None:
        self.config = config
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
        self._inputs = InputPlan(config)        # the config as each request is checked against it
        self._outputs = OutputPlan(config)
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
            await self._warmup(instances)
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

    async def _warmup(self, instances: list[Instance]) -> None:
        samples = warmup_samples(self.config, self.model_dir)
        if not samples:
            return
        loop = asyncio.get_running_loop()
        start = time.monotonic_ns()
        for inst in instances:
            for sample in samples:
                for _ in range(sample.count):
                    if self.decoupled:
                        results = await loop.run_in_executor(
                            inst.thread, _warmup_decoupled, inst.backend, self.name, sample.requests())
                    else:
                        results = await loop.run_in_executor(inst.thread, inst.backend.execute,
                                                             sample.requests())
                    failed = [r for r in results if isinstance(r, BaseException)]
                    if failed:
                        raise failed[0]
        self.stats.record_warmup(time.monotonic_ns() - start)

    async def infer(self, request: InferRequest) -> InferResponse:
        if self.status.state != READY or self.scheduler is None:
            raise Unavailable(f"Request for unknown model: '{self.name}' version {self.version} is not at ready state")
        if self.decoupled:
            raise decoupled_refusal(self.name, self.version)
        start = time.monotonic_ns()
        try:
            inputs, rows = check_request(self.config, request, self._inputs)
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
            response = build_response(self.config, self.version, self.model_dir, request, outputs,
                                      self.max_output_size, self._outputs)
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
        return build_response(self.config, self.version, self.model_dir, request, outputs,
                              self.max_output_size, self._outputs)

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
            inputs, rows = check_request(self.config, request, self._inputs)
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


def _warmup_decoupled(backend: Any, model: str, requests: list[dict]) -> list:
    senders = [CollectingSender() for _ in requests]
    backend.execute_decoupled(requests, [InferRequest(model, id="warmup") for _ in requests], senders)
    return [s.error for s in senders if s.error is not None]
