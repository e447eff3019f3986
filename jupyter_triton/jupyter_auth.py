"""What the extension asks of the Jupyter server it runs in, for every listener of it: the
names its settings are kept under, whether a credential is one Jupyter's identity provider and
authorizer accept (and which API groups that reaches: what the admission's policies ask of
Jupyter; the decision is ``frontends.admission``'s), and Jupyter's request-duration metric.

``serverext`` (the tornado routes) and ``fast_routes`` (the fast lane on Jupyter's port) both
read from here; neither reaches into the other.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time

from jupyter_server.auth import IdentityProvider
from jupyter_server.auth.authorizer import AllowAllAuthorizer, Authorizer
from jupyter_server.prometheus import log_functions as jupyter_prometheus
from tornado import httputil, web

from .frontends.admission import ACTION_OF_GROUP, AUTH_RESOURCE, GROUPS

log = logging.getLogger(__name__)
_quiet = logging.getLogger(__name__ + ".probe")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False

CACHE_KEY = "jupyter_triton_auth_cache"     # settings key of what auth finds constant


def new_cache() -> dict:
    """What ``settings[CACHE_KEY]`` starts as: Hosts Jupyter allowed, the anonymous user of
    a header token, whether the token check is Jupyter's stock one, default-header layouts
    per route class, and the labelled children of Jupyter's duration histogram."""
    return {"hosts": set(), "token_user": None, "stock": None, "defaults": {}, "durations": {}}


def stock_token_auth(provider: IdentityProvider) -> bool:
    """Whether ``provider`` authenticates a token exactly as jupyter_server's own
    IdentityProvider does (then a header token equal to ``provider.token`` is Jupyter's
    anonymous token user, with no need to build a handler to ask)."""
    cls = type(provider)
    return all(getattr(cls, name) is getattr(IdentityProvider, name)
               for name in ("get_user", "_get_user", "get_user_token", "get_token"))


def jupyter_token_verifier(identity_provider: IdentityProvider, authorizer: Authorizer):
    """``AccessPolicy.verify`` for the Jupyter server's token where no handler asks Jupyter:
    it reaches every API group, as over HTTP with Jupyter's stock authorizer; with a custom
    authorizer, nothing (it needs a handler to be asked)."""
    stock = type(authorizer) is AllowAllAuthorizer

    def jupyter_token(credential: str) -> frozenset[str] | None:
        token = identity_provider.token
        if stock and token and hmac.compare_digest(credential.encode(), token.encode()):
            return GROUPS
        return None
    return jupyter_token


def observe_duration(settings: dict, method: str | None, handler: str, status: int,
                     seconds: float) -> None:
    """One observation of Jupyter's request-duration histogram, through the labelled child
    found once (a label lookup validates and locks on every call)."""
    metric = jupyter_prometheus.HTTP_REQUEST_DURATION_SECONDS
    children: dict = settings[CACHE_KEY]["durations"]
    key = (method, handler, status)
    entry = children.get(key)
    if entry is None or entry[0] is not metric:
        if len(children) >= 256:          # bounded: the method is the client's choice
            children.clear()
        entry = children[key] = (metric, metric.labels(method=method, handler=handler,
                                                       status_code=status))
    entry[1].observe(seconds)


class _Detached:
    """The connection of a request that never came: Jupyter's handler code is asked what it
    would say (default headers, the Host check, who a credential is) without a client."""
    context = None

    def set_close_callback(self, callback) -> None:
        pass


_PROBES: dict[type, type] = {}


def probe(web_app: web.Application, handler_class: type, host: str,
          headers: dict[str, str] | None = None) -> web.RequestHandler:
    """A handler of ``handler_class`` for a GET with this Host (and ``headers``) and nothing
    else: its ``_headers`` are the defaults every reply starts with; ``check_host()`` is
    Jupyter's; the identity provider can be asked who sent it. One probe class per handler
    class: Jupyter's handlers keep per-class records, and the Host is the client's choice."""
    cls = _PROBES.get(handler_class)
    if cls is None:
        cls = _PROBES[handler_class] = type("Probe", (handler_class,),
                                            {"log": property(lambda self: _quiet)})
    request = httputil.HTTPServerRequest(
        method="GET", uri="/", connection=_Detached(),
        headers=httputil.HTTPHeaders({**(headers or {}), "Host": host}))
    return cls(web_app, request)


