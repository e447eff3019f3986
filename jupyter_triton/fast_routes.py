"""The v2 routes' API calls on the Jupyter server's own port, served by the fast HTTP front
(``frontends.shared_port``): tornado's HTTP/1.1 and Jupyter's handler machinery cost most of a
small inference's CPU (see benchmarks/results/notes-frontends.md).

Only what needs nothing of Jupyter but its answers is taken: a GET, HEAD or POST of a v2/v1
route under ``base_url``, with a header credential (``Authorization: token|Bearer <t>``) that
Jupyter's own prepare() would accept for that route's API group, no cookie, no Origin (browsers:
CORS and XSRF are Jupyter's), no query (``?token=``), no chunked body, on a Host that Jupyter's
own ``check_host`` allows: the server's admission decides, at this lane's door, as the tornado
routes' door would for such a request. Everything else, from the first such request on its connection, is
Jupyter's as before. Claimed replies carry Jupyter's default headers (Server, X-Content-Type-
Options, Content-Security-Policy, the configured ``headers``), are counted in Jupyter's
request-duration metric, and failures are logged as Jupyter logs them.

Not taken at all: TLS (``certfile``), CORS settings (``allow_origin``, ``allow_origin_pat``,
``allow_credentials``), and the Jupyter token under a custom identity provider or authorizer
(our own credentials still are: they never ask Jupyter).
"""
from __future__ import annotations

import logging
from typing import Callable

import tornado

from .frontends.admission import AccessPolicy, Door, bearer
from .frontends.dataplane import DataPlane, Reply, Route
from .protocol.errors import PermissionDenied, Unauthenticated
from .frontends.http import SETTINGS_KEY
from .frontends.shared_port import ClaimedMessage, SharedPort
from .jupyter_auth import (CACHE_KEY, jupyter_token_verifier, observe_duration, probe,
                           stock_token_auth)

log = logging.getLogger(__name__)

CLAIMED_METHODS = frozenset({"GET", "HEAD", "POST"})
_NOT_FIXED = frozenset({"date", "content-type", "content-length"})
NO_DEADLINE = 365 * 86400.0


class JupyterPort(SharedPort):
    """The fast lane of one Jupyter server; its body deadline is the routes' own setting, as
    the tornado routes read it per request."""

    def __init__(self, state, door: Door, *args, **kwargs) -> None:
        self.state = state
        super().__init__(DataPlane(state.engine, admission=state.plane.admission, door=door),
                         *args, **kwargs)

    @property
    def body_timeout(self) -> float:
        timeout = self.state.body_timeout
        return timeout if timeout is not None else NO_DEADLINE

    @body_timeout.setter
    def body_timeout(self, value: float) -> None:
        pass                    # it is the state's


def start(extension, serverapp, handler_class: type,
          handler_labels: dict[str, str]) -> SharedPort | None:
    """The fast lane on ``serverapp``'s port (None where it must not be: see above)."""
    web_app = serverapp.web_app
    settings = web_app.settings
    http_server = getattr(serverapp, "_http_server", None)
    if http_server is None or http_server.ssl_options is not None:
        return None
    sample = probe(web_app, handler_class, "localhost")
    if sample.allow_origin or sample.allow_origin_pat or sample.allow_credentials:
        extension.log.info("jupyter_triton: CORS is configured; every v2 request goes "
                           "through Jupyter's handlers")
        return None
    # What every reply of the route class starts with: tornado's Server header, then
    # Jupyter's defaults, recorded by the class's set_default_headers (serverext).
    defaults = settings[CACHE_KEY]["defaults"].get(type(sample))
    if not defaults:
        extension.log.info("jupyter_triton: the v2 routes' default headers are not Jupyter's "
                           "settings alone; every v2 request goes through Jupyter's handlers")
        return None
    fixed = b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                     for name, value in (("Server", f"TornadoServer/{tornado.version}"), *defaults)
                     if name.lower() not in _NOT_FIXED)
    identity = serverapp.identity_provider
    # Jupyter's token only where Jupyter's own prepare() would check it as the verifier does.
    verify = (jupyter_token_verifier(identity, serverapp.authorizer)
              if stock_token_auth(identity) else None)
    hosts: set[str] = settings[CACHE_KEY]["hosts"]

    def host_allowed(host: str, _: object = None) -> bool:
        if host in hosts:
            return True
        try:
            return bool(probe(web_app, handler_class, host).check_host())
        except Exception:            # a Jupyter whose check needs more than a request
            log.debug("Host check of %r could not be asked; left to Jupyter", host, exc_info=True)
            return False

    # Only credentials that need no handler to be judged: ours, and the Jupyter token where
    # Jupyter's own prepare() would check it as the verifier does.
    door = Door("fast-lane", access=AccessPolicy(tokens=extension.own_credentials().tokens,
                                                 verify=verify), hosts=host_allowed)
    state = settings[SETTINGS_KEY]
    admission = state.plane.admission

    def claims(m: ClaimedMessage, route: Route) -> bool:
        """Whether the lane serves ``m``: what only Jupyter's handlers answer (browsers'
        cookies and Origin, a method the route lacks) is theirs; so is a request this door
        refuses for who it is or its Host (Jupyter's door refuses it with Jupyter's words)."""
        headers = m.headers
        if m.method not in CLAIMED_METHODS or "cookie" in headers or "origin" in headers \
                or not bearer(headers) \
                or route.methods.get("GET" if m.method == "HEAD" else m.method) is None:
            return False
        length = headers.get("content-length")
        try:
            m.ticket = admission.admit(door, route.api_group, m.method, headers,
                                       int(length) if length is not None else None,
                                       op=route.name)
        except (PermissionDenied, Unauthenticated):
            return False
        except Exception:       # noqa: BLE001 - its size or budget: the lane answers it
            pass
        return True

    lane = JupyterPort(state, door, http_server, settings.get("base_url", "/"), claims,
                       served=_served(settings, extension.log, handler_labels),
                       fixed_headers=fixed,
                       idle_timeout=http_server.conn_params.header_timeout or 3600.0)
    lane.install()
    return lane


def _served(settings: dict, logger: logging.Logger,
            labels: dict[str, str]) -> Callable[[ClaimedMessage, Reply, float], None]:
    log_function = settings.get("log_function")
    keywords = getattr(log_function, "keywords", None) or {}
    record = keywords.get("record_prometheus_metrics", True)

    def served(m: ClaimedMessage, reply: Reply, seconds: float) -> None:
        status = reply.status
        route = getattr(m, "route", None)
        if record and route is not None:
            observe_duration(settings, m.method, labels.get(route.name, route.name), status,
                             seconds)
        if status >= 400:       # Jupyter's access log: successes at debug, which it drops
            level = logging.WARNING if status < 500 else logging.ERROR
            logger.log(level, "%d %s %s (%s) %.2fms", status, m.method, m.path,
                       "fast route", 1000.0 * seconds)
    return served
