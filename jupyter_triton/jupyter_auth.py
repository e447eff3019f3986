"""What the extension asks of the Jupyter server it runs in, for every listener of it: the
names its settings are kept under, whether a credential is one Jupyter's identity provider and
authorizer accept (and which API groups that reaches), and Jupyter's request-duration metric.

``serverext`` (the tornado routes) and ``fast_routes`` (the fast lane on Jupyter's port) both
read from here; neither reaches into the other.
"""
from __future__ import annotations

import hmac

from jupyter_server.auth import IdentityProvider
from jupyter_server.auth.authorizer import AllowAllAuthorizer, Authorizer
from jupyter_server.prometheus import log_functions as jupyter_prometheus

from .frontends.auth import GROUPS

AUTH_RESOURCE = "jupyter_triton"
ACCESS_KEY = "jupyter_triton_access"        # settings key of our own credentials' policy
CACHE_KEY = "jupyter_triton_auth_cache"     # settings key of what auth finds constant
READ, WRITE, EXECUTE = "read", "write", "execute"


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