def default_headers(web_app: web.Application, handler_class: type,
                    base: type) -> tuple[tuple[str, str], ...] | None:
    """The headers Jupyter's ``set_default_headers`` gives every reply of ``handler_class``
    (X-Content-Type-Options, the configured ``headers``, Content-Security-Policy), as it sets
    them, where they depend on settings alone: no class between ``handler_class`` and
    ``base`` (whose own ``set_default_headers`` is not asked) redefines them. Recorded by
    running Jupyter's own method on a handler of a subclass whose ``set_header`` records."""
    for cls in handler_class.__mro__:
        if cls is base:
            break
        if {"set_default_headers", "content_security_policy", "set_header"} & set(vars(cls)):
            return None
    else:
        return None
    pairs: list[tuple[str, str]] = []
    recorder = type("Recorder", (handler_class,), {
        "clear": lambda self: None,             # not tornado's: only the defaults are asked
        "set_header": lambda self, name, value: pairs.append((name, str(value))),
        "log": property(lambda self: _quiet)})
    request = httputil.HTTPServerRequest(method="GET", uri="/", connection=_Detached(),
                                         headers=httputil.HTTPHeaders({"Host": "localhost"}))
    super(base, recorder(web_app, request)).set_default_headers()
    return tuple(pairs)


class JupyterIdentity:
    """Jupyter's identity provider and authorizer, asked about a credential that came in a
    header where Jupyter has no handler of its own (gRPC metadata, the data port): through a
    handler of ``handler_class`` for a request that carries ``Authorization: token
    <credential>`` alone, with the identity provider's public ``get_user(handler)`` and the
    authorizer's ``is_authorized(handler, user, action, resource)``, as Jupyter's own prepare()
    asks them. So whatever the server is configured with decides (JupyterHub's identity
    provider: a hub API token with access to this server).

    ``known`` says what is known now, without asking (the stock token check, then verdicts
    younger than ``ttl`` seconds); ``ask`` asks, once at a time per credential, and at most
    ``max_asking`` credentials at once (past it: unknown, refused). Verdicts are kept for
    ``ttl`` seconds (JupyterHub's HubAuth keeps its own for 300 s), ``limit`` of them."""

    def __init__(self, web_app: web.Application, handler_class: type,
                 identity_provider: IdentityProvider, authorizer: Authorizer, *,
                 ttl: float = 60.0, limit: int = 1024, max_asking: int = 64) -> None:
        self.web_app, self.handler_class = web_app, handler_class
        self.identity_provider, self.authorizer = identity_provider, authorizer
        self.ttl, self.limit, self.max_asking = ttl, limit, max_asking
        self.stock = jupyter_token_verifier(identity_provider, authorizer)
        self._verdicts: dict[str, tuple[float, frozenset[str] | None]] = {}
        self._asking: dict[str, asyncio.Future] = {}

    def _verdict(self, credential: str) -> tuple[bool, frozenset[str] | None]:
        hit = self._verdicts.get(credential)
        if hit is None:
            return False, None
        if hit[0] < time.monotonic():
            del self._verdicts[credential]
            return False, None
        return True, hit[1]

    def known(self, credential: str) -> frozenset[str] | None:
        """The groups ``credential`` reaches, as far as is known without asking (None)."""
        groups = self.stock(credential)
        return groups if groups is not None else self._verdict(credential)[1]

    async def ask(self, credential: str) -> frozenset[str] | None:
        """The groups ``credential`` reaches (None: not a credential of this server)."""
        groups = self.stock(credential)
        if groups is not None:
            return groups
        found, groups = self._verdict(credential)
        if found:
            return groups
        future = self._asking.get(credential)
        if future is None:
            if len(self._asking) >= self.max_asking:
                return None
            future = self._asking[credential] = asyncio.ensure_future(self._ask(credential))
            future.add_done_callback(lambda _: self._asking.pop(credential, None))
        return await asyncio.shield(future)

    async def _ask(self, credential: str) -> frozenset[str] | None:
        handler = probe(self.web_app, self.handler_class, "127.0.0.1",
                        {"Authorization": f"token {credential}"})
        groups: frozenset[str] | None = None
        try:
            user = self.identity_provider.get_user(handler)
            if inspect.isawaitable(user):
                user = await user
            if user is not None:
                groups = frozenset(group for group, action in ACTION_OF_GROUP.items()
                                   if self.authorizer.is_authorized(handler, user, action,
                                                                    AUTH_RESOURCE))
        except web.HTTPError:           # the identity provider's own refusal
            groups = None
        except Exception:               # noqa: BLE001 - an identity provider that failed: refused
            log.warning("Jupyter's identity provider could not judge a credential", exc_info=True)
            return None                 # not remembered: the next call asks again
        if len(self._verdicts) >= self.limit:
            self._verdicts.clear()
        self._verdicts[credential] = (time.monotonic() + self.ttl, groups)
        return groups
