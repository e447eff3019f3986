"""Where clients reach a server that a JupyterHub runs, and with which credential.

A hub's single-user server listens on an address of the spawner's choosing (a new port at
each start); users reach it through the hub's proxy at the hub's public address plus the
server's prefix (``JUPYTERHUB_SERVICE_PREFIX``, ``/user/alice/``), which stays the same
across restarts. JupyterHub tells the server that address only when it knows it
(``JupyterHub.public_url`` or ``subdomain_host`` configured): ``JUPYTERHUB_PUBLIC_URL``
(JupyterHub 5) or ``JUPYTERHUB_HOST`` (older); the operator's
``c.JupyterTriton.public_url`` comes first. Kernels of a hub's server carry
``JUPYTERHUB_API_TOKEN`` (a token of the user's with access to this server): what a
snippet reads, here and, with a token of the user's from the hub's token page, elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping
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
                   base_url: str = "/") -> PublicAddress:
    """This server's public root. ``configured``: ``c.JupyterTriton.public_url``, whose
    scheme and host are taken and whose path is the server's own prefix (the hub's
    ``JUPYTERHUB_SERVICE_PREFIX``, else ``base_url``)."""
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
    return PublicAddress(note=(
        "the hub does not say its public address (JupyterHub.public_url is not set), so "
        "these URLs are this server's own, which change when it restarts; through the hub "
        f"they are at <hub address>{prefix}... (c.JupyterHub.public_url or "
        "c.JupyterTriton.public_url makes them so)"))


def token_page(environ: Mapping[str, str]) -> str:
    """The hub's page where a user makes API tokens ("" outside a hub)."""
    if not in_hub(environ):
        return ""
    hub = environ.get("JUPYTERHUB_PUBLIC_HUB_URL", "")
    if not _origin(hub):
        base = environ.get("JUPYTERHUB_BASE_URL") or "/"
        hub = _origin(environ.get("JUPYTERHUB_HOST", "")) + _root(base) + "hub/"
    return _root(hub) + "token"


def credential_note(environ: Mapping[str, str]) -> str:
    """Where the snippets' credential comes from, in a hub ("" elsewhere)."""
    if not in_hub(environ):
        return ""
    return (f"credential: ${HUB_TOKEN}, set in this server's kernels and terminals; on another "
            f"host, set it to a token of yours from {token_page(environ)}")
