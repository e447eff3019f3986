"""Where clients reach a server that a JupyterHub runs, and with which credential.

A hub's single-user server listens on an address of the spawner's choosing (a new port at
each start); users reach it through the hub's proxy at the hub's public address plus the
server's prefix (``JUPYTERHUB_SERVICE_PREFIX``, ``/user/alice/``), which stays the same
across restarts. JupyterHub tells the server that address only when it knows it
(``JupyterHub.public_url`` or ``subdomain_host`` configured): ``JUPYTERHUB_PUBLIC_URL``
(JupyterHub 5) or ``JUPYTERHUB_HOST`` (older); the operator's
``c.JupyterTriton.public_url`` comes first. A hub that says nothing (its default) is reached at
the address its users' browsers use: the first request of the server's user that comes through
the proxy tells it (``learn_public_origin``), and its page load comes before any kernel. Kernels of a hub's server carry
``JUPYTERHUB_API_TOKEN`` (a token of the user's with access to this server): what a
snippet reads, here and, with a token of the user's from the hub's token page, elsewhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

HUB_TOKEN = "JUPYTERHUB_API_TOKEN"
ENV_PUBLIC_URL = "JUPYTER_TRITON_PUBLIC_URL"     # set by the server extension; kernels inherit it
PREFIX = "JUPYTERHUB_SERVICE_PREFIX"


@dataclass(frozen=True)
class PublicAddress:
    url: str = ""       # this server's root as clients reach it, ending in "/"; "" when unknown
    source: str = ""    # what said so (a trait or an environment variable)
    note: str = ""      # what a user should know when it is unknown or only partly known


def in_hub(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in (or under) a JupyterHub single-user server."""
    return bool(environ.get(PREFIX) and environ.get(HUB_TOKEN))


def _root(url: str) -> str:
    return url if url.endswith("/") else url + "/"


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "", "", "")) if parts.scheme and parts.netloc else ""


def public_address(environ: Mapping[str, str], configured: str = "",
                   base_url: str = "/", learned: str = "") -> PublicAddress:
    """This server's public root. ``configured``: ``c.JupyterTriton.public_url``, whose
    scheme and host are taken and whose path is the server's own prefix (the hub's
    ``JUPYTERHUB_SERVICE_PREFIX``, else ``base_url``); ``learned``: the origin the user's
    requests came to the hub's proxy at (``learn_public_origin``), where the hub says none."""
    prefix = environ.get(PREFIX) or base_url or "/"
    if configured:
        origin = _origin(configured)
        if not origin:
            return PublicAddress(note=f"c.JupyterTriton.public_url = {configured!r} is no "
                                      "http(s)://host[:port] address: ignored")
        return PublicAddress(_root(origin + prefix), "c.JupyterTriton.public_url")
    if not in_hub(environ):
        return PublicAddress()
    url = environ.get("JUPYTERHUB_PUBLIC_URL", "")
    if _origin(url):
        return PublicAddress(_root(url), "JUPYTERHUB_PUBLIC_URL")
    host = _origin(environ.get("JUPYTERHUB_HOST", ""))
    if host:
        return PublicAddress(_root(host + prefix), "JUPYTERHUB_HOST")
    if _origin(learned):
        return PublicAddress(_root(_origin(learned) + prefix), "the user's requests through the proxy")
    return PublicAddress(note=(
        "the hub does not say its public address (JupyterHub.public_url is not set), so "
        "these URLs are this server's own, which change when it restarts; through the hub "
        f"they are at <hub address>{prefix}... (c.JupyterHub.public_url or "
        "c.JupyterTriton.public_url makes them so)"))


def token_page(environ: Mapping[str, str], public_url: str = "") -> str:
    """The hub's page where a user makes API tokens ("" outside a hub); ``public_url``: this
    server's, whose origin is the hub's where the environment says none."""
    if not in_hub(environ):
        return ""
    hub = environ.get("JUPYTERHUB_PUBLIC_HUB_URL", "")
    if not _origin(hub):
        base = environ.get("JUPYTERHUB_BASE_URL") or "/"
        origin = _origin(environ.get("JUPYTERHUB_HOST", "")) or _origin(public_url)
        hub = origin + _root(base) + "hub/"
    return _root(hub) + "token"


def credential_note(environ: Mapping[str, str], public_url: str = "") -> str:
    """Where the snippets' credential comes from, in a hub ("" elsewhere)."""
    if not in_hub(environ):
        return ""
    return (f"credential: ${HUB_TOKEN}, set in this server's kernels and terminals; on another "
            f"host, set it to a token of yours from {token_page(environ, public_url)}")


_HOST = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


def proxied_origin(handler: Any) -> str:
    """The origin a finished request of the server's user reached the hub's proxy at ("" for
    a request that was refused, anonymous, or not proxied: no ``X-Forwarded-For``)."""
    if handler.get_status() >= 400 or not getattr(handler, "_jupyter_current_user", None):
        return ""
    headers = handler.request.headers
    if "X-Forwarded-For" not in headers:
        return ""
    # a proxy in front of the hub's own adds its values first: the first is the user's
    proto = headers.get("X-Forwarded-Proto", handler.request.protocol).split(",")[0].strip()
    host = headers.get("X-Forwarded-Host", handler.request.host).split(",")[0].strip()
    if proto not in ("http", "https") or not _HOST.fullmatch(host):
        return ""
    return f"{proto}://{host}"


def learn_public_origin(settings: dict, learned: Callable[[str], None]) -> bool:
    """Look at the end of each request (the web app's ``log_function``, which still logs it)
    until one of the server's user came through the proxy; then hand its origin to
    ``learned`` and put the log function back. False: no log function to wrap."""
    original = settings.get("log_function")
    if original is None:
        return False

    def log_function(handler: Any) -> None:
        original(handler)
        origin = proxied_origin(handler)
        if origin and settings.get("log_function") is log_function:
            settings["log_function"] = original
            learned(origin)

    settings["log_function"] = log_function
    return True
