"""The engine: one object that owns every model's lifecycle and is the single entry point
for every frontend (HTTP, gRPC, metrics). Runs on the server's asyncio loop; never executes
a model on it.

This module is the data plane and the model queries. The rest lives in rooms, each a
subpackage with its own note:

- ``batching/``: schedulers, the dynamic batcher, instances, clocks, the simulator
- ``lifecycle/``: the model table, on-demand loads, residency, rollouts, warm-up
- ``composition/``: ensembles, BLS, decoupled streams, sequences
- ``observation/``: statistics, trace, logging, traffic capture

and beside them ``model`` (one loaded version: a request checked against its config, its
response built), ``classification`` (Triton's extension), ``shared_memory``, ``cache`` (the
response cache) and ``options`` (the operator's)."""
from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncGenerator

from tritonclient.grpc import model_config_pb2 as mc

from .._version import __version__
from ..model_logs import ModelLogs
from ..model_metrics import CustomMetrics
from ..protocol.datatypes import config_to_triton
from ..protocol.errors import InvalidArgument, NotFound, TritonError, Unavailable
from ..protocol.types import InferRequest, InferResponse
from .composition.bls import Bls
from .observation.capture import TrafficCapture
from .lifecycle.control import ModelLifecycle
from .model import READY, UNAVAILABLE, ModelVersion
from .options import CONTROL_MODES, EngineOptions
from .lifecycle.residency import opted_in
from .shared_memory import SharedMemoryRegistry, place_outputs, resolve_inputs
from .observation.server_log import ServerLog
from .observation.trace import Tracing, parse_trace_config

# Advertised only because each works end to end (perf_analyzer reads this list).
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "binary_tensor_data", "parameters",
              "statistics", "system_shared_memory", "trace", "logging"]

log = logging.getLogger(__name__)


