"""The Jupyter server extension: one Engine in the server, the v2 routes under base_url.

Auth: every v2 route is admitted in ``prepare`` (so that no route can forget it) by the
server's one admission (``frontends.admission``), at the door of these routes: our own
credentials first (scoped inference keys: never load/unload, never shared memory
registration; the per-server token that kernels inherit: every v2 route, never the rest of
Jupyter), then Jupyter's own identity provider and authorizer (resource ``jupyter_triton``:
"read", "write", or "execute" for load and unload, since loading a model runs its code),
asked through the hook this module gives the admission. The gRPC port and the HTTP data port
are doors of the same admission, taking the same credentials in a header
(``server_access``), under one bytes-in-flight budget.
"""
from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import secrets
import stat
import sys
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir
from jupyter_server.auth import User
from jupyter_server.base.call_context import CallContext
from jupyter_server.base.handlers import JupyterHandler
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.log import log_request as jupyter_log_request
from jupyter_server.prometheus import log_functions as jupyter_prometheus
from jupyter_server.prometheus.log_functions import prometheus_log_method
from jupyter_server.utils import url_path_join
from tornado import httputil, routing, web
from traitlets import Bool, Float, Int, List, TraitError, Unicode, default, validate

from .engine import CONTROL_MODES, Engine, EngineOptions
from .jupyter_auth import (CACHE_KEY, JupyterIdentity, default_headers, new_cache,
                           observe_duration, stock_token_auth)
from .frontends.admission import (AUTH_RESOURCE, GROUPS, INFERENCE_SCOPE, AccessPolicy, Admission,
                                  Caller, Door)
from .frontends.http import SETTINGS_KEY, FrontendState, route_table

ENV_URL, ENV_TOKEN = "JUPYTER_TRITON_URL", "JUPYTER_TRITON_TOKEN"

