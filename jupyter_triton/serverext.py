"""The Jupyter server extension: one Engine in the server, the v2 routes under base_url.

Auth: every v2 route goes through Jupyter's identity provider and authorizer (resource
``jupyter_triton``), checked in ``prepare`` so that no route can forget it. Two credentials
of our own are accepted besides Jupyter's: scoped inference keys (inference and metadata
routes only) and the per-server token that kernels inherit (these routes only, never the
rest of Jupyter).
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
import sys
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir
from jupyter_server.auth import User
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.extension.application import ExtensionApp
from tornado import web
from traitlets import Bool, Float, Int, List, Unicode, default, validate

from .engine import CONTROL_MODES, Engine, EngineOptions
from .frontends.http import INFER, SETTINGS_KEY, FrontendState, route_table

AUTH_RESOURCE = "jupyter_triton"
ENV_URL, ENV_TOKEN = "JUPYTER_TRITON_URL", "JUPYTER_TRITON_TOKEN"
_ACTIONS = {"GET": "read", "HEAD": "read", "OPTIONS": "read", "POST": "write",
            "PUT": "write", "PATCH": "write", "DELETE": "write"}


class _ScopedAuthorizer:
    """What a request authenticated by an inference key or the server token may do."""

    def __init__(self, full: bool) -> None:
        self.full = full

    def is_authorized(self, handler, user, action, resource) -> bool:
        return resource == AUTH_RESOURCE and (self.full or handler.scope == INFER)


class TritonJupyterHandler(JupyterHandler):
    """Host base class for the v2 mixins on the Jupyter server."""

    auth_resource = AUTH_RESOURCE
    scope = INFER
    _key_authorizer: _ScopedAuthorizer | None = None

    def _presented_key(self) -> str:
        header = self.request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        return value.strip() if scheme.lower() in ("token", "bearer") else ""

    def _match_key(self, key: str) -> _ScopedAuthorizer | None:
        state: FrontendState = self.settings[SETTINGS_KEY]
        if state.server_token and hmac.compare_digest(key, state.server_token):
            return _ScopedAuthorizer(full=True)
        if any(hmac.compare_digest(key, k) for k in state.inference_keys):
            return _ScopedAuthorizer(full=False)
        return None

    @property
    def authorizer(self):
        return self._key_authorizer or super().authorizer

    async def prepare(self) -> None:
        key = self._presented_key()
        scoped = self._match_key(key) if key else None
        if scoped is not None:
            if not self.check_host():
                raise web.HTTPError(403)
            self._key_authorizer = scoped
            self.current_user = self._jupyter_current_user = User(username="jupyter_triton-key")
        else:
            state: FrontendState = self.settings[SETTINGS_KEY]
            if state.allow_anonymous_inference and self.scope == INFER and not key \
                    and not self.get_cookie(self.cookie_name or "", None):
                self.current_user = self._jupyter_current_user = User(username="anonymous")
                self._key_authorizer = _ScopedAuthorizer(full=False)
            else:
                await super().prepare(_redirect_to_login=False)
                if self.current_user is None:
                    raise web.HTTPError(403, "authentication required")
        action = _ACTIONS.get(self.request.method or "", "write")
        if not self.authorizer.is_authorized(self, self.current_user, action, AUTH_RESOURCE):
            raise web.HTTPError(403, f"not authorized to {action} {AUTH_RESOURCE}"
                                     + (" (inference keys reach inference and metadata routes only)"
                                        if self._key_authorizer else ""))


def _guard(method):
    # prepare() has already authenticated and authorized (inference keys included); the
    # decorators restate it per method, the way Jupyter's own handlers are checked.
    return web.authenticated(authorized(method))


def default_repository() -> Path:
    return Path(jupyter_data_dir()) / "jupyter_triton" / "model_repository"


class JupyterTriton(ExtensionApp):
    name = "jupyter_triton"

    model_repository = Unicode(
        help="Triton model repository served under {base_url}v2/. Default: a folder in the "
             "Jupyter data dir, created with a demo model on first start.").tag(config=True)
    model_control_mode = Unicode(
        "explicit", help="none | explicit | poll, as tritonserver's --model-control-mode").tag(config=True)
    load_models = List(Unicode(), ["*"], help="explicit mode: models loaded at start ('*': all)").tag(config=True)
    repository_poll_secs = Float(15.0, help="poll mode: seconds between repository scans").tag(config=True)
    http_max_input_size = Int(64 * 1024 * 1024, help="largest accepted infer request body, bytes").tag(config=True)
    inference_keys = List(Unicode(), help="keys accepted as 'Authorization: Bearer <key>' on the inference and "
                                          "metadata routes only (never load/unload, never the rest of Jupyter)"
                          ).tag(config=True)
    allow_anonymous_inference = Bool(False, help="let requests without credentials reach the inference and "
                                                 "metadata routes").tag(config=True)
    summary_latencies = Bool(False, help="also export Triton's latency summaries").tag(config=True)
    create_demo_model = Bool(True, help="write a small demo model into a new, empty default repository"
                             ).tag(config=True)
    grpc_port = Int(-1, help="also serve Triton's gRPC protocol on this port (-1: off, 0: any free port)"
                    ).tag(config=True)
    grpc_address = Unicode("127.0.0.1", help="address the gRPC port binds").tag(config=True)
    gil_switch_interval = Float(
        0.0005, allow_none=True,
        help="sys.setswitchinterval for the server process (None: leave Python's 5 ms). Instance "
             "threads get the GIL back sooner after a runtime call, which cuts latency").tag(config=True)

    @default("model_repository")
    def _default_repository(self) -> str:
        return str(default_repository())

    @validate("model_control_mode")
    def _check_mode(self, proposal):
        if proposal["value"] not in CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {CONTROL_MODES}")
        return proposal["value"]

    def initialize_settings(self) -> None:
        repo = Path(self.model_repository).expanduser()
        if self.create_demo_model and not repo.exists() and repo == default_repository():
            from .demo import write_demo_repository
            write_demo_repository(repo)
        repo.mkdir(parents=True, exist_ok=True)
        self.engine = Engine(EngineOptions(
            model_repository=repo, model_control_mode=self.model_control_mode,
            load_models=list(self.load_models), repository_poll_secs=self.repository_poll_secs,
            summary_latencies=self.summary_latencies, max_input_size=self.http_max_input_size))
        self.server_token = secrets.token_urlsafe(32)
        self.settings[SETTINGS_KEY] = FrontendState(
            engine=self.engine, max_input_size=self.http_max_input_size,
            inference_keys=frozenset(self.inference_keys), server_token=self.server_token,
            allow_anonymous_inference=self.allow_anonymous_inference)

    def initialize_handlers(self) -> None:
        self.handlers.extend(route_table(TritonJupyterHandler, "/", guard=_guard))

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        if self.gil_switch_interval is not None:
            sys.setswitchinterval(self.gil_switch_interval)
        await self.engine.start()
        self._collector = None
        try:
            from prometheus_client import REGISTRY
            from .frontends.metrics import TritonMetricsCollector
            # prometheus_client's writer (the server's) renames counters; untyped keeps Triton's names.
            self._collector = TritonMetricsCollector(self.engine, counter_type="unknown")
            REGISTRY.register(self._collector)      # joins the server's own {base_url}metrics
        except ValueError:                             # names already registered by another engine
            self._collector = None
        self._grpc = None
        if self.grpc_port >= 0:
            from .frontends.grpc import start_grpc_server
            self._grpc, self.bound_grpc_port = await start_grpc_server(
                self.engine, self.grpc_address, self.grpc_port)
        self._advertise(serverapp)
        ready = [m.name for m in self.engine.models() if m.ready]
        self.log.info("jupyter_triton: %d model(s) ready (%s) from %s at %sv2/", len(ready),
                      ", ".join(sorted(set(ready))) or "none", self.engine.options.model_repository,
                      os.environ[ENV_URL])

    def _advertise(self, serverapp) -> None:
        """Tell kernels (which inherit this environment) and other processes where we are."""
        url = serverapp.connection_url.rstrip("/") + "/"
        os.environ[ENV_URL] = url
        os.environ[ENV_TOKEN] = self.server_token
        runtime = Path(serverapp.runtime_dir)
        runtime.mkdir(parents=True, exist_ok=True)
        self.runtime_file = runtime / f"jupyter_triton-{os.getpid()}.json"
        fd = os.open(self.runtime_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "token": self.server_token, "pid": os.getpid(),
                       "model_repository": str(self.engine.options.model_repository)}, f)

    async def stop_extension(self) -> None:
        if getattr(self, "_grpc", None) is not None:
            await self._grpc.stop(grace=1.0)
        if getattr(self, "_collector", None) is not None:
            from prometheus_client import REGISTRY
            REGISTRY.unregister(self._collector)
        for name in (ENV_URL, ENV_TOKEN):
            os.environ.pop(name, None)
        runtime_file = getattr(self, "runtime_file", None)
        if runtime_file is not None:
            runtime_file.unlink(missing_ok=True)
        await self.engine.stop()

