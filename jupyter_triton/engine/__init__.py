"""The engine: one object that owns every model's lifecycle and is the single entry point
for every frontend (HTTP, gRPC, metrics). Runs on the server's asyncio loop; never executes
a model on it."""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from .. import __version__
from ..backends import ModelFiles, backend_class, backend_name
from ..config import fill_defaults, validate_config
from ..protocol.datatypes import config_to_triton
from ..protocol.errors import InvalidArgument, NotFound, TritonError, Unavailable
from ..protocol.types import InferRequest, InferResponse
from ..repository import Repository
from .ensemble import BACKEND as ENSEMBLE_BACKEND, composing_models, is_ensemble
from .rate_limiter import RateLimiter
from .model import READY, UNAVAILABLE, ModelVersion, VersionStatus

log = logging.getLogger(__name__)

# models this task is loading, outermost first: an ensemble loads its composing models, and
# one that (indirectly) contains itself must fail instead of waiting on its own lock
_LOADING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("loading", default=())

CONTROL_MODES = ("none", "explicit", "poll")

# Advertised only because each works end to end (perf_analyzer reads this list).
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "binary_tensor_data", "parameters",
              "statistics"]


@dataclass
class EngineOptions:
    model_repository: Path
    model_control_mode: str = "none"
    load_models: list[str] = field(default_factory=list)   # explicit mode: names, or "*"
    repository_poll_secs: float = 15.0
    summary_latencies: bool = False
    max_input_size: int = 64 * 1024 * 1024
    exit_on_error: bool = False