def _shows_debug(logger: logging.Logger) -> bool:
    """Whether a DEBUG record of ``logger`` reaches any handler that would write it."""
    if not logger.isEnabledFor(logging.DEBUG):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if any(h.level <= logging.DEBUG for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


class _RememberedRoutes(routing.ReversibleRouter):
    """Our route table's router (tornado's own, unchanged) with what each path matched
    remembered: the match depends on the path alone (every rule is a path pattern), so the
    same rule and arguments come out as from tornado's walk through the patterns. Paths
    outside the literal prefix every pattern starts with match none of them."""

    LIMIT = 1024                 # paths remembered (the path is the client's choice)

    def __init__(self, router: routing.RuleRouter, prefixes: tuple[str, ...] | None) -> None:
        self.router, self.prefixes = router, prefixes
        self.prefix = prefixes[0] if prefixes else None
        self.rules = router.rules
        self.matches: dict[str, tuple] = {}

    def find_handler(self, request: httputil.HTTPServerRequest, **kwargs):
        path = request.path
        if self.prefixes is not None and not path.startswith(self.prefixes):
            return None
        hit = self.matches.get(path)
        if hit is None:
            for rule in self.router.rules:
                params = rule.matcher.match(request)
                if params is not None:
                    break
            else:
                return None
            if len(self.matches) >= self.LIMIT:
                self.matches.clear()
            hit = self.matches[path] = (rule.target, tuple(params.get("path_args", ())),
                                        params.get("path_kwargs", {}), rule.target_kwargs)
        target, args, params, target_kwargs = hit
        if target_kwargs:
            return self.router.get_target_delegate(target, request, path_args=list(args),
                                                   path_kwargs=dict(params),
                                                   target_kwargs=target_kwargs)
        return self.router.get_target_delegate(target, request, path_args=list(args),
                                               path_kwargs=dict(params))

    def reverse_url(self, name: str, *args):
        return self.router.reverse_url(name, *args)


def remember_routes(web_app: web.Application, classes: set[type]) -> bool:
    """Put ``_RememberedRoutes`` in front of the router of our route table (in place: the
    order of every extension's routes stays as Jupyter made it). False: not found, or a
    rule that is not a plain path pattern to a handler class (then nothing changes)."""
    for rule in web_app.default_router.rules:
        router = rule.target
        rules = getattr(router, "rules", None)
        if (not isinstance(router, routing.RuleRouter) or not rules
                or not {r.target for r in rules} <= classes):
            continue
        if not all(type(r.matcher) is routing.PathMatches for r in rules):
            return False
        base = web_app.settings.get("base_url", "/")
        # v2/ (Triton's routes) and v1/ (OpenAI's, frontends/openai.py)
        prefixes: tuple[str, ...] | None = (url_path_join(base, "v2"), url_path_join(base, "v1"))
        # The prefix test is sound only where the prefix reads literally as a pattern.
        if not (all(c.isalnum() or c in "/_-~" for c in "".join(prefixes))
                and all(r.matcher.regex.pattern.startswith(prefixes) for r in rules)):
            prefixes = None
        rule.target = _RememberedRoutes(router, prefixes)
        return True
    return False


class TritonJupyterHandler(JupyterHandler):
    """Host base class for the v2 mixins on the Jupyter server."""

    auth_resource = AUTH_RESOURCE
    _triton_authorized = False

    def set_default_headers(self) -> None:
        # Jupyter's default headers (X-Content-Type-Options, the configured headers, the
        # Content-Security-Policy built from settings) are the same for every request of a
        # route class: found once per class (jupyter_auth.default_headers, Jupyter's own
        # method asked), then set on each reply as Jupyter sets them.
        cache = self.settings.get(CACHE_KEY)
        if cache is None:
            super().set_default_headers()
            return
        defaults = cache["defaults"]
        pairs = defaults.get(type(self))
        if pairs is None:
            pairs = defaults[type(self)] = default_headers(self.application, type(self),
                                                           TritonJupyterHandler) or False
        if pairs is False:
            super().set_default_headers()
            return
        for name, value in pairs:
            try:
                self.set_header(name, value)
            except Exception as err:        # tornado refuses some (as Jupyter logs them)
                self.log.exception("Could not set default headers: %s", err)

    def check_xsrf_cookie(self) -> None:
        # Jupyter's prepare checks _xsrf before it refuses a request it found no user for, so a
        # POST with no credential would be told about a form field: say what is missing.
        if getattr(self, "_jupyter_current_user", ...) is None:
            raise web.HTTPError(403, _authentication_required(self.route.api_group))
        super().check_xsrf_cookie()

    def check_host(self) -> bool:
        # Allowing a given Host header is constant (settings are fixed at start), except for
        # UNIX-socket paths, which Jupyter checks on disk each time. Refusals are not cached:
        # Jupyter logs each one.
        hosts: set[str] = self.settings[CACHE_KEY]["hosts"]
        host = self.request.host
        if host in hosts:
            return True
        allowed = super().check_host()
        if allowed and not host.startswith(("/", "%2F", "%2f")):
            if len(hosts) >= 256:          # bounded: the Host header is the client's choice
                hosts.clear()
            hosts.add(host)
        return allowed

    def _jupyter_token_user(self, credential: str) -> User | None:
        """The user Jupyter's identity provider would find for a request that carries the
        server's token in its Authorization header and nothing else (no cookie, no ?token=),
        without minting a login cookie for a client that never sends cookies back."""
        provider = self.identity_provider
        token = provider.token
        cache = self.settings[CACHE_KEY]
        stock = cache.get("stock")
        if stock is None:
            stock = cache["stock"] = stock_token_auth(provider)
        if (not stock or not token or self.request.headers.get("Cookie") is not None
                or "token" in self.request.query_arguments
                or not hmac.compare_digest(credential.encode(), token.encode())):
            return None
        if cache.get("token_user") is None:
            # What Jupyter does for a token without a cookie: an anonymous user (Jupyter makes
            # a fresh one per request; one per server is as anonymous and costs nothing).
            cache["token_user"] = provider.generate_anonymous_user(self)
        return cache["token_user"]

    def _log(self) -> None:
        # Jupyter's access log writes successes at DEBUG, which its default logging config
        # drops at the handler after the record and the message are built: on the data path
        # that is a real part of a small request's CPU (see benchmarks/results/notes-frontends.md).
        # When no handler would show that line, keep
        # only what it records (Jupyter's request-duration metric); otherwise, Jupyter's own.
        # A server with a log function of its own (JupyterHub's single-user server writes every
        # request at INFO, a line per request of every load test) gets our successes at DEBUG;
        # its function still sees every error.
        log_function = self.settings.get("log_function")
        status = self.get_status()
        if status >= 400:
            super()._log()
            return
        jupyters = (isinstance(log_function, functools.partial) and not log_function.args
                    and log_function.func is jupyter_log_request)
        if jupyters and _shows_debug(self.log):
            super()._log()
            return
        if not jupyters or log_function.keywords.get("record_prometheus_metrics", True):
            self._observe_duration(status)
        if not jupyters and _shows_debug(self.log):
            self.log.debug("%d %s %.2fms", status, self._request_summary(),
                           1000.0 * self.request.request_time())

    def _observe_duration(self, status: int) -> None:
        """Jupyter's ``prometheus_log_method``: the request's duration in its histogram,
        labelled as Jupyter labels it."""
        if jupyter_prometheus.prometheus_log_method is not prometheus_log_method:
            prometheus_log_method(self)       # replaced by someone: theirs, as Jupyter would
            return
        cls = type(self)
        observe_duration(self.settings, self.request.method, f"{cls.__module__}.{cls.__name__}",
                         status, self.request.request_time())

    async def prepare(self) -> None:
        # The body of a route that does not stream it is here already: admitted at its size.
        length = getattr(self, "_length", None) if self.route.streams_body \
            else len(self.request.body or b"")
        ticket = self._ticket = self.state.plane.admit(
            self.route, self.request.method or "GET", self.request.headers, length, self)
        if ticket.pending is not None:
            await ticket.pending
        caller = ticket.caller
        if caller is not None and caller.authorize is None:     # ours, not a Jupyter user
            self.current_user = self._jupyter_current_user = User(username=caller.name)
        self._triton_authorized = True

    def on_finish(self) -> None:
        if self._ticket is not None:    # refused by tornado after prepare (405), or served
            self._ticket.release()
        super().on_finish()

    async def jupyter_caller(self, credential: str) -> Caller | None:
        """Who Jupyter's identity provider finds for this request (the Jupyter token in its
        Authorization header, a login cookie, a JupyterHub token), with its authorizer's
        answers; None: nobody (the admission's ``IdentityHook.identify``)."""
        if credential and (user := self._jupyter_token_user(credential)) is not None:
            # jupyter_server's JupyterHandler.prepare, step by step, for this one case.
            CallContext.set(CallContext.JUPYTER_HANDLER, self)
            if not self.check_host():
                raise web.HTTPError(403)
            self.current_user = self._jupyter_current_user = user
            self._token_authenticated = True
            self.set_cors_headers()
            if self.request.method not in {"GET", "HEAD", "OPTIONS"}:
                self.check_xsrf_cookie()
        else:
            try:
                await JupyterHandler.prepare(self, _redirect_to_login=False)
            except web.HTTPError as err:     # Jupyter's bare 403 for a request with no user
                if (err.status_code == 403 and err.log_message is None
                        and self.current_user is None and self.check_host()):
                    return None
                raise
            if self.current_user is None:
                return None
        user, authorizer = self.current_user, self.authorizer
        return Caller(getattr(user, "username", ""), authorize=lambda group, action:
                      authorizer.is_authorized(self, user, action, AUTH_RESOURCE))


class _JupyterSide:
    """Jupyter's own identity, as the admission asks it of a request on Jupyter's port
    (``frontends.admission.IdentityHook``), through its tornado handler."""

    def signed_in(self, handler: TritonJupyterHandler | None) -> bool:
        return handler is not None and \
            handler.get_cookie(handler.cookie_name or "", None) is not None

    async def identify(self, handler: TritonJupyterHandler, credential: str) -> Caller | None:
        return await handler.jupyter_caller(credential)


def _jupyter_host(host: str, handler: TritonJupyterHandler | None) -> bool:
    return handler is not None and bool(handler.check_host())


def _authentication_required(group: str) -> str:
    return (f"authentication required for the '{group}' API (Authorization: token <Jupyter token>, "
            "or Bearer <inference key>; or a login cookie with its _xsrf)")


def _guard(method):
    # prepare() has authenticated and authorized the request (with the route's own action);
    # the guard refuses a method reached any other way (a prepare that was overridden
    # without calling it), and carries @web.authenticated, as Jupyter checks of every handler.
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if not self._triton_authorized:
            raise web.HTTPError(403, f"not authorized to use {AUTH_RESOURCE}")
        return method(self, *args, **kwargs)
    authenticated = web.authenticated(checked)

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        # a refusal of the head that the infer route kept until its body had passed (http.py)
        refused = getattr(self, "_body_error", None)
        if refused is not None and not self._triton_authorized:
            raise refused
        return authenticated(self, *args, **kwargs)
    return guarded


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
    inference_keys = List(Unicode(), help="keys accepted as 'Authorization: Bearer <key>' (HTTP header or gRPC "
                                          "metadata) on what a client and perf_analyzer use: health, metadata, "
                                          "config, inference, statistics; never shared memory (a region is any "
                                          "/dev/shm object the server can open), never the repository API "
                                          "(load/unload, index), never the rest of Jupyter").tag(config=True)
    allow_anonymous_inference = Bool(False, help="let requests without credentials reach what an inference key "
                                                 "reaches").tag(config=True)
    summary_latencies = Bool(False, help="also export Triton's latency summaries").tag(config=True)
    # On by default here (tritonserver: off): the dashboard's percentiles come from them, and
    # they cost a small part of an inference's CPU (benchmarks/histogram_cost.py; see
    # benchmarks/results/notes-frontends.md)
    histogram_latencies = Bool(True, help="export latency histograms (tritonserver's "
                               "--metrics-config histogram_latencies=true; the dashboard's "
                               "p50/p99)").tag(config=True)
    histogram_buckets_ms = List(Float(), help="bucket bounds (ms) of the request/queue/compute "
                                "histograms (empty: the defaults)").tag(config=True)
    trace_config = List(Unicode(), help="tritonserver's --trace-config values, e.g. "
                        "['level=TIMESTAMPS', 'rate=100', 'triton,file=/tmp/trace.json']"
                        ).tag(config=True)
    create_demo_model = Bool(True, help="write a small demo model into a new, empty default repository"
                             ).tag(config=True)
    inference_is_activity = Bool(True, help="inference on any port counts as the server's activity "
                                            "(last_activity: Jupyter's idle shutdown, JupyterHub's "
                                            "culler); False: a server that only serves models is idle"
                                  ).tag(config=True)
    activity_interval = Float(5.0, help="seconds between copies of the latest inference time into "
                                        "the server's activity").tag(config=True)
    grpc_port = Int(0, help="also serve Triton's gRPC protocol on this port (0, the default: a free port, "
                            "which kernels find in the runtime file; -1: off). Each user's server gets "
                            "its own: a fixed port would clash between users of one host").tag(config=True)
    public_url = Unicode("", help="http(s)://host[:port] at which clients reach this server, shown in "
                                  "handles and snippets with the server's own path (in a JupyterHub, its "
                                  "JUPYTERHUB_SERVICE_PREFIX). Default: the hub's public address when it "
                                  "says it (JUPYTERHUB_PUBLIC_URL), else where the user's first request through "
                                  "its proxy came, else the server's own URL"
                          ).tag(config=True)
    grpc_address = Unicode("127.0.0.1", help="address the gRPC port binds (loopback by default; it takes "
                                             "the same credentials as the HTTP routes, in 'authorization' "
                                             "metadata)").tag(config=True)
    # tritonserver's gRPC flags for the gRPC port (milliseconds as there; None: HTTP2Limits' default)
    grpc_keepalive_time = Int(None, allow_none=True, help="ms, as --grpc-keepalive-time").tag(config=True)
    grpc_keepalive_timeout = Int(None, allow_none=True, help="ms, as --grpc-keepalive-timeout").tag(config=True)
    grpc_keepalive_permit_without_calls = Bool(None, allow_none=True, help="as "
                                               "--grpc-keepalive-permit-without-calls").tag(config=True)
    grpc_http2_max_pings_without_data = Int(None, allow_none=True, help="as "
                                            "--grpc-http2-max-pings-without-data").tag(config=True)
    grpc_http2_min_recv_ping_interval_without_data = Int(None, allow_none=True, help="ms, as "
        "--grpc-http2-min-recv-ping-interval-without-data").tag(config=True)
    grpc_http2_max_ping_strikes = Int(None, allow_none=True, help="as --grpc-http2-max-ping-strikes"
                                      ).tag(config=True)
    grpc_max_connection_age = Int(None, allow_none=True, help="ms, as --grpc-max-connection-age").tag(config=True)
    grpc_max_connection_age_grace = Int(None, allow_none=True, help="ms, as --grpc-max-connection-age-grace"
                                        ).tag(config=True)
    grpc_use_ssl = Bool(False, help="serve TLS on the gRPC port (as --grpc-use-ssl)").tag(config=True)
    grpc_use_ssl_mutual = Bool(False, help="TLS, and clients present a certificate grpc_root_cert signed "
                                           "(as --grpc-use-ssl-mutual)").tag(config=True)
    grpc_server_cert = Unicode("", help="PEM certificate (chain) of the gRPC port").tag(config=True)
    grpc_server_key = Unicode("", help="PEM private key of the gRPC port").tag(config=True)
    grpc_root_cert = Unicode("", help="PEM CA that client certificates chain to (mutual TLS)").tag(config=True)
    http_data_port = Int(-1, help="also serve the v2 routes on this port with the fast HTTP front, for "
                                  "high-rate clients (-1: off, 0: any free port); it takes the gRPC port's "
                                  "credentials in the Authorization header: inference keys, the server "
                                  "token, and what Jupyter's identity provider accepts there (the Jupyter "
                                  "token, a JupyterHub API token), never cookies").tag(config=True)
    http_data_address = Unicode("127.0.0.1", help="address the HTTP data port binds").tag(config=True)
    strict_readiness = Bool(True, help="as tritonserver's --strict-readiness: v2/health/ready is false while a "
                                       "model asked to load has no ready version").tag(config=True)
    exit_timeout_secs = Float(5.0, help="at server stop, how long models may finish what they run (a hung "
                                        "model's requests fail after it)").tag(config=True)
    shutdown_drain_secs = Float(0.0, help="at server stop, answer readiness 503 (v2/health/ready, gRPC "
                                          "health NOT_SERVING) while still serving this long on the listeners "
                                          "still open (gRPC, the data port, connections already open: Jupyter "
                                          "closes its own port first), then stop; as jupyter-triton serve's "
                                          "--shutdown-drain-secs (0: stop at once)").tag(config=True)
    unload_timeout_secs = Float(30.0, help="at unload or reload, how long requests in flight may finish"
                                ).tag(config=True)
    max_output_size = Int(1 << 30, help="bytes of outputs one response may carry (past it: 503; 0: no bound)"
                          ).tag(config=True)
    keep_versions = Int(0, help="after an upload, keep the newest N versions of that model on disk and delete "
                                "older ones that are not served (0: delete nothing)").tag(config=True)
    model_residency_bytes = Int(0, help="memory budget of the loaded models, bytes (tritonserver has no such "
                                "flag; ours is --model-residency-bytes): idle models are unloaded, least "
                                "recently used first, to make room for a load. 0: no budget").tag(config=True)
    max_loaded_models = Int(0, help="most models loaded at once, with the same eviction "
                            "(--max-loaded-models). 0: no bound").tag(config=True)
    load_on_demand = Bool(False, help="a request for a repository model that is not loaded loads it "
                          "(--load-on-demand; off: Triton's 404, since a load runs the model's code). A "
                          "model's config parameter load_on_demand says it for that model").tag(config=True)
    response_cache_size = Int(0, help="bytes of Triton's response cache (tritonserver's --cache-config "
                                      "local,size=<bytes>) for models whose config says "
                                      "response_cache { enable: true } (0: no cache)").tag(config=True)
    body_timeout = Float(60.0, help="seconds an infer request body may take to arrive (a client that "
                                    "trickles it holds a connection and its buffer)").tag(config=True)
    max_inflight_bytes = Int(None, allow_none=True, help="request body bytes received or decoded at once, "
                                                         "server-wide (past it: 503; None: 4 x "
                                                         "http_max_input_size)").tag(config=True)
    fast_routes = Bool(True, help="serve the v2 routes' API calls (a token in the Authorization header, no "
                                  "cookie, no Origin, no query) with the fast HTTP front on the Jupyter "
                                  "server's own port, with the same credentials, Host check and answers; "
                                  "every other request is Jupyter's as before (False: all are)"
                       ).tag(config=True)
    busy_poll_us = Int(0, help="after a request for a python model in process mode, the Jupyter server's "
                               "event loop, and the model's worker after a batch of one, poll this long "
                               "instead of sleeping (jupyter-triton serve's --busy-poll-us, which polls "
                               "1000 us by default): lower latency at light load for up to a core while "
                               "requests come. 0 (the default): the notebook's server never polls"
                       ).tag(config=True)
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

    @validate("shutdown_drain_secs")
    def _check_seconds(self, proposal):
        if not 0 <= proposal["value"] < float("inf"):       # NaN fails too
            raise TraitError(f"shutdown_drain_secs must be a number of seconds, 0 or more, "
                             f"got {proposal['value']}")
        return proposal["value"]

    @validate("exit_timeout_secs", "unload_timeout_secs", "max_output_size", "keep_versions",
              "body_timeout", "max_inflight_bytes", "response_cache_size", "busy_poll_us")
    def _check_non_negative(self, proposal):
        value = proposal["value"]
        if value is not None and value < 0:
            raise TraitError(f"{proposal['trait'].name} must be 0 or more, got {value}")
        return value

    def initialize_settings(self) -> None:
        # Config that reached the server after this extension was linked (JupyterLab links
        # after us and only then loads jupyter_lab_config.py) applies too; what the server
        # already gave us (command line, jupyter_server_config) is in it, unchanged.
        self.update_config(self.serverapp.config)
        repo = Path(self.model_repository).expanduser()
        if self.create_demo_model and not repo.exists() and repo == default_repository():
            from .demo import write_demo_repository
            write_demo_repository(repo)
        repo.mkdir(parents=True, exist_ok=True)
        self.engine = Engine(EngineOptions(
            model_repository=repo, model_control_mode=self.model_control_mode,
            load_models=list(self.load_models), repository_poll_secs=self.repository_poll_secs,
            summary_latencies=self.summary_latencies, max_input_size=self.http_max_input_size,
            strict_readiness=self.strict_readiness, exit_timeout_secs=self.exit_timeout_secs,
            unload_timeout_secs=self.unload_timeout_secs, max_output_size=self.max_output_size,
            keep_versions=self.keep_versions, histogram_latencies=self.histogram_latencies,
            histogram_buckets_ms=tuple(self.histogram_buckets_ms), trace_config=list(self.trace_config),
            response_cache_size=self.response_cache_size,
            model_residency_bytes=self.model_residency_bytes,
            max_loaded_models=self.max_loaded_models, load_on_demand=self.load_on_demand,
            busy_poll_us=self.busy_poll_us))
        self.server_token = secrets.token_urlsafe(32)
        # The server's one admission, which every listener asks (the tornado routes, the fast
        # lane, the data port, gRPC); its server-wide credentials are set at start, once
        # Jupyter's identity provider and authorizer can be asked (server_access).
        self.admission = Admission(self.own_credentials(), max_input_size=self.http_max_input_size,
                                   max_inflight_bytes=self.max_inflight_bytes,
                                   identity=_JupyterSide())
        # The tornado routes' door: ours first, then Jupyter's own (cookies and all); anonymous
        # inference where allowed, for a request with no credential and no login.
        own = self.own_credentials()
        if self.allow_anonymous_inference:
            own.anonymous = INFERENCE_SCOPE
        self.settings[SETTINGS_KEY] = FrontendState(
            engine=self.engine, max_input_size=self.http_max_input_size,
            inference_keys=frozenset(self.inference_keys), server_token=self.server_token,
            allow_anonymous_inference=self.allow_anonymous_inference,
            max_inflight_bytes=self.max_inflight_bytes, body_timeout=self.body_timeout,
            admission=self.admission,
            door=Door("jupyter", access=own, hosts=_jupyter_host, jupyter=True))
        self.settings[CACHE_KEY] = new_cache()

    def own_credentials(self) -> AccessPolicy:
        """The credentials of ours the v2 routes take before Jupyter's: the server token
        (every API group) and the inference keys (``INFERENCE_SCOPE``)."""
        tokens = {key: INFERENCE_SCOPE for key in self.inference_keys if key}
        tokens[self.server_token] = GROUPS
        return AccessPolicy(tokens=tokens)

    def grpc_connection_options(self) -> tuple:
        """The gRPC port's HTTP2Limits and GrpcTLS (None: plaintext) from the grpc_* traits;
        a bad value or a certificate that does not load raises TraitError naming the flag."""
        from .frontends.grpc_options import KEEPALIVE_FLAGS, GrpcTLS, http2_limits
        try:
            limits = http2_limits({flag: getattr(self, "grpc_" + flag.replace("-", "_"))
                                   for flag in KEEPALIVE_FLAGS})
            if not (self.grpc_use_ssl or self.grpc_use_ssl_mutual):
                return limits, None
            tls = GrpcTLS(self.grpc_server_cert, self.grpc_server_key, self.grpc_root_cert,
                          mutual=self.grpc_use_ssl_mutual)
            tls.check()
        except ValueError as err:
            raise TraitError(f"JupyterTriton's gRPC port: {err} (each grpc_* trait is "
                             "tritonserver's --grpc-* flag of that name)") from None
        return limits, tls

    def server_access(self, serverapp) -> AccessPolicy:
        """The credentials every listener without a Jupyter handler of its own takes (the gRPC
        and data ports): ours (``own_credentials``), and Jupyter's, asked of its identity
        provider and authorizer (``jupyter_auth.JupyterIdentity``: the Jupyter token, a
        JupyterHub API token, whatever the server is configured to accept in a header), with
        the scopes the authorizer grants; anonymous inference where allowed."""
        identity = JupyterIdentity(serverapp.web_app, TritonJupyterHandler,
                                   serverapp.identity_provider, serverapp.authorizer)
        return AccessPolicy(tokens=self.own_credentials().tokens, verify=identity.known,
                            resolve=identity.ask,
                            anonymous=INFERENCE_SCOPE if self.allow_anonymous_inference else frozenset())

    def initialize_handlers(self) -> None:
        table = route_table(TritonJupyterHandler, "/", guard=_guard)
        self._route_classes = {cls for _, cls in table}
        self.handlers.extend(table)

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        if self.gil_switch_interval is not None:
            sys.setswitchinterval(self.gil_switch_interval)
        await self.engine.start()
        self.admission.access = self.server_access(serverapp)
        # Jupyter added our routes to its web app by now (after initialize_handlers).
        if not remember_routes(serverapp.web_app, getattr(self, "_route_classes", set())):
            self.log.debug("jupyter_triton: route table left as tornado walks it")
        self._fast_routes = None
        if self.fast_routes:
            from . import fast_routes
            classes = getattr(self, "_route_classes", set())
            infer = next((c for c in classes if c.route.name == "ModelInfer"), None)
            if infer is not None:
                labels = {c.route.name: f"{c.__module__}.{c.__name__}" for c in classes}
                self._fast_routes = fast_routes.start(self, serverapp, infer, labels)
        self._collector = None
        try:
            from prometheus_client import REGISTRY
            from .frontends.metrics import TritonMetricsCollector
            # prometheus_client's writer (the server's) renames counters; untyped keeps Triton's names.
            self._collector = TritonMetricsCollector(self.engine, counter_type="unknown")
            REGISTRY.register(self._collector)      # joins the server's own {base_url}metrics
        except ValueError:                             # names already registered by another engine
            self._collector = None
        self._grpc, self.grpc_error = None, ""
        if self.grpc_port >= 0:
            from .frontends.grpc import start_grpc_server
            limits, tls = self.grpc_connection_options()
            try:
                self._grpc, self.bound_grpc_port = await start_grpc_server(
                    self.engine, self.grpc_address, self.grpc_port,
                    access=self.admission.access, admission=self.admission, limits=limits, ssl=tls)
            except OSError as err:
                # said in the runtime file, so handles and kernels show it, not only in this log
                self.grpc_error = (f"{err}: this server has no gRPC port (c.JupyterTriton.grpc_port"
                                   f" = {self.grpc_port}; 0 takes a free one)")
                self.log.error("jupyter_triton: %s", self.grpc_error)
        self._data_front = None
        if self.http_data_port >= 0:
            from .frontends.dataplane import DataPlane
            from .frontends.fasthttp import HTTPFront
            plane = DataPlane(self.engine, admission=self.admission,
                              door=Door("data", strict_content_type=True))
            self._data_front = HTTPFront(plane, access_log=False, body_timeout=self.body_timeout)
            self.bound_http_data_port = await self._data_front.listen(self.http_data_address,
                                                                      self.http_data_port)
        self._activity = None
        if self.inference_is_activity:
            from .activity import InferenceActivity
            self._activity = InferenceActivity(self.engine, serverapp.web_app.settings,
                                               self.activity_interval)
            self._activity.start()
        self._advertise(serverapp)
        ready = [m.name for m in self.engine.models() if m.ready]
        self.log.info("jupyter_triton: %d model(s) ready (%s) from %s at %sv2/", len(ready),
                      ", ".join(sorted(set(ready))) or "none", self.engine.options.model_repository,
                      os.environ[ENV_URL])
        # Port 0 picks a free port: the operator learns which from this line or the runtime file.
        if self._grpc is not None:
            self.log.info("jupyter_triton: gRPC on %s:%d", self.grpc_address, self.bound_grpc_port)
        if self._data_front is not None:
            self.log.info("jupyter_triton: HTTP data port on %s:%d", self.http_data_address,
                          self.bound_http_data_port)

    def _advertise(self, serverapp, learned: str = "") -> None:
        """Tell kernels (which inherit this environment) and other processes where we are."""
        url = serverapp.connection_url.rstrip("/") + "/"
        os.environ[ENV_URL] = url
        os.environ[ENV_TOKEN] = self.server_token
        from .hub import ENV_PUBLIC_URL, in_hub, learn_public_origin, public_address
        self.public_address = public_address(os.environ, self.public_url, serverapp.base_url, learned)
        if self.public_address.url:
            os.environ[ENV_PUBLIC_URL] = self.public_address.url
        elif in_hub(os.environ):      # said again (environment, runtime file) once a request tells it
            learn_public_origin(serverapp.web_app.settings, lambda origin: self._advertise(serverapp, origin))
        runtime = Path(serverapp.runtime_dir)
        runtime.mkdir(parents=True, exist_ok=True)
        self.runtime_file = runtime / f"jupyter_triton-{os.getpid()}.json"
        fd = os.open(self.runtime_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "token": self.server_token, "pid": os.getpid(),
                       "model_repository": str(self.engine.options.model_repository),
                       "grpc_port": self.bound_grpc_port if self._grpc is not None else None,
                       "http_data_port": self.bound_http_data_port
                       if self._data_front is not None else None,
                       "public_url": self.public_address.url, "public_url_note": self.public_address.note,
                       "grpc_error": self.grpc_error}, f)

    async def stop_extension(self) -> None:
        drained = self.shutdown_drain_secs > 0 and getattr(self, "engine", None) is not None
        if drained:
            await self.engine.drain(self.shutdown_drain_secs)
        if getattr(self, "_activity", None) is not None:
            self._activity.stop()
        if getattr(self, "_fast_routes", None) is not None:
            self._fast_routes.uninstall()
            self._fast_routes.stop()
        if getattr(self, "_data_front", None) is not None:
            self._data_front.stop()
            self._data_front.plane.close()
        if getattr(self, "_grpc", None) is not None:
            await self._grpc.stop(grace=self.exit_timeout_secs if drained else 1.0)
        if getattr(self, "_collector", None) is not None:
            from prometheus_client import REGISTRY
            REGISTRY.unregister(self._collector)
        from .hub import ENV_PUBLIC_URL
        for name in (ENV_URL, ENV_TOKEN, ENV_PUBLIC_URL):
            os.environ.pop(name, None)
        runtime_file = getattr(self, "runtime_file", None)
        if runtime_file is not None:
            runtime_file.unlink(missing_ok=True)
        await self.engine.stop()

