"""The model lifecycle: what the engine loads, reloads, unloads and stops, and what a
crash or a failed upload leaves on disk.

Per model name, every change runs under one lock (upload, load, commit or take back, unload),
so two loads of one model never race for each other's files. An upload is written as an
uncommitted transaction (repository.PendingUpload) and committed only after its load
succeeded; a load that fails sets it aside, so a restart serves what served before.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tritonclient.grpc import model_config_pb2 as mc

from ...backends import ModelFiles, backend_class, backend_name
from ...backends.devices import resolve_kind
from ...config import fill_defaults, validate_config
from ...protocol.errors import InvalidArgument, NotFound, TritonError, Unavailable
from ...repository import PendingUpload, Repository, VersionIdentity
from ..batching.busy_poll import BusyPoll
from ..cache import ResponseCache
from ..composition.ensemble import BACKEND as ENSEMBLE_BACKEND, composing_models, is_ensemble
from ..observation.histograms import latency_histograms
from ..model import READY, UNAVAILABLE, ModelVersion, VersionStatus
from ..options import EngineOptions
from .on_demand import OnDemand, retry_later
from .promotion import canary_fraction, lifecycle_parameters, parse_promotion, rollback_requested
from ..batching.rate_limiter import RateLimiter
from .residency import ON_DEMAND_WAIT_SECS, Residency, pinned
from .rollout import Rollout, canary_running
from .table import Entry, ModelTable

if TYPE_CHECKING:
    from ...protocol.types import InferRequest, InferResponse
    from ..composition.bls import Bls
    from ..observation.capture import TrafficCapture

log = logging.getLogger(__name__)

# Poll mode: a model whose files did not change since its failed load is tried again (a
# failure need not be in the files: memory, a device, a service the model calls) after 1, 2,
# 4, ... polls, at most this many; tritonserver 2.51 tries again at every poll.
MAX_RETRY_POLLS = 32

# ensembles within ensembles a response cache's key follows (a cycle cannot load; this bounds
# the walk whatever the table holds)
_MAX_NESTING = 8

# models this task is loading, outermost first: an ensemble loads its composing models, and
# one that (indirectly) contains itself must fail instead of waiting on its own lock
_LOADING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("loading", default=())


class ModelLifecycle:
    """Load / unload / poll / stop for the Engine (which adds the data plane and queries).
    Owns the model table (``table``: lifecycle/table.py) and the two rooms that change it
    beside the loads here: ``on_demand`` (loads a request asks for, evictions within the
    residency budget: lifecycle/on_demand.py) and ``rollout`` (promotion, canaries,
    rollback: lifecycle/rollout.py)."""

    options: EngineOptions
    repository: Repository
    rate_limiter: RateLimiter
    response_cache: ResponseCache | None
    server_calls: "Bls | None" = None      # the Engine's; what loaded models call models with
    _version: Callable[[str, str], ModelVersion]
    serving_version: Callable[[str, str], "ModelVersion | None"]
    infer: Callable[["InferRequest"], "InferResponse"]
    traffic: "TrafficCapture"              # the Engine's; a promotion reads its shadow report
    # how long a request waits for its model's on-demand load before a 503 (Retry-After)
    on_demand_wait_secs: float = ON_DEMAND_WAIT_SECS

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.repository = Repository(Path(options.model_repository))
        self.table = ModelTable()
        self._started = False
        # while start() loads what it loads, unset (a request that comes then waits for it)
        self._start_done: asyncio.Event | None = None
        self._poller: asyncio.Task | None = None
        self._unloading: set[asyncio.Task] = set()
        # one loop, polled after any model's request (engine/batching/busy_poll.py); None: off
        self.busy_poll = BusyPoll(options.busy_poll_us) if options.busy_poll_us > 0 else None
        # Triton's rate limiter spans models: one per engine.
        self.rate_limiter = RateLimiter.from_options(options)
        # Triton's response cache spans models too (--cache-config local,size=<bytes>)
        self.response_cache = ResponseCache(options.response_cache_size) \
            if options.response_cache_size > 0 else None
        # lifecycle as a control (engine/lifecycle/residency.py): off unless a bound is set
        self.residency = Residency(options.model_residency_bytes, options.max_loaded_models)
        self.on_demand = OnDemand(self.table, self.residency, self.repository, options,
                                  self._load_locked)
        self.rollout = Rollout(self.table, self.repository, options, self._load_locked,
                               self._build_version, lambda name: self.traffic.shadow_report(name))

    # ---- the engine's own lifecycle ------------------------------------------------------
    async def start(self) -> None:
        self._start_done = asyncio.Event()
        try:
            await self._start()
        finally:
            self._start_done.set()

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.repository.recover)
        mode = self.options.model_control_mode
        if mode != "none" or any(Path(self.options.model_repository).glob("*/*/model.py")):
            # python models may come (uploads, %%serve) or are here: their workers are forked
            # from a template process; starting it now spares the first one its start (~1 s)
            from ...backends.python.launch import prestart
            prestart()
        names = self.repository.model_names()
        if mode == "explicit":
            wanted = self.options.load_models
            names = names if "*" in wanted else [n for n in wanted]
        if self.residency.enabled:
            # within a budget the pinned models load first, then the others while they fit
            # (the rest on their first request, where the operator opted them in)
            first = {n for n in names if self._pinned_on_disk(n)}
            names = sorted(names, key=lambda n: n not in first)
        left: list[str] = []
        for name in names:
            if self.residency.enabled and name not in first and not self.on_demand.fits_another():
                left.append(name)
                continue
            self.table.want(name)
            try:
                await self._load(name)
            except TritonError as err:
                log.error("failed to load model '%s': %s", name, err)
                if self.options.exit_on_error:
                    raise
            else:
                if self.residency.enabled:          # measured; a pinned one is never evicted
                    self.residency.loaded(name, self.table.entry(name).serving.values(), cold=False)
        if left:
            log.warning("%d model(s) not loaded at start, past the residency budget: %s", len(left),
                        ", ".join(left[:20]) + (", ..." if len(left) > 20 else ""))
        if mode == "poll":
            self._poller = asyncio.ensure_future(self._poll())
        self._started = True
        self.on_demand.open()

    def _pinned_on_disk(self, name: str) -> bool:
        try:
            return pinned(self.repository.read_config(name))
        except (TritonError, OSError):
            return False

    async def stop(self) -> None:
        """Unload every version in parallel, bounded by ``exit_timeout_secs`` even when a
        model hangs (its requests fail with Unavailable; a stuck thread is left behind)."""
        self._started = False
        self.on_demand.close()
        if self._poller:
            self._poller.cancel()
        bound = max(self.options.exit_timeout_secs, 0.0)
        # a canary's upload stays uncommitted: the next start sets it aside
        versions = self.table.take_all()
        tasks = [asyncio.ensure_future(mv.unload(drain_seconds=bound * 0.6,
                                                 close_seconds=bound * 0.4))
                 for mv in versions] + list(self._unloading)
        if tasks:
            # each unload bounds itself; this outer bound catches what would not
            done, pending = await asyncio.wait(tasks, timeout=bound + 1.0)
            for task in pending:
                log.error("engine stop: an unload did not finish within %.1f s; leaving it", bound)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("engine stop: unload failed: %r", task.exception())

    def ready(self) -> bool:
        if not self._started:
            return False
        if not self.options.strict_readiness:
            return True
        return self.table.wanted_ready()

    async def resident_version(self, name: str, version: str = "") -> ModelVersion:
        """The version a request for ``name`` runs on: every inference route's lookup (v2
        infer and streams, gRPC, the OpenAI routes). A model that is serving answers at once;
        one in the repository that is not loaded (evicted, or never asked for) and opted in
        to on-demand loading is loaded first, once however many requests wait for it, within
        ``on_demand_wait_secs`` (then Unavailable with ``retry_after``). Anything else raises
        Triton's NotFound, and no state is kept for the name."""
        deadline = time.monotonic() + self.on_demand_wait_secs
        for _ in range(8):     # a model loaded for us may be evicted before we run: ask again
            served = self.serving_version(name, version)
            if served is not None:
                return served
            if self._start_done is not None and not self._start_done.is_set():
                # the Jupyter server answers while the engine still loads the models named at
                # start: a request for one of them waits for that, not a 404
                try:
                    await asyncio.wait_for(self._start_done.wait(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise retry_later("the server is still loading its models") from None
                continue
            if not await self.on_demand.loadable(name):
                return self._version(name, version)
            await self.on_demand.load(name, deadline - time.monotonic())
        raise retry_later(f"model '{name}' was evicted again before this request could run")

    def resident_models(self) -> dict[str, list[ModelVersion]]:
        return self.table.resident()

    # ---- control path ------------------------------------------------------------------
    def _check_explicit(self) -> None:
        if self.options.model_control_mode != "explicit":
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled"
                              if self.options.model_control_mode == "poll" else
                              "explicit model load / unload is not allowed with model control mode 'none'")

    async def load_model(self, name: str, config: str | None = None,
                         files: dict[str, bytes] | None = None,
                         parameters: dict | None = None) -> None:
        """The repository API's load. ``parameters``: its lifecycle keys (engine/lifecycle/promotion.py):
        ``golden`` (+ ``atol``, ``rtol``, ``promote``) promotes only after a golden check;
        ``rollback`` brings back the previously served version and config."""
        self._check_explicit()
        files = dict(files) if files else files
        lifecycle = lifecycle_parameters(parameters, files)
        rollback = rollback_requested(lifecycle)
        entry = self.table.get(name)
        if entry is not None and entry.canary is not None and not (
                "canary" in lifecycle or "golden" in lifecycle or "shadow_max_diff" in lifecycle):
            raise canary_running(name, entry)
        if "canary" in lifecycle:
            if set(lifecycle) - {"canary"}:
                raise InvalidArgument(f"failed to load '{name}': 'canary' goes alone with the "
                                      f"new version's config and files")
            await self.rollout.canary(name, canary_fraction(lifecycle), config, files)
        elif rollback:
            if config is not None or files or "golden" in lifecycle:
                raise InvalidArgument(f"failed to load '{name}': 'rollback' takes no config, "
                                      f"files or golden set")
            await self.rollout.rollback(name)
        elif "golden" in lifecycle or "shadow_max_diff" in lifecycle:
            await self.rollout.promote(name, parse_promotion(lifecycle), config, files)
        elif "promote" in lifecycle or "atol" in lifecycle or "rtol" in lifecycle:
            raise InvalidArgument(f"failed to load '{name}': 'promote', 'atol' and 'rtol' "
                                  f"need a 'golden' set")
        else:
            await self._plain_load(name, config, files)
        self.on_demand.release(name)
        if self.residency.enabled:
            self.residency.loaded(name, self.table.entry(name).serving.values(), cold=False)
            await self.on_demand.settle(name)

    async def _plain_load(self, name: str, config: str | None, files: dict[str, bytes] | None) -> None:
        if files and config is None:
            raise InvalidArgument(f"failed to load '{name}': load with files requires a 'config' parameter")
        from ...repository import check_model_name
        check_model_name(name)
        entry = self.table.entry(name)
        try:
            await self._upload_and_load(name, entry, config, files)
        except TritonError as err:
            raise _load_failed(name, err) from None
        finally:
            if not entry.known() and not entry.lock.locked():
                self.table.forget(name)          # nothing known: no empty index row

    async def _upload_and_load(self, name: str, entry: Entry, config: str | None,
                               files: dict[str, bytes] | None) -> None:
        loop = asyncio.get_running_loop()
        async with entry.lock:
            before, before_config = entry.served(), await loop.run_in_executor(
                None, self.rollout.config_text, name)
            pending: PendingUpload | None = None
            if config is not None or files:
                pending = await loop.run_in_executor(
                    None, self.repository.stage_upload, name, config, dict(files or {}))
            try:
                await self._load_locked(name, entry)
            except BaseException as err:
                if pending is not None:
                    # shielded: a client that went away must not leave the upload half done
                    moved = await asyncio.shield(loop.run_in_executor(None, pending.abort, str(err)))
                    for v in pending.versions:
                        if v in entry.status and entry.status[v].state != READY:
                            entry.status[v] = VersionStatus(
                                UNAVAILABLE, f"{entry.status[v].reason} (set aside in "
                                f"{', '.join(moved) or 'the repository'}; not served after a restart)")
                    entry.fingerprint = await loop.run_in_executor(None, self._fingerprint_or_empty, name)
                raise
            if pending is not None:
                await asyncio.shield(loop.run_in_executor(None, pending.commit))
                if self.options.keep_versions > 0:
                    removed = await loop.run_in_executor(
                        None, self.repository.prune_versions, name, self.options.keep_versions,
                        set(entry.serving))
                    for v in removed:
                        entry.status.pop(v, None)
                    if removed:
                        log.info("model '%s': keep_versions=%d removed versions %s", name,
                                 self.options.keep_versions, removed)
                entry.fingerprint = await loop.run_in_executor(None, self._fingerprint_or_empty, name)
            self.table.want(name)
            after = entry.served()
            if after is not None and after != before:
                await loop.run_in_executor(None, self.rollout.record, name, {
                    "action": "load", "version": after, "previous": before,
                    "previous_config": before_config})

    def _fingerprint_or_empty(self, name: str) -> str:
        # Only polling compares whole-model fingerprints; the walk costs O(versions on disk)
        # per load, which explicit mode would pay for nothing.
        if self.options.model_control_mode != "poll":
            return ""
        try:
            return self.repository.fingerprint(name)
        except (TritonError, FileNotFoundError):
            return ""

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_explicit()
        try:
            self.repository.model_dir(name)      # InvalidArgument for bad names
        except NotFound:
            if name not in self.table:
                return          # tritonserver 2.51 answers 200: nothing to unload
        entry = self.table.get(name)
        dependents = [m for mv in (entry.serving.values() if entry else ()) if is_ensemble(mv.config)
                      for m in composing_models(mv.config)]
        self.on_demand.hold_off(name)
        if entry is not None and entry.canary is not None:
            async with entry.lock:
                await self.rollout.end_canary(entry, "canary stopped: the model was unloaded")
        await self._unload(name)
        if unload_dependents:                    # Triton: an ensemble's composing models go too
            for dependent in dict.fromkeys(dependents):
                await self._unload(dependent)
        # a temporary copy (the tuner's, the planner's) leaves the repository with its unload
        if await asyncio.get_running_loop().run_in_executor(None, self.repository.remove_temporary, name):
            self.table.forget(name)
            self.on_demand.release(name)

    async def _unload(self, name: str) -> None:
        self.table.unwant(name)
        entry = self.table.get(name)
        if entry is None:
            return
        async with entry.lock:
            old = entry.serve({})
            for v, mv in old.items():
                entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")
            await asyncio.gather(*(mv.unload(drain_seconds=self.options.unload_timeout_secs)
                                   for mv in old.values()))
            for v in old:
                entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")

    async def _load(self, name: str) -> None:
        self.repository.model_dir(name)
        entry = self.table.entry(name)
        async with entry.lock:
            await self._load_locked(name, entry)

    async def _load_locked(self, name: str, entry: Entry) -> None:
        """(Re)load a model from the repository. New versions become READY before old ones
        stop serving; if anything fails, what was serving keeps serving. A version pinned by a
        rollback gives way to a newer one on disk (repository/pins.py), unless it fails."""
        loop = asyncio.get_running_loop()
        pinned = None
        try:
            pinned = await loop.run_in_executor(None, self.repository.release_pin, name)
            await self._load_versions(name, entry)
        except BaseException as err:
            if pinned is not None:
                await asyncio.shield(loop.run_in_executor(
                    None, self.repository.restore_config, name, pinned))
            entry.failed = True
            entry.last_error = str(err)
            raise
        entry.failed = False
        entry.last_error = ""

    async def _load_versions(self, name: str, entry: Entry) -> None:
        model_dir = self.repository.model_dir(name)
        loop = asyncio.get_running_loop()
        # Taken before any file is read, and kept whatever the outcome: a file still being
        # written while this load reads it changes the fingerprint after this point, so the
        # next poll loads the model again at once (unchanged files only after a back-off).
        if self.options.model_control_mode == "poll":
            entry.fingerprint = await loop.run_in_executor(None, self._fingerprint_or_empty, name)
        entry.waits_on = {}
        try:
            config, backend, versions = await loop.run_in_executor(None, self._prepare, name, model_dir)
        except TritonError as err:
            stage = getattr(err, "load_stage", None)
            if isinstance(stage, int):       # one version's files: that version's state
                entry.status[stage] = VersionStatus(UNAVAILABLE, str(err))
                entry.reason = ""
            else:
                entry.reason = str(err)
            raise
        entry.reason = ""
        if backend == ENSEMBLE_BACKEND:
            await self._load_composing(name, config)
            entry.waits_on = {m: self.table.changes(m) for m in composing_models(config)}
        identities = await loop.run_in_executor(None, self._identities, name, config, versions)
        # a version whose files and config did not change keeps serving as it is; one staged
        # for promotion is served as it was checked, not loaded again
        keep = {v: mv for v, mv in {**entry.staged, **entry.serving}.items()
                if v in versions and identities[v] == mv.identity}
        entry.staged = {v: mv for v, mv in entry.staged.items() if v not in keep}
        fresh: dict[int, ModelVersion] = {}
        errors: list[tuple[int, TritonError]] = []
        for v in versions:
            if v in keep:
                continue
            mv = self._new_version(config, backend, model_dir, identities[v])
            entry.status[v] = VersionStatus("LOADING")
            try:
                await mv.load()
                fresh[v] = mv
            except Exception as err:  # the failing version's reason; the rest stays as it was
                terr = err if isinstance(err, TritonError) else InvalidArgument(
                    f"{type(err).__name__}: {err}")
                terr.load_stage = v  # type: ignore[attr-defined]
                (log.debug if str(terr) == entry.last_error else log.warning)(
                    "loading %s v%d failed: %s", name, v, terr)
                errors.append((v, terr))
        if errors:
            for v, mv in fresh.items():
                await mv.unload(drain_seconds=0, close_seconds=self.options.exit_timeout_secs)
            for v, err in errors:
                entry.status[v] = VersionStatus(UNAVAILABLE, str(err))
            for v in fresh:
                entry.status[v] = VersionStatus(UNAVAILABLE, "not loaded: another version failed")
            for v, mv in entry.serving.items():
                entry.status[v] = VersionStatus(READY)
            raise errors[0][1]
        entry.waits_on = {}
        retired = {v: mv for v, mv in entry.serve({**keep, **fresh}).items() if v not in keep}
        for v in entry.serving:
            entry.status[v] = VersionStatus(READY)
        for v, mv in retired.items():
            if v not in entry.serving:          # a version reloaded in place stays READY
                entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")
            task = asyncio.ensure_future(mv.unload(drain_seconds=self.options.unload_timeout_secs))
            self._unloading.add(task)
            task.add_done_callback(self._unloading.discard)

    async def _build_version(self, name: str, version: int) -> ModelVersion:
        """Version ``version`` of ``name`` as the repository has it now, not loaded."""
        loop = asyncio.get_running_loop()
        model_dir = self.repository.model_dir(name)
        config, backend, _ = await loop.run_in_executor(None, self._prepare, name, model_dir)
        identities = await loop.run_in_executor(None, self._identities, name, config, [version])
        return self._new_version(config, backend, model_dir, identities[version])

    def _new_version(self, config: mc.ModelConfig, backend: str, model_dir: Path,
                     identity: VersionIdentity) -> ModelVersion:
        mv = ModelVersion(_copy(config), backend, identity.number, model_dir, self.rate_limiter,
                          (_Composing(self._version), self.infer)
                          if backend == ENSEMBLE_BACKEND else None,
                          max_output_size=self.options.max_output_size,
                          server_calls=self.server_calls, busy_poll=self.busy_poll,
                          identity=identity)
        if (self.response_cache is not None and mv.config.response_cache.enable
                and not mv.decoupled):
            # keyed by the version's identity, not its number: files put under a number
            # that served before never meet the earlier files' answers; an ensemble's by
            # its composing versions' too
            mv.response_cache = self.response_cache.for_model(
                mv.stats, identity, functools.partial(self._composed, mv.config)
                if backend == ENSEMBLE_BACKEND else None)
        mv.stats.histograms = latency_histograms(mv.config, self.options.histogram_latencies,
                                                 self.options.histogram_buckets_ms)
        return mv

    def _composed(self, config: mc.ModelConfig, depth: int = 0) -> bytes | None:
        """What answers an ensemble's steps now (its response cache's key, engine/cache.py):
        each composing model's served and staged versions' identities, and an ensemble's own
        composing ones in turn; None where a canary draws which version answers, or a step's
        model is not there (the request then fails, or is not cached)."""
        if depth > _MAX_NESTING:
            return None
        parts = []
        for step in config.ensemble_scheduling.step:
            entry = self.table.get(step.model_name)
            if entry is None or entry.canary is not None:
                return None
            parts.append(step.model_name.encode() + b"\0")
            for mv in (*entry.serving.values(), *entry.staged.values()):
                parts.append(mv.identity.key)       # every version is made with one (_new_version)
                if mv.backend_name == ENSEMBLE_BACKEND:
                    nested = self._composed(mv.config, depth + 1)
                    if nested is None:
                        return None
                    parts.append(nested)
        return b"".join(parts)

    async def _load_composing(self, name: str, config: mc.ModelConfig) -> None:
        """Triton loads an ensemble's composing models that are not loaded yet; one that fails
        fails the ensemble when it checks its steps."""
        chain = _LOADING.get() + (name,)
        for model in composing_models(config):
            if model in chain or self.model_ready(model) or model not in self.repository.model_names():
                continue
            token = _LOADING.set(chain)
            try:
                await self._load(model)
            except TritonError as err:
                log.error("failed to load model '%s' (composing model of ensemble '%s'): %s",
                          model, name, err)
            finally:
                _LOADING.reset(token)

    def _prepare(self, name: str, model_dir: Path) -> tuple[mc.ModelConfig, str, list[int]]:
        """Read, auto-complete and validate the config; choose versions. Blocking (disk, runtimes)."""
        config = self.repository.read_config(name)
        if is_ensemble(config):                  # nothing to auto-complete: no runtime behind it
            versions = self._select_versions(name, config)
            config = fill_defaults(config)
            validate_config(config)
            return config, ENSEMBLE_BACKEND, versions
        backend = backend_name(config, model_dir)
        versions = self._select_versions(name, config)
        if not versions:
            err = InvalidArgument(f"at least one version must be available under the version "
                                  f"policy of model '{name}'")
            err.load_stage = "versions"  # type: ignore[attr-defined]
            raise err
        cls = backend_class(backend)
        latest = max(versions)
        files = ModelFiles(name, latest, model_dir, model_dir / str(latest),
                           config.default_model_filename or cls.default_filename)
        try:
            if self.options.auto_complete_config:
                config = cls.auto_complete_config(config, files)
        except TritonError as err:
            # it read the latest version's files: as in Triton, whose backends complete the
            # config when that version loads, the version failed, not the model's config
            err.load_stage = latest  # type: ignore[attr-defined]
            raise
        config = fill_defaults(config)
        # what tritonserver 2.51 serves back: the backend's file name, and KIND_AUTO placed
        # (on the GPU where there is one, else the CPU) as the instances will be
        if not config.default_model_filename:
            config.default_model_filename = cls.default_filename
        for group in config.instance_group:
            if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
                group.kind = mc.ModelInstanceGroup.Kind.Value(resolve_kind("KIND_AUTO"))
        validate_config(config)
        return config, backend, versions

    def _select_versions(self, name: str, config: mc.ModelConfig) -> list[int]:
        try:
            return self.repository.select_versions(name, config)
        except TritonError as err:
            err.load_stage = "versions"  # type: ignore[attr-defined]
            raise

    def _identities(self, name: str, config: mc.ModelConfig,
                    versions: list[int]) -> dict[int, VersionIdentity]:
        """Per version, what it is as read now (the repository mints it). Blocking (disk)."""
        return {v: self.repository.version_identity(name, v, config) for v in versions}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.options.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:
                log.exception("repository poll failed")

    async def poll_once(self) -> None:
        """Poll mode: load new models, reload changed ones (a model whose last load failed
        counts as changed once its files change), unload removed ones. Reads the
        repository only: nothing on disk is moved or deleted."""
        loop = asyncio.get_running_loop()
        on_disk = await loop.run_in_executor(None, self.repository.fingerprints)
        for name in sorted(on_disk):
            entry = self.table.get(name)
            unchanged = entry is not None and entry.fingerprint == on_disk[name] and not any(
                self.table.changes(m) != n for m, n in entry.waits_on.items())
            if unchanged:
                if not entry.failed:
                    continue
                entry.retry_in -= 1
                if entry.retry_in > 0:
                    continue
            if not (entry is not None and entry.serving) and not self.on_demand.fits_another():
                continue          # past the budget a model loads on its first request (opted in)
            previous = entry.last_error if entry is not None else ""
            self.table.want(name)
            try:
                await self._load(name)
            except (TritonError, OSError) as err:    # OSError: files going away mid-poll
                # the same error as last time is logged once
                (log.debug if str(err) == previous else log.error)(
                    "failed to load model '%s': %s", name, err)
            else:
                if self.residency.enabled:      # measured, as a load at start
                    self.residency.loaded(name, self.table.entry(name).serving.values(), cold=False)
            entry = self.table.get(name)
            if entry is not None:
                entry.retry_every = (min(max(entry.retry_every * 2, 1), MAX_RETRY_POLLS)
                                     if entry.failed and unchanged else int(entry.failed))
                entry.retry_in = entry.retry_every
        for name in set(self.table.names()) - set(on_disk):
            await self._unload(name)
            gone = self.table.get(name)
            if gone is not None:
                gone.fingerprint = ""      # the same files moved back in are a new model


class _Composing:
    """An ensemble's view of its composing models: their configs (to plan the steps) and
    which version serves each now (to name the one a failing step ran on)."""

    def __init__(self, version_of: Callable[[str, str], ModelVersion]) -> None:
        self._version_of = version_of

    def __call__(self, model: str, version: str) -> mc.ModelConfig:
        return self._version_of(model, version).config

    def version(self, model: str, version: str) -> str:
        return str(self._version_of(model, version).version)


def _load_failed(name: str, err: TritonError) -> TritonError:
    """``err`` (same class: same status) in the words tritonserver 2.51 answers a load with:
    the config or files could not be read (``failed to load '<m>', failed to poll from model
    repository``), no version under the policy, or a version that failed to load; NVIDIA's
    model-control examples look for these. The index keeps the bare reason, as Triton's."""
    stage = getattr(err, "load_stage", "poll")
    text = str(err)
    if text.startswith((f"failed to load '{name}'", f"load failed for model '{name}'")):
        return err
    if stage == "poll":
        text = f"failed to load '{name}', failed to poll from model repository: {text}"
    elif stage == "versions":
        text = f"load failed for model '{name}': {text}"
    else:   # Triton answers a version that failed to load with 400, whatever the cause
        return InvalidArgument(
            f"load failed for model '{name}': version {stage} is at UNAVAILABLE state: {text}")
    err.message = text
    err.args = (text,)
    return err


def _copy(config: mc.ModelConfig) -> mc.ModelConfig:
    c = mc.ModelConfig()
    c.CopyFrom(config)
    return c