@dataclass
class _Entry:
    """Everything known about one model name."""
    name: str
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    status: dict[int, VersionStatus] = field(default_factory=dict)
    fingerprint: str = ""
    reason: str = ""            # why the model as a whole could not be prepared
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Engine:
    def __init__(self, options: EngineOptions) -> None:
        if options.model_control_mode not in CONTROL_MODES:
            raise ValueError(f"model control mode must be one of {CONTROL_MODES}")
        self.options = options
        self.repository = Repository(Path(options.model_repository))
        self._entries: dict[str, _Entry] = {}
        self._started = False
        self._poller: asyncio.Task | None = None
        self._unloading: set[asyncio.Task] = set()
        # Triton's rate limiter spans models: one per engine.
        self.rate_limiter = RateLimiter()

    # ---- lifecycle of the engine -------------------------------------------------------
    async def start(self) -> None:
        mode = self.options.model_control_mode
        names = self.repository.model_names()
        if mode == "explicit":
            wanted = self.options.load_models
            names = names if "*" in wanted else [n for n in wanted]
        for name in names:
            try:
                await self._load(name)
            except TritonError as err:
                log.error("failed to load model '%s': %s", name, err)
                if self.options.exit_on_error:
                    raise
        if mode == "poll":
            self._poller = asyncio.ensure_future(self._poll())
        self._started = True

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
        for entry in list(self._entries.values()):
            for mv in list(entry.serving.values()):
                await mv.unload(drain_seconds=5.0)
            entry.serving.clear()
        if self._unloading:
            await asyncio.gather(*self._unloading, return_exceptions=True)
        self._started = False

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._started

    def server_metadata(self) -> dict:
        return {"name": "jupyter_triton", "version": __version__, "extensions": list(EXTENSIONS)}

    # ---- data path ---------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        return await self._version(request.model_name, request.model_version).infer(request)

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
        return [mv for e in self._entries.values() for mv in e.serving.values()]

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self._version(name, version).ready
        except TritonError:
            return False

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self._version(name, version).config

    def model_metadata(self, name: str, version: str = "") -> dict:
        mv = self._version(name, version)
        cfg = mv.config
        lead = [-1] if cfg.max_batch_size > 0 else []

        def tensors(items) -> list[dict]:
            return [{"name": t.name, "datatype": config_to_triton(mc.DataType.Name(t.data_type)),
                     "shape": lead + list(t.dims)} for t in items]

        entry = self._entries[name]
        return {"name": name, "versions": [str(v) for v in sorted(entry.serving)],
                "platform": cfg.platform or cfg.backend,
                "inputs": tensors(cfg.input), "outputs": tensors(cfg.output)}

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        rows = []
        names = sorted(set(self.repository.model_names()) | set(self._entries))
        for name in names:
            entry = self._entries.get(name)
            if entry is None or not entry.status:
                if not ready_only:
                    rows.append({"name": name, "version": "", "state": UNAVAILABLE,
                                 "reason": entry.reason} if entry and entry.reason else {"name": name})
                continue
            for version, status in sorted(entry.status.items()):
                if ready_only and status.state != READY:
                    continue
                rows.append({"name": name, "version": str(version), "state": status.state,
                             "reason": status.reason})
        return rows

    def statistics(self, name: str = "", version: str = "") -> dict:
        if name:
            if version:
                versions = [self._version(name, version)]
            else:
                entry = self._entries.get(name)
                if entry is None or not entry.serving:
                    raise NotFound(f"requested model '{name}' is not available")
                versions = [entry.serving[v] for v in sorted(entry.serving)]
        else:
            versions = self.models()
        return {"model_stats": [mv.stats.to_json() for mv in versions]}

    def _version(self, name: str, version: str = "") -> ModelVersion:
        entry = self._entries.get(name)
        if entry is None or not (entry.serving or entry.status or entry.reason):
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version in ("", None):
            ready = [v for v, mv in entry.serving.items() if mv.ready]
            if not ready:
                reasons = "; ".join([s.reason for s in entry.status.values() if s.reason]
                                    + ([entry.reason] if entry.reason else []))
                raise Unavailable(f"Request for unknown model: '{name}' has no available versions"
                                  + (f" ({reasons})" if reasons else ""))
            return entry.serving[max(ready)]
        try:
            v = int(version)
        except ValueError:
            raise InvalidArgument(f"model version must be an integer, got '{version}'") from None
        mv = entry.serving.get(v)
        if mv is None:
            if v in entry.status:
                raise Unavailable(f"Request for unknown model: '{name}' version {v} is not at ready state")
            raise NotFound(f"Request for unknown model: '{name}' version {v} is not found")
        return mv

    # ---- control path ------------------------------------------------------------------
    async def load_model(self, name: str, config: str | None = None,
                         files: dict[str, bytes] | None = None) -> None:
        if self.options.model_control_mode != "explicit":
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled"
                              if self.options.model_control_mode == "poll" else
                              "explicit model load / unload is not allowed with model control mode 'none'")
        if files and config is None:
            raise InvalidArgument(f"failed to load '{name}': load with files requires a 'config' parameter")
        if config is not None or files:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.repository.write_upload, name, config, dict(files or {}))
        await self._load(name)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        if self.options.model_control_mode != "explicit":
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled"
                              if self.options.model_control_mode == "poll" else
                              "explicit model load / unload is not allowed with model control mode 'none'")
        self.repository.model_dir(name)          # NotFound / InvalidArgument for bad names
        entry = self._entries.get(name)
        dependents = [m for mv in (entry.serving.values() if entry else ()) if is_ensemble(mv.config)
                      for m in composing_models(mv.config)]
        await self._unload(name)
        if unload_dependents:                    # Triton: an ensemble's composing models go too
            for dependent in dict.fromkeys(dependents):
                await self._unload(dependent)

    async def _unload(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        async with entry.lock:
            old, entry.serving = entry.serving, {}
            for v, mv in old.items():
                entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")
            await asyncio.gather(*(mv.unload() for mv in old.values()))
            for v in old:
                entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")

    async def _load(self, name: str) -> None:
        """(Re)load a model from the repository. New versions become READY before old ones
        stop serving; if anything fails, what was serving keeps serving."""
        model_dir = self.repository.model_dir(name)
        entry = self._entries.setdefault(name, _Entry(name))
        async with entry.lock:
            loop = asyncio.get_running_loop()
            try:
                config, backend, versions = await loop.run_in_executor(None, self._prepare, name, model_dir)
            except TritonError as err:
                entry.reason = str(err)
                raise
            entry.reason = ""
            if backend == ENSEMBLE_BACKEND:
                await self._load_composing(name, config)
            stamp = _stamp(config, model_dir, versions)
            keep = {v: mv for v, mv in entry.serving.items()
                    if v in versions and stamp.get(v) == getattr(mv, "stamp", None)}
            fresh: dict[int, ModelVersion] = {}
            errors: list[tuple[int, TritonError]] = []
            for v in versions:
                if v in keep:
                    continue
                mv = ModelVersion(_copy(config), backend, v, model_dir, self.rate_limiter,
                                  (lambda m, ver: self._version(m, ver).config, self.infer)
                                  if backend == ENSEMBLE_BACKEND else None)
                mv.stamp = stamp[v]
                entry.status[v] = VersionStatus("LOADING")
                try:
                    await mv.load()
                    fresh[v] = mv
                except Exception as err:  # the failing version's reason; the rest stays as it was
                    terr = err if isinstance(err, TritonError) else InvalidArgument(
                        f"failed to load '{name}' version {v}: {type(err).__name__}: {err}")
                    log.warning("loading %s v%d failed: %s", name, v, terr)
                    errors.append((v, terr))
            if errors:
                for v, mv in fresh.items():
                    await mv.unload(drain_seconds=0)
                for v, err in errors:
                    entry.status[v] = VersionStatus(UNAVAILABLE, str(err))
                for v in fresh:
                    entry.status[v] = VersionStatus(UNAVAILABLE, "not loaded: another version failed")
                for v, mv in entry.serving.items():
                    entry.status[v] = VersionStatus(READY)
                raise errors[0][1]
            retired = {v: mv for v, mv in entry.serving.items() if v not in keep}
            entry.serving = {**keep, **fresh}
            entry.fingerprint = self.repository.fingerprint(name)
            for v in entry.serving:
                entry.status[v] = VersionStatus(READY)
            for v, mv in retired.items():
                if v not in entry.serving:          # a version reloaded in place stays READY
                    entry.status[v] = VersionStatus(UNAVAILABLE, "unloaded")
                task = asyncio.ensure_future(mv.unload())
                self._unloading.add(task)
                task.add_done_callback(self._unloading.discard)

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
            versions = self.repository.select_versions(name, config)
            config = fill_defaults(config)
            validate_config(config)
            return config, ENSEMBLE_BACKEND, versions
        backend = backend_name(config, model_dir)
        versions = self.repository.select_versions(name, config)
        if not versions:
            raise InvalidArgument(f"at least one version must be available under the version "
                                  f"policy of model '{name}'")
        cls = backend_class(backend)
        latest = max(versions)
        files = ModelFiles(name, latest, model_dir, model_dir / str(latest),
                           config.default_model_filename or cls.default_filename)
        config = cls.auto_complete_config(config, files)
        config = fill_defaults(config)
        validate_config(config)
        return config, backend, versions

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.options.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:
                log.exception("repository poll failed")

    async def poll_once(self) -> None:
        """Poll mode: load new models, reload changed ones, unload removed ones."""
        on_disk = set(self.repository.model_names())
        for name in sorted(on_disk):
            entry = self._entries.get(name)
            if entry is None or entry.fingerprint != self.repository.fingerprint(name):
                try:
                    await self._load(name)
                except TritonError as err:
                    log.error("failed to load model '%s': %s", name, err)
        for name in set(self._entries) - on_disk:
            await self._unload(name)


def _copy(config: mc.ModelConfig) -> mc.ModelConfig:
    c = mc.ModelConfig()
    c.CopyFrom(config)
    return c


def _stamp(config: mc.ModelConfig, model_dir: Path, versions: list[int]) -> dict[int, str]:
    """Per version: a digest of the config and of the version directory's files, so a reload
    keeps versions whose bytes did not change."""
    base = config.SerializeToString(deterministic=True)
    out = {}
    for v in versions:
        h = hashlib.sha1(base)
        vdir = model_dir / str(v)
        for p in sorted(vdir.rglob("*")):
            if p.is_file():
                st = p.stat()
                h.update(f"{p.relative_to(vdir)}:{st.st_size}:{st.st_mtime_ns}".encode())
        out[v] = h.hexdigest()
    return out


__all__ = ["Engine", "EngineOptions", "CONTROL_MODES", "EXTENSIONS"]