class Engine(ModelLifecycle):
    """What every frontend calls. Besides the methods below, its public attributes are
    ``options`` (EngineOptions: the limits and metric switches frontends honour),
    ``repository``, ``response_cache`` (None without --cache-config), ``shared_memory``,
    ``tracing``, ``traffic`` (engine/observation/capture.py), ``server_calls`` (BLS), ``residency``
    (engine/lifecycle/residency.py: the memory budget, with ``resident_models()``), ``model_logs`` and
    ``custom_metrics`` (what its models log and count, handed to them through
    ``server_calls``) and ``server_log`` (the logging extension's settings); frontends use
    these, never probe for others."""

    shared_memory: SharedMemoryRegistry
    server_calls: Bls
    tracing: Tracing
    # A graceful stop began (``drain``): readiness says no while requests are still served.
    draining: bool = False

    def __init__(self, options: EngineOptions, *, server_log: ServerLog | None = None) -> None:
        """``server_log``: settings installed before the engine (the command line's --log-*
        flags), else this engine's own."""
        if options.model_control_mode not in CONTROL_MODES:
            raise ValueError(f"model control mode must be one of {CONTROL_MODES}")
        super().__init__(options)
        self.shared_memory = SharedMemoryRegistry(max_input_size=options.max_input_size)
        self.server_calls = Bls(self)       # what models call other models with (BLS)
        # this server's own, not the process's: two servers in one process keep them apart
        self.model_logs = ModelLogs()
        self.custom_metrics = CustomMetrics()
        self.server_log = server_log if server_log is not None else ServerLog()
        self.tracing = Tracing(parse_trace_config(options.trace_config))
        self.traffic = TrafficCapture(self.is_model)      # off until a model's capture starts

    async def stop(self) -> None:
        await super().stop()
        self.shared_memory.unregister()
        self.tracing.close()

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self.draining and super().ready()

    async def drain(self, seconds: float, cut_short: asyncio.Event | None = None) -> None:
        """The first step of a graceful stop (--shutdown-drain-secs): from now on the server
        and its models answer not ready, as tritonserver does while it exits, but every
        request is still served, for ``seconds`` or until ``cut_short`` is set (a second
        signal): a load balancer or a Kubernetes readiness probe sees the 503 and stops
        sending before the listeners close. Liveness stays true: the process is healthy."""
        self.draining = True
        log.info("draining: not ready, still serving for %g s", seconds)
        if cut_short is None:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(cut_short.wait(), seconds)
            log.info("draining: cut short by a second signal")
        except asyncio.TimeoutError:
            pass

    def server_metadata(self) -> dict:
        """Triton answers its --id here, "triton" unless set, and NVIDIA's example clients
        and tools check that name: a drop-in answers the same; the version is ours."""
        return {"name": self.options.server_id, "version": __version__,
                "extensions": list(EXTENSIONS) + ["sequence"]}

    # ---- data path ---------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        if self.tracing.on and request.trace is None:     # engine/observation/trace.py; off: this check only
            return await self.tracing.infer(self, request)
        tap = None
        if self.traffic.active and not request.captured:  # engine/observation/capture.py; off: this check only
            tap = self.traffic.active.get(request.model_name)
        if tap is None and not request.shared_memory:     # shm: the codec's mark, a tensor names a region
            mv = (self.serving_version(request.model_name, request.model_version)
                  or await self.resident_version(request.model_name, request.model_version))
            if mv.response_cache is None:
                return await mv.infer(request)
            return await mv.response_cache.infer(mv, request)       # engine/cache.py
        # A tapped model's request is watched here, not in a coroutine of the tap's around
        # this one: the frames a request's every resumption passes through are the data path's
        mark = tap.begin(request) if tap is not None else None
        try:
            if request.shared_memory:
                await resolve_inputs(request, self.shared_memory)
            mv = (self.serving_version(request.model_name, request.model_version)
                  or await self.resident_version(request.model_name, request.model_version))
            response = await (mv.infer(request) if mv.response_cache is None else
                              mv.response_cache.infer(mv, request))
            if request.shared_memory:
                await place_outputs(response, request, self.shared_memory)
        except BaseException as err:
            if mark is not None:
                tap.failed(request, mark, err)
            raise
        if mark is not None:
            tap.served(self, request, mark, response)
        return response

    async def infer_stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """Every response of ``request``, the last with ``final=True`` (a non-decoupled
        model: exactly one). Refusals raise on the first ``__anext__``; a decoupled model's
        error responses come with ``.error`` set. Closing the generator early (``aclose()``,
        or cancelling the task that iterates) cancels the request."""
        if self.tracing.on and request.trace is None:     # engine/observation/trace.py; off: this check only
            traced = self.tracing.infer_stream(self, request)
            try:
                async for response in traced:
                    yield response
            finally:
                await traced.aclose()
            return
        if self.traffic.active and not request.captured:  # engine/observation/capture.py; off: this check only
            tap = self.traffic.active.get(request.model_name)
            if tap is not None:
                tapped = tap.infer_stream(self, request)
                try:
                    async for response in tapped:
                        yield response
                finally:
                    await tapped.aclose()
                return
        mv = (self.serving_version(request.model_name, request.model_version)
              or await self.resident_version(request.model_name, request.model_version))
        shm = request.shared_memory
        if shm:
            await resolve_inputs(request, self.shared_memory)
        responses = mv.infer_stream(request)
        try:
            async for response in responses:
                if shm and response.error is None:
                    await place_outputs(response, request, self.shared_memory)
                yield response
        finally:
            await responses.aclose()       # now, not when the garbage collector gets to it

    def is_decoupled(self, model: str, version: str = "") -> bool:
        return self._version(model, version).decoupled

    def raw_input(self, model: str, version: str = "") -> tuple[str, str, list[int]]:
        config = self._version(model, version).config
        if len(config.input) != 1:
            raise InvalidArgument(
                f"raw binary request requires model '{model}' to have exactly one input, "
                f"it has {len(config.input)}")
        inp = config.input[0]
        dims = ([-1] if config.max_batch_size > 0 else []) + list(inp.dims)
        return inp.name, config_to_triton(mc.DataType.Name(inp.data_type)), dims

    # ---- model queries -----------------------------------------------------------------
    def models(self) -> list[ModelVersion]:
        return self.table.serving_versions()

    def is_model(self, name: str) -> bool:
        """Whether ``name`` is a model of this server: loaded (or failed to), or on disk."""
        entry = self.table.get(name)
        return (entry is not None and bool(entry.serving or entry.status)) or \
            name in self.repository.model_names()

    def model_ready(self, name: str, version: str = "") -> bool:
        if self.draining:           # tritonserver while it exits: no model is ready
            return False
        try:
            return self._version(name, version).ready
        except TritonError:
            return False

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        evicted = self._evicted_config(name, version)
        return evicted if evicted is not None else self._version(name, version).config

    def _evicted_config(self, name: str, version: str) -> mc.ModelConfig | None:
        """The config an evicted model served with, when its next request loads it again
        (opted in to on-demand loading; otherwise it is not loaded: Triton's 404)."""
        if not self.residency.enabled or self.on_demand.held_off(name):
            return None
        entry = self.table.get(name)
        if entry is not None and entry.serving:
            return None
        state = self.residency.models.get(name)
        if state is None or state.config is None or not state.evicted or \
                not opted_in(state.config, self.options.load_on_demand):
            return None
        if version not in ("", None) and version not in {str(v) for v in state.versions}:
            return None
        return state.config

    def model_metadata(self, name: str, version: str = "") -> dict:
        evicted = self._evicted_config(name, version)
        if evicted is not None:
            cfg, versions = evicted, list(self.residency.models[name].versions)
        else:
            mv = self._version(name, version)
            cfg, versions = mv.config, sorted(self.table.get(name).serving)
        lead = [-1] if cfg.max_batch_size > 0 else []

        def tensors(items) -> list[dict]:
            return [{"name": t.name, "datatype": config_to_triton(mc.DataType.Name(t.data_type)),
                     "shape": lead + list(t.dims)} for t in items]

        return {"name": name, "versions": [str(v) for v in versions],
                "platform": cfg.platform or cfg.backend,
                "inputs": tensors(cfg.input), "outputs": tensors(cfg.output)}

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """Triton's index; versions a failed load set aside (this run or an earlier one)
        are listed UNAVAILABLE with their reason."""
        rows = []
        names = sorted(set(self.repository.model_names()) | set(self.table.names())
                       | set(self.repository.set_aside_models()))
        for name in names:
            entry = self.table.get(name)
            status = dict(entry.status) if entry else {}
            if not ready_only:
                for version, reason, where in self.repository.set_aside(name):
                    if version not in status:
                        rows.append({"name": name, "version": str(version), "state": UNAVAILABLE,
                                     "reason": f"load failed, set aside in {where}: {reason}"})
            if not status:
                if not ready_only and not any(r["name"] == name for r in rows):
                    rows.append({"name": name, "version": "", "state": UNAVAILABLE,
                                 "reason": entry.reason} if entry and entry.reason else {"name": name})
                continue
            for version, st in sorted(status.items()):
                if ready_only and st.state != READY:
                    continue
                # Triton leaves an empty reason out of the index
                rows.append({"name": name, "version": str(version), "state": st.state,
                             "reason": st.reason} if st.reason else
                            {"name": name, "version": str(version), "state": st.state})
        return rows

    def statistics(self, name: str = "", version: str = "", history: bool = False) -> dict:
        """Triton's statistics; with a residency bound also ``residency`` (the bounds, what
        is resident, per model its state, cold starts and evictions: engine/lifecycle/residency.py),
        and with ``history`` (for a caller who may load models: it carries earlier configs
        and golden-set differences) one model's promotions and rollbacks when it has any."""
        extra: dict = {}
        if self.residency.enabled:
            extra["residency"] = self.residency.to_json(self.resident_models())
        if name and history:
            records = self.rollout.history(name)
            if records:
                extra["history"] = records
        if name:
            entry = self.table.get(name)
            if self.residency.enabled and not version and not (entry and entry.serving) \
                    and name in self.residency.models:
                return {"model_stats": [], **extra}       # loaded before, not resident now
        return {**self._statistics(name, version), **extra}

    def _statistics(self, name: str = "", version: str = "") -> dict:
        if name:
            if version:
                try:
                    versions = [self._version(name, version)]
                except NotFound:        # tritonserver 2.51's words (its status: 400)
                    if name not in self.table:
                        raise NotFound(f"requested model '{name}' is not available") from None
                    raise NotFound(f"requested model version is not available for model "
                                   f"'{name}'") from None
            else:
                entry = self.table.get(name)
                if entry is None or not entry.serving:
                    raise NotFound(f"requested model '{name}' is not available")
                # a canary's statistics beside the served version's, to compare them
                versions = [{**entry.staged, **entry.serving}[v]
                            for v in sorted({*entry.serving, *entry.staged})]
        else:
            versions = self.models()
        return {"model_stats": [mv.stats.to_json() for mv in versions]}

    def serving_version(self, name: str, version: str = "") -> ModelVersion | None:
        """The version a request for ``name`` runs on when the model is serving (the data
        path's case: no coroutine, no clock); None when ``resident_version``
        (engine/lifecycle/on_demand.py) must decide: not loaded, evicted, still loading."""
        entry = self.table.get(name)
        if entry is None or not entry.serving:
            return None
        if self.residency.enabled:
            self.residency.touch(name)
        return self._version(name, version)

    def _version(self, name: str, version: str = "") -> ModelVersion:
        entry = self.table.get(name)
        # inline, not entry.known(): the data path calls nothing past this module
        if entry is None or not (entry.serving or entry.status or entry.reason):
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version in ("", None):
            if entry.canary is not None and random.random() < entry.canary.fraction:
                canary = entry.staged.get(entry.canary.version)
                if canary is not None and canary.ready:
                    return canary
            if len(entry.serving) == 1:         # the usual case: one version served
                for mv in entry.serving.values():
                    if mv.ready:
                        return mv
            ready = [v for v, mv in entry.serving.items() if mv.ready]
            if not ready:
                reasons = "; ".join([s.reason for s in entry.status.values() if s.reason]
                                    + ([entry.reason] if entry.reason else []))
                # Triton 2.51: 404, also after an unload or a failed load
                raise NotFound(f"Request for unknown model: '{name}' has no available versions"
                                  + (f" ({reasons})" if reasons else ""))
            return entry.serving[max(ready)]
        try:
            v = int(version)
        except ValueError:
            raise InvalidArgument(f"model version must be an integer, got '{version}'") from None
        mv = entry.serving.get(v) or entry.staged.get(v)
        if mv is None:
            if v in entry.status:
                raise Unavailable(f"Request for unknown model: '{name}' version {v} is not at ready state")
            raise NotFound(f"Request for unknown model: '{name}' version {v} is not found")
        return mv


__all__ = ["Engine", "EngineOptions", "CONTROL_MODES", "EXTENSIONS"]
