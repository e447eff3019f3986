"""One admission per server: what every listener of it (the HTTP skins, the fast lane on
Jupyter's port, the data port, gRPC, metrics) asks before it takes a request's body.

- **Credentials and scopes**: an ``AccessPolicy`` (``frontends.auth``). A listener may narrow
  it where Triton names a rule per protocol (``--http-restricted-api`` and
  ``--grpc-restricted-protocol``), by passing its own policy to ``check``/``authenticate``;
  everything else is shared.
- **Host**: the exact ``host:port`` values accepted (DNS rebinding), or any.
- **Bytes in flight**: one budget of request bytes being received or decoded, server-wide,
  whichever listener they came through: a burst of large uploads on HTTP and gRPC together is
  refused with 503 / RESOURCE_EXHAUSTED rather than held in memory all at once.
- **Connections and streams**: server-wide counters under the limits of
  ``frontends.limits`` (``HTTP1Limits.max_connections``, ``HTTP2Limits.max_concurrent_streams``).

Everything here runs on the server's event loop: no locks.
"""
from __future__ import annotations

import asyncio
from typing import Mapping

from ..protocol.errors import PermissionDenied, Unavailable
from .auth import AccessPolicy
from .limits import HTTP1Limits, HTTP2Limits

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
INFLIGHT_MESSAGES = 4           # default bytes in flight: this many largest requests


class ResourceExhausted(Unavailable):
    """A bound of this server is reached; the client may retry later (HTTP 503)."""
    grpc_code = "RESOURCE_EXHAUSTED"


class BodyBudget:
    """Bytes of requests being received or decoded, server-wide, under one cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> "BodyTicket":
        """A ticket holding ``nbytes`` (grow it as more arrive; release it when done)."""
        ticket = BodyTicket(self)
        ticket.grow(nbytes)
        return ticket

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken with ``take`` by a skin that counts bytes rather than
        keep tickets (gRPC: one message's size, taken and given back around its call)."""
        self.held -= nbytes


class BodyTicket:
    """What one request holds of the budget. ``pending``: its credential being asked of its
    issuer while the body arrives (the request waits for it before it is served)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0
        self.pending: asyncio.Future | None = None

    def grow(self, nbytes: int) -> None:
        b = self.budget
        # A body alone larger than the whole budget is still let through when nothing else
        # is in flight: a limit set below the largest input means "one at a time".
        if nbytes and b.held + nbytes > b.limit and b.held > self.held:
            raise ResourceExhausted(
                f"the server holds {b.held} bytes of requests in flight, and {nbytes} more "
                f"would pass its limit of {b.limit} bytes in flight; retry later")
        b.held += nbytes
        self.held += nbytes

    def release(self) -> None:
        self.budget.held -= self.held
        self.held = 0
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()       # refused or gone before it was served


class Slots:
    """A count of things open at once (connections, streams) under a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self) -> bool:
        """One more, if the limit allows (False: refuse it)."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used -= 1


class Admission:
    """The server's one admission; see the module's docstring. ``access`` None: open (every
    group reachable without a credential, as tritonserver by default)."""

    def __init__(self, access: AccessPolicy | None = None, *,
                 max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
                 max_inflight_bytes: int | None = None,
                 allowed_hosts: frozenset[str] | None = None,
                 http1: HTTP1Limits = HTTP1Limits(), http2: HTTP2Limits = HTTP2Limits()) -> None:
        self.access = access if access is not None else AccessPolicy.open()
        self.max_input_size = max_input_size
        self.budget = BodyBudget(max_inflight_bytes if max_inflight_bytes is not None
                                 else INFLIGHT_MESSAGES * max_input_size)
        # None: any Host. Otherwise the exact "host:port" values accepted (DNS rebinding).
        self.allowed_hosts = allowed_hosts
        self.http1, self.http2 = http1, http2
        self.connections = Slots(http1.max_connections)
        self.streams = Slots(http2.max_concurrent_streams)

    def check_host(self, headers: Mapping[str, str]) -> None:
        """Raise PermissionDenied unless the request's Host is one of this server's."""
        if self.allowed_hosts is not None and \
                (headers.get("host") or "").lower() not in self.allowed_hosts:
            raise PermissionDenied(
                f"Host '{headers.get('host') or ''}' is not this server's address")

    def check(self, group: str, headers: Mapping[str, str],
              access: AccessPolicy | None = None) -> None:
        """Raise Unauthenticated / PermissionDenied unless ``headers`` reach ``group``, with
        what is known now (credentials that need asking are ``authenticate``'s)."""
        (access or self.access).check(group, headers)

    async def authenticate(self, group: str, headers: Mapping[str, str],
                           access: AccessPolicy | None = None) -> None:
        """``check``, asking the credential's issuer (Jupyter's identity provider) first
        where the answer is not known yet."""
        await (access or self.access).authenticate(group, headers)

    def take(self, nbytes: int) -> BodyTicket:
        """Hold ``nbytes`` of the server's bytes-in-flight budget (ResourceExhausted past it)."""
        return self.budget.take(nbytes)
