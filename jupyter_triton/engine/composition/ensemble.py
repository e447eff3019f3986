"""Triton's ensemble models: a DAG of steps, each an inference on a composing model.

A request's inputs seed a table of ensemble tensors; a step runs as soon as every tensor
its ``input_map`` reads is in the table, through the engine's own infer path (so the
composing models' schedulers and dynamic batchers see ensemble traffic like any other),
and its ``output_map`` adds what it produced. The ensemble's outputs are read off the table.

A decoupled (streaming) composing model may be a step, as in Triton: each of its responses
starts a branch of the table (what came before, plus that response's tensors) through the
steps after it, and each branch that reaches the end is one response of the ensemble, in the
order of the step's responses; an error response of the step is one of the ensemble's, and
the stream goes on. The ensemble is then decoupled itself (answered on a streaming end
point). Branches run concurrently, at most ``ensemble_scheduling.max_inflight_requests`` of
one step's responses at once (Triton's bound; 0: ``DEFAULT_MAX_INFLIGHT``), and the
ensemble's responses wait for a slow client (``ResponseStream.room``), so a fast producer
cannot grow the server's memory. A step reading tensors that originate from different
decoupled steps is refused at load, in Triton's words; two decoupled steps fed by the same
responses are refused too (Triton accepts them; their responses would have no one order).
Closing the ensemble's stream (a client gone) cancels every step: the decoupled step's model
sees ``is_cancelled()``.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncGenerator, AsyncIterator, Awaitable, Callable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...protocol import errors
from ...protocol.errors import Internal, InvalidArgument, TritonError
from ...protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput
from ..batching.scheduler import Pending, Scheduler
from .streaming import DecoupledRefused

if TYPE_CHECKING:
    from ..observation.statistics import ModelStatistics

ENSEMBLE_PLATFORM = "ensemble"
BACKEND = "ensemble"   # the engine's backend name for an ensemble: it has no runtime

# (model name, version "" for latest) -> its config; raises a TritonError if not available
LookupConfig = Callable[[str, str], mc.ModelConfig]
InferFn = Callable[[InferRequest], Awaitable[InferResponse]]
StreamFn = Callable[[InferRequest], AsyncGenerator[InferResponse, None]]
#: branches of one decoupled step's responses in flight at once when the config says 0
DEFAULT_MAX_INFLIGHT = 256


def is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def composing_models(config: mc.ModelConfig) -> list[str]:
    return list(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step))


@dataclass
class Step:
    model: str
    version: str                    # "" : the composing model's latest ready version
    inputs: dict[str, str]          # composing model input -> ensemble tensor
    outputs: dict[str, str]         # composing model output -> ensemble tensor
    index: int = 0                  # 1-based, in the config's order (what errors and stats name)
    # which version serves ``model`` now (the lookup's ``version``, when it has one): a
    # failing step names the version it failed on
    serving_version: Callable[[str, str], str] | None = None
    decoupled: bool = False         # the composing model streams (zero or more responses)

    def version_label(self) -> str:
        if self.version:
            return self.version
        if self.serving_version is not None:
            try:
                return self.serving_version(self.model, "")
            except TritonError:
                pass
        return "latest"


class StepFailed(TritonError):
    """Marks an error already named after its step (``_prefixed`` leaves it alone)."""


def plan(config: mc.ModelConfig, lookup: LookupConfig) -> list[Step]:
    """The ensemble's steps, checked as Triton checks them at load: every composing model is
    available, maps only tensors it has, batches at least as far as the ensemble; every tensor
    is produced once, every step can run and every ensemble output is produced."""
    name = config.name
    steps: list[Step] = []
    for s in config.ensemble_scheduling.step:
        version = "" if s.model_version in (-1, 0) else str(s.model_version)
        try:
            composing = lookup(s.model_name, version)
        except TritonError as err:
            raise InvalidArgument(f"ensemble '{name}' depends on '{s.model_name}' which has no "
                                  f"loaded version: {err}") from None
        if config.max_batch_size > composing.max_batch_size:
            raise InvalidArgument(
                f"ensemble '{name}' allows maximum batch size {config.max_batch_size}, but it "
                f"contains model '{s.model_name}' which only allows maximum batch size to be "
                f"{composing.max_batch_size}")
        for kind, mapping, declared in (("input", s.input_map, composing.input),
                                        ("output", s.output_map, composing.output)):
            known = {t.name for t in declared}
            for key in mapping:
                if key not in known:
                    raise InvalidArgument(
                        f"in ensemble '{name}', {kind} '{key}' in {kind}_map of the step for "
                        f"model '{s.model_name}' is not an {kind} of '{s.model_name}'")
        steps.append(Step(s.model_name, version, dict(s.input_map), dict(s.output_map),
                          len(steps) + 1, getattr(lookup, "version", None),
                          bool(composing.model_transaction_policy.decoupled)))

    produced: dict[str, str] = {}
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in produced or tensor in {i.name for i in config.input}:
                raise InvalidArgument(f"in ensemble '{name}', ensemble tensor '{tensor}' can "
                                      f"only be produced once")
            produced[tensor] = step.model
    available = {i.name for i in config.input}
    # Triton's decouple labels: which decoupled step's responses a tensor comes from (0: none)
    label = {t: 0 for t in available}
    fed: dict[int, Step] = {}
    left = list(steps)
    while left:                    # fire steps in dependency order; what never fires is stuck
        ready = [s for s in left if set(s.inputs.values()) <= available]
        for step in ready:
            origins = {label[t] for t in step.inputs.values()}
            if len(origins) > 1:
                raise InvalidArgument(f"in ensemble '{name}', step of model '{step.model}' "
                                      f"receives inputs originated from different decoupled "
                                      f"models")
            origin = origins.pop() if origins else 0
            if step.decoupled:
                if origin in fed:
                    raise InvalidArgument(
                        f"in ensemble '{name}', decoupled steps '{fed[origin].model}' and "
                        f"'{step.model}' read the same responses: their responses would have "
                        f"no one order (chain them, or make them one model)")
                fed[origin] = step
            for tensor in step.outputs.values():
                label[tensor] = step.index if step.decoupled else origin
        if not ready:
            for step in left:
                for tensor in step.inputs.values():
                    if tensor not in available and tensor not in produced:
                        raise InvalidArgument(
                            f"in ensemble '{name}', ensemble tensor '{tensor}' read by the step "
                            f"for model '{step.model}' is neither an ensemble input nor produced "
                            f"by any step")
            stuck = sorted({t for s in left for t in s.inputs.values() if t not in available})
            raise InvalidArgument(f"in ensemble '{name}', the steps form a cycle through ensemble "
                                  f"tensor(s) {stuck}")
        for step in ready:
            left.remove(step)
            available.update(step.outputs.values())
    for out in config.output:
        if out.name not in produced:
            raise InvalidArgument(f"in ensemble '{name}', ensemble output '{out.name}' is not "
                                  f"produced by any step")
    return steps


class EnsembleScheduler(Scheduler):
    """Runs each request's steps as a DAG; independent steps run concurrently."""

    def __init__(self, config: mc.ModelConfig, steps: list[Step], infer: InferFn,
                 stats: "ModelStatistics | None" = None, infer_stream: StreamFn | None = None) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # an ensemble has no instances
        self.config = config
        self.steps = steps
        self.infer = infer
        self.infer_stream = infer_stream or _stream_of(infer)
        self.streams = any(step.decoupled for step in steps)
        self.max_inflight = config.ensemble_scheduling.max_inflight_requests or DEFAULT_MAX_INFLIGHT
        # the ensemble's statistics: each step's latency and failures (fields Triton lacks)
        self.stats = stats
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, pending: Pending) -> None:
        if pending.stream is None and self.streams:
            step = next(s for s in self.steps if s.decoupled)
            # (a one-response call to an ensemble declared decoupled is refused before this)
            raise DecoupledRefused(
                f"ensemble '{self.config.name}' streams: its step {step.index} ('{step.model}') "
                f"is decoupled, so the ensemble must be too; add model_transaction_policy "
                f"{{ decoupled: true }} to its config (tritonserver infers it) and call it on a "
                f"streaming end point (gRPC ModelStreamInfer, generate_stream)")
        run = self._run if pending.stream is None else self._run_stream
        task = asyncio.ensure_future(run(pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # a request whose client went away stops its steps too
        pending.future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def _run(self, pending: Pending) -> None:
        start = time.monotonic_ns()
        request = pending.request
        table = {t.name: t for t in request.inputs}
        try:
            left = await self._closure(table, list(self.steps), request)
            if left:        # only an optional ensemble input left out gets here
                raise self._missing(table, left)
            outputs: dict[str, np.ndarray] = {o.name: table[o.name].data for o in self.config.output}
        except BaseException as err:
            self._fail(pending, err)
            if not isinstance(err, Exception):
                raise
            return
        self._record(pending, start)
        if not pending.future.done():
            pending.future.set_result(outputs)

    async def _run_stream(self, pending: Pending) -> None:
        """A decoupled ensemble's request: one response per branch that reaches the end."""
        start = time.monotonic_ns()
        request, stream = pending.request, pending.stream
        assert stream is not None
        flow = self._flow({t.name: t for t in request.inputs}, list(self.steps), request)
        try:
            async for item in flow:
                if isinstance(item, TritonError):
                    stream.send(error=item)
                else:
                    stream.send({o.name: item[o.name].data for o in self.config.output})
                await stream.room()         # a slow client holds the steps back
            stream.send(final=True)
        except BaseException as err:
            self._fail(pending, err)
            if not isinstance(err, Exception):
                raise
            return
        finally:
            await flow.aclose()
        self._record(pending, start)
        if not pending.future.done():
            pending.future.set_result({})

    def _fail(self, pending: Pending, err: BaseException) -> None:
        if not pending.future.done():
            if isinstance(err, asyncio.CancelledError):
                pending.future.cancel()
            else:
                pending.future.set_exception(_prefixed(self.config.name, err))

    def _record(self, pending: Pending, start: int) -> None:
        if self.stats is not None:
            # Triton counts a successful ensemble request as one execution of its rows, with
            # the steps' time as its compute (it never waits in a queue of the ensemble's own)
            self.stats.record_queue(0)
            self.stats.record_execution(pending.batch_size, 1, 0, time.monotonic_ns() - start, 0)

    def _missing(self, table: dict[str, InferTensor], left: list[Step]) -> InvalidArgument:
        missing = sorted({t for s in left for t in s.inputs.values() if t not in table})
        return InvalidArgument(f"in ensemble '{self.config.name}', ensemble tensor(s) "
                               f"{missing} needed by a step were not provided")

    async def _closure(self, table: dict[str, InferTensor], left: list[Step],
                       request: InferRequest) -> list[Step]:
        """Run every step that is not decoupled as soon as its inputs are in ``table`` (which
        grows); the steps left (decoupled ones, what they feed, what never had its inputs)."""
        running: dict[asyncio.Future, Step] = {}
        try:
            while True:
                for step in [s for s in left if not s.decoupled
                             and all(t in table for t in s.inputs.values())]:
                    left.remove(step)
                    running[asyncio.ensure_future(self._step(step, table, request))] = step
                if not running:
                    return left
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    table.update(task.result())
        finally:
            for task in running:
                task.cancel()

    async def _flow(self, table: dict[str, InferTensor], left: list[Step],
                    request: InferRequest) -> AsyncIterator[dict[str, InferTensor] | TritonError]:
        """The tables (or error responses) of one branch, in order: the steps that run once,
        then, for a decoupled step, a branch per response of it, ``max_inflight`` at once."""
        left = await self._closure(table, left, request)
        step = next((s for s in left if all(t in table for t in s.inputs.values())), None)
        if step is None:
            if left:
                raise self._missing(table, left)
            yield table
            return
        rest = [s for s in left if s is not step]
        branches: deque[asyncio.Future] = deque()
        responses = self._stream_step(step, table, request)
        following: asyncio.Future | None = None
        try:
            while True:
                if following is None and len(branches) < self.max_inflight:
                    following = asyncio.ensure_future(responses.__anext__())
                waits = {f for f in (following, branches[0] if branches else None) if f is not None}
                if not waits:
                    return
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                while branches and branches[0].done():      # in the step's response order
                    for item in branches.popleft().result():
                        yield item
                if following is not None and following.done():
                    try:
                        got = following.result()
                    except StopAsyncIteration:
                        got = None
                    following = None
                    if got is None:
                        while branches:
                            for item in await branches.popleft():
                                yield item
                        return
                    branches.append(asyncio.ensure_future(
                        _collect(got) if isinstance(got, TritonError) else
                        _collect(self._flow({**table, **got}, list(rest), request))))
        finally:
            # the step's stream may be inside __anext__ (``following``): it must have ended
            # before the stream can be closed
            left = [f for f in (following, *branches) if f is not None]
            for future in left:
                future.cancel()
            if left:
                await asyncio.gather(*left, return_exceptions=True)
            await responses.aclose()

    async def _stream_step(self, step: Step, table: dict[str, InferTensor],
                           request: InferRequest) -> AsyncIterator[dict[str, InferTensor] | TritonError]:
        """A decoupled step's responses as table entries (an error response as its error)."""
        start = time.monotonic_ns()
        responses = self.infer_stream(self._request(step, table, request))
        version, ok = step.version_label(), False
        try:
            async for response in responses:
                version = response.model_version or version
                if response.error is not None:
                    err = response.error if isinstance(response.error, TritonError) else \
                        Internal(f"{type(response.error).__name__}: {response.error}")
                    yield _step_failed(self.config.name, step, version, err)
                    if response.final:
                        break
                    continue
                got = {t.name: t for t in response.outputs}
                if got:
                    missing = [key for key in step.outputs if key not in got]
                    if missing:
                        raise _step_failed(self.config.name, step, version, Internal(
                            f"a response lacks output(s) {missing}"))
                    yield {tensor: _renamed(got[key], tensor) for key, tensor in step.outputs.items()}
                if response.final:
                    break
            ok = True
        except TritonError as err:
            if isinstance(err, StepFailed):
                raise
            raise _step_failed(self.config.name, step, version, err) from None
        finally:
            await responses.aclose()
            if self.stats is not None:
                self.stats.record_step(step.index, step.model, version, ok,
                                       time.monotonic_ns() - start)

    def _request(self, step: Step, table: dict[str, InferTensor],
                 request: InferRequest) -> InferRequest:
        inputs = [InferTensor(key, table[t].datatype, table[t].shape, table[t].data)
                  for key, t in step.inputs.items()]
        return InferRequest(step.model, step.version, request.id, inputs,
                            [RequestedOutput(key) for key in step.outputs], dict(request.parameters))

    async def _step(self, step: Step, table: dict[str, InferTensor],
                    request: InferRequest) -> dict[str, InferTensor]:
        sub = self._request(step, table, request)
        start = time.monotonic_ns()
        try:
            response = await self.infer(sub)
        except TritonError as err:
            version = step.version_label()
            if self.stats is not None:
                self.stats.record_step(step.index, step.model, version, False,
                                       time.monotonic_ns() - start)
            raise _step_failed(self.config.name, step, version, err) from None
        if self.stats is not None:
            self.stats.record_step(step.index, step.model, response.model_version, True,
                                   time.monotonic_ns() - start)
        got = {t.name: t for t in response.outputs}
        return {tensor: _renamed(got[key], tensor) for key, tensor in step.outputs.items()}


async def _collect(items: "AsyncIterator | TritonError") -> list:
    if isinstance(items, TritonError):
        return [items]
    return [item async for item in items]


def _stream_of(infer: InferFn) -> StreamFn:
    """The streaming call beside ``infer``: the engine's own ``infer_stream`` when ``infer``
    is the engine's method; otherwise ``infer``'s one response (no decoupled steps then)."""
    owner = getattr(infer, "__self__", None)
    stream = getattr(owner, "infer_stream", None)
    if stream is not None:
        return stream

    async def once(request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        yield await infer(request)
    return once


def _renamed(t: InferTensor, name: str) -> InferTensor:
    return InferTensor(name, t.datatype, t.shape, t.data)


def _kind(err: TritonError) -> type[TritonError]:
    """The protocol error class of ``err`` (so its status and gRPC code)."""
    return next(c for c in type(err).__mro__ if c.__module__ == errors.__name__)


_STEP_KINDS: dict[type, type] = {}


def _step_failed(ensemble: str, step: Step, version: str, err: TritonError) -> TritonError:
    """``ensemble '<e>' step <i> ('<model>' v<version>) failed: <its error>``, with the
    step's status: one endpoint no longer hides which stage failed (Triton issue #4786)."""
    kind = _kind(err)
    cls = _STEP_KINDS.get(kind)
    if cls is None:
        cls = _STEP_KINDS[kind] = type(f"Step{kind.__name__}", (StepFailed, kind), {})
    failed = cls(f"ensemble '{ensemble}' step {step.index} ('{step.model}' v{version}) failed: {err}")
    reason = getattr(err, "failure_reason", None)
    if reason is not None:
        failed.failure_reason = reason  # type: ignore[attr-defined]
    return failed


def _prefixed(ensemble: str, err: BaseException) -> TritonError:
    """The composing model's error, in its protocol kind (so its status), naming the ensemble."""
    if isinstance(err, StepFailed):
        return err
    if isinstance(err, TritonError):
        return _kind(err)(f"in ensemble '{ensemble}', {err}")
    return Internal(f"in ensemble '{ensemble}', {type(err).__name__}: {err}")
