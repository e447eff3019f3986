"""Triton's ensemble models: a DAG of steps, each an inference on a composing model.

A request's inputs seed a table of ensemble tensors; a step runs as soon as every tensor
its ``input_map`` reads is in the table, through the engine's own infer path (so the
composing models' schedulers and dynamic batchers see ensemble traffic like any other),
and its ``output_map`` adds what it produced. The ensemble's outputs are read off the table.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol import errors
from ..protocol.errors import Internal, InvalidArgument, TritonError
from ..protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput
from .scheduler import Pending, Scheduler

if TYPE_CHECKING:
    from .statistics import ModelStatistics

ENSEMBLE_PLATFORM = "ensemble"
BACKEND = "ensemble"   # the engine's backend name for an ensemble: it has no runtime

# (model name, version "" for latest) -> its config; raises a TritonError if not available
LookupConfig = Callable[[str, str], mc.ModelConfig]
InferFn = Callable[[InferRequest], Awaitable[InferResponse]]


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
                          len(steps) + 1, getattr(lookup, "version", None)))

    produced: dict[str, str] = {}
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in produced or tensor in {i.name for i in config.input}:
                raise InvalidArgument(f"in ensemble '{name}', ensemble tensor '{tensor}' can "
                                      f"only be produced once")
            produced[tensor] = step.model
    available = {i.name for i in config.input}
    left = list(steps)
    while left:                    # fire steps in dependency order; what never fires is stuck
        ready = [s for s in left if set(s.inputs.values()) <= available]
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
                 stats: "ModelStatistics | None" = None) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # an ensemble has no instances
        self.config = config
        self.steps = steps
        self.infer = infer
        # the ensemble's statistics: each step's latency and failures (fields Triton lacks)
        self.stats = stats
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, pending: Pending) -> None:
        task = asyncio.ensure_future(self._run(pending))
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
        left = list(self.steps)
        running: dict[asyncio.Future, Step] = {}
        try:
            while left or running:
                for step in [s for s in left if all(t in table for t in s.inputs.values())]:
                    left.remove(step)
                    running[asyncio.ensure_future(self._step(step, table, request))] = step
                if not running:    # only an optional ensemble input left out gets here
                    missing = sorted({t for s in left for t in s.inputs.values() if t not in table})
                    raise InvalidArgument(f"in ensemble '{self.config.name}', ensemble tensor(s) "
                                          f"{missing} needed by a step were not provided")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    table.update(task.result())
            outputs: dict[str, np.ndarray] = {o.name: table[o.name].data for o in self.config.output}
        except BaseException as err:
            for task in running:
                task.cancel()
            if not pending.future.done():
                if isinstance(err, asyncio.CancelledError):
                    pending.future.cancel()
                else:
                    pending.future.set_exception(_prefixed(self.config.name, err))
            if not isinstance(err, Exception):
                raise
            return
        if self.stats is not None:
            # Triton counts a successful ensemble request as one execution of its rows, with
            # the steps' time as its compute (it never waits in a queue of the ensemble's own)
            self.stats.record_queue(0)
            self.stats.record_execution(pending.batch_size, 1, 0, time.monotonic_ns() - start, 0)
        if not pending.future.done():
            pending.future.set_result(outputs)

    async def _step(self, step: Step, table: dict[str, InferTensor],
                    request: InferRequest) -> dict[str, InferTensor]:
        inputs = [InferTensor(key, table[t].datatype, table[t].shape, table[t].data)
                  for key, t in step.inputs.items()]
        sub = InferRequest(step.model, step.version, request.id, inputs,
                           [RequestedOutput(key) for key in step.outputs], dict(request.parameters))
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
