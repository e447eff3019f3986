"""One admission per server, and in it the one decision every listener asks of it (the
standalone HTTP front and its tornado skin, the data port, the fast lane and the tornado
routes on Jupyter's port, gRPC and its health service, metrics): ``Admission.admit``; and
before it, on each connection a listener of ours accepts, ``Admission.connect``.

A listener parses a request's head and hands it over with its ``Door`` (what kind of
listener it is, and where it narrows the server's terms). The answer is a ``BodyTicket`` the
request carries and releases when done, or a TritonError (its status, gRPC code and message:
Triton's refusal). A connection's answer is a ``ConnectionSlot``, released when it closes, or
the same kind of refusal. Decided there and nowhere else:

- **Host** (DNS rebinding): the door's exact ``host:port`` values, or Jupyter's own check.
- **Who**: the server token and inference keys, Triton's restricted-API header rules
  (``--http-restricted-api``, ``--grpc-restricted-protocol``: a door's ``access`` narrows the
  server's policy), and the Jupyter server's identity provider and authorizer (the Jupyter
  token, a JupyterHub token) through an ``IdentityHook`` the Jupyter skin gives its doors.
  A credential only its issuer can judge is asked of it while the body arrives
  (``ticket.pending``): the request is served once the answer came.
- **Connection slots**: a connection just accepted takes one of its door's
  ``max_connections`` (``Admission.connect``), the listener's limit, and gives it back when
  it closes; past it the listener answers the refusal (HTTP/1: a 503 and a close; gRPC: a
  close). Every listener of ours asks: the fast front's ports (and Jupyter's port while the
  fast lane holds a connection), tornado's server on the standalone HTTP and metrics ports,
  gRPC. Not Jupyter's own port under its tornado handlers: that listener is jupyter_server's,
  and a cap of ours would refuse the notebook's own connections (kernels, the lab).
- **Stream slots**: an HTTP/2 stream opening on a connection takes one of its slot's
  ``max_streams`` (``ConnectionSlot.open_stream``: the listener's SETTINGS_MAX_CONCURRENT_STREAMS,
  given at ``connect``) for as long as the connection keeps it; past it, REFUSED_STREAM.
- **Deadline**: a gRPC call's ticket carries the seconds its handler may run (``deadline``:
  the client's ``grpc-timeout``; no server-wide cap, as in tritonserver); past them the call
  layer ends it with DEADLINE_EXCEEDED.
- **Body cap** and the **bytes in flight**: one budget of request bytes being received or
  decoded, server-wide, whichever listener they came through: a burst of large uploads on
  HTTP and gRPC together is refused with 503 / RESOURCE_EXHAUSTED rather than held in memory.

API groups are tritonserver's. A restricted group needs its header ``<key>: <value>``, as in
Triton. Bearer credentials (``Authorization: Bearer <t>`` or ``token <t>``) reach the groups
they were issued for. Loading a model runs code: it is the ``model-repository`` group, which
no inference key reaches; nor does one reach ``shared-memory`` (a region is any /dev/shm
object the server can open).

Everything here runs on the server's event loop: no locks.
"""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol

from ..protocol.errors import (InvalidArgument, PermissionDenied, TritonError, Unauthenticated,
                               Unavailable)

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
INFLIGHT_MESSAGES = 4           # default bytes in flight: this many largest requests
JSON, OCTET = "application/json", "application/octet-stream"

HEALTH, METADATA, INFERENCE, SHARED_MEMORY = "health", "metadata", "inference", "shared-memory"
MODEL_CONFIG, MODEL_REPOSITORY, STATISTICS = "model-config", "model-repository", "statistics"
TRACE, LOGGING = "trace", "logging"
GROUPS = frozenset({HEALTH, METADATA, INFERENCE, SHARED_MEMORY, MODEL_CONFIG, MODEL_REPOSITORY,
                    STATISTICS, TRACE, LOGGING})
# What an inference key reaches: everything a client and perf_analyzer read, nothing that
# loads code or changes the server. Not shared memory: registering a region opens any
# /dev/shm object the server's user can open, for a model to read or outputs to overwrite
# (tritonserver keeps it behind --allow-client-shm); keys send their tensors inline.
INFERENCE_SCOPE = frozenset({HEALTH, METADATA, INFERENCE, MODEL_CONFIG, STATISTICS})

# Jupyter's authorizer actions. Where a credential is judged for a whole API group (gRPC,
# the data port, what an answer shows beyond its route): loading a model runs code.
READ, WRITE, EXECUTE = "read", "write", "execute"
ACTION_OF_GROUP = {HEALTH: READ, METADATA: READ, MODEL_CONFIG: READ, STATISTICS: READ,
                   INFERENCE: WRITE, SHARED_MEMORY: WRITE, TRACE: WRITE, LOGGING: WRITE,
                   MODEL_REPOSITORY: EXECUTE}
_READ_GROUPS = frozenset({HEALTH, METADATA, MODEL_CONFIG, STATISTICS})
# Operations (Triton-spelled route names) whose POST changes nothing, and those that load or
# unload a model (code execution) or show a model's captured traffic and a version's lineage
# (user data: for whoever may load models, reading it too).
_READ_OPS = frozenset({"RepositoryIndex"})
_EXECUTE_OPS = frozenset({"RepositoryLoad", "RepositoryUnload", "ModelTraffic", "ModelShadow",
                          "ModelLineage"})


def action_of(group: str, method: str, op: str = "") -> str:
    """The authorizer action of operation ``op`` (of API ``group``) called with ``method``."""
    if op in _EXECUTE_OPS:
        return EXECUTE
    if op in _READ_OPS or group in _READ_GROUPS:
        return READ
    return READ if method in ("GET", "HEAD", "OPTIONS") else WRITE


class ResourceExhausted(Unavailable):
    """A bound of this server is reached; the client may retry later (HTTP 503)."""
    grpc_code = "RESOURCE_EXHAUSTED"


class UnsupportedMediaType(TritonError):
    status = 415
    grpc_code = "INVALID_ARGUMENT"


@dataclass(frozen=True)
class Restriction:
    """tritonserver's ``<api>[,<api>...]:<key>=<value>``: these groups need that header."""
    groups: frozenset[str]
    key: str
    value: str

    @classmethod
    def parse(cls, spec: str) -> "Restriction":
        apis, sep, header = spec.partition(":")
        key, eq, value = header.partition("=")
        groups = frozenset(a.strip() for a in apis.split(",") if a.strip())
        if not sep or not eq or not key.strip() or not groups:
            raise InvalidArgument(f"restricted API '{spec}' must read <api>[,<api>...]:<key>=<value>")
        unknown = groups - GROUPS
        if unknown:
            raise InvalidArgument(f"restricted API '{spec}': unknown API group(s) {sorted(unknown)}; "
                                  f"known: {sorted(GROUPS)}")
        return cls(groups, key.strip().lower(), value)


def bearer(headers: Mapping[str, str]) -> str:
    """The credential of ``Authorization: Bearer <t>`` / ``token <t>`` ('' when none)."""
    header = _get(headers, "authorization")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() in ("token", "bearer") else ""


def _get(headers: Mapping[str, str], key: str) -> str:
    value = headers.get(key)
    if value is None:          # tornado's HTTPHeaders are case-insensitive; plain dicts are not
        value = next((v for k, v in headers.items() if k.lower() == key), "")
    return value or ""


@dataclass
class AccessPolicy:
    """The credentials a server (or one door of it) takes. ``tokens``: credential -> groups it
    reaches. ``anonymous``: groups reachable with no credential at all. ``restrictions``:
    Triton's header rules, on top. ``verify``: an extra credential check (e.g. the Jupyter
    server's own token) returning its groups or None, from what is known now. ``resolve``:
    where ``verify`` does not know a credential, ask its issuer (Jupyter's identity provider
    and authorizer, e.g. for a JupyterHub token); what it answers, ``verify`` knows from then
    on (for as long as the issuer's answer holds). Data: ``Admission.admit`` decides."""
    tokens: dict[str, frozenset[str]] = field(default_factory=dict)
    anonymous: frozenset[str] = frozenset()
    restrictions: list[Restriction] = field(default_factory=list)
    verify: Callable[[str], frozenset[str] | None] | None = None
    resolve: Callable[[str], Awaitable[frozenset[str] | None]] | None = None

    @classmethod
    def open(cls, restrictions: Iterable[Restriction] = ()) -> "AccessPolicy":
        """tritonserver's default: no credential needed except where restricted."""
        return cls(anonymous=GROUPS, restrictions=list(restrictions))

    def groups_of(self, credential: str) -> frozenset[str] | None:
        for token, groups in self.tokens.items():
            if hmac.compare_digest(credential.encode(), token.encode()):
                return groups
        return self.verify(credential) if self.verify is not None else None

    def open_to_all(self, group: str) -> bool:
        """``group`` needs no credential and no header rule: nothing of a request's headers
        is to be checked (an open server's infer path pays this one set lookup)."""
        return group in self.anonymous and not self.restrictions


# Who a request is when Jupyter's own identity is not what let it in.
KEY_USER, ANONYMOUS_USER = "jupyter_triton-key", "anonymous"
AUTH_RESOURCE = "jupyter_triton"        # what Jupyter's authorizer is asked about


class Caller:
    """Who a request is, once admitted through Jupyter's door: the API groups its credential
    reaches, or (a user of Jupyter's) what Jupyter's authorizer says per group and action."""
    __slots__ = ("name", "groups", "authorize")

    def __init__(self, name: str, groups: frozenset[str] = frozenset(),
                 authorize: Callable[[str, str], bool] | None = None) -> None:
        self.name, self.groups, self.authorize = name, groups, authorize

    def reaches(self, group: str, action: str | None = None) -> bool:
        if self.authorize is not None:
            return bool(self.authorize(group, action or ACTION_OF_GROUP.get(group, EXECUTE)))
        return group in self.groups


class IdentityHook(Protocol):
    """What the Jupyter skin tells the admission of Jupyter's own identity, for a request on
    Jupyter's port that its tornado handler (``context``) carries."""

    def signed_in(self, context: Any) -> bool:
        """The request carries Jupyter's login (its cookie): Jupyter says who it is."""

    async def identify(self, context: Any, credential: str) -> Caller | None:
        """Who Jupyter's identity provider finds (None: nobody); may raise tornado's own
        refusal (an XSRF check, its Host check)."""


@dataclass
class Door:
    """One listener's terms at the admission. ``kind``: which listener ("http", "data",
    "fast-lane", "jupyter", "grpc", "metrics"). ``access``: its credential policy where it is
    not the server's (Triton's per-protocol restricted APIs). ``hosts``: the ``host:port``
    values accepted (None: any), or a check of its own (Jupyter's). ``jupyter``: a credential
    ours do not know is Jupyter's to judge (the admission's ``identity``).
    ``max_connections``: connections open at once on this listener (its limits', set by the
    listener; None: no cap); ``connected``: those open now, counted by ``Admission.connect``.
    ``max_streams``: streams one connection may hold open at once (HTTP/2's
    SETTINGS_MAX_CONCURRENT_STREAMS; None: no cap), which each slot's ``open_stream`` applies."""
    kind: str
    access: AccessPolicy | None = None
    hosts: frozenset[str] | Callable[[str, Any], bool] | None = None
    strict_content_type: bool = False
    jupyter: bool = False
    max_connections: int | None = None
    max_streams: int | None = None
    connected: int = field(default=0, compare=False)


class ConnectionSlot:
    """One open connection's place at its door (``Admission.connect``): the listener
    releases it when the connection closes; a second release gives back nothing.
    ``max_streams``: streams it may hold open at once (HTTP/2; None: no cap)."""
    __slots__ = ("door", "max_streams")

    def __init__(self, door: Door | None, max_streams: int | None = None) -> None:
        self.door = door
        self.max_streams = max_streams

    def open_stream(self, open_now: int) -> bool:
        """The decision on a stream opening on this connection, which holds ``open_now``
        (its HTTP/2 machine's count: a stream holds its slot while the machine keeps it):
        whether it may open, else the listener refuses it (REFUSED_STREAM)."""
        cap = self.max_streams
        return cap is None or open_now < cap

    def release(self) -> None:
        door, self.door = self.door, None
        if door is not None:
            door.connected -= 1


class BodyBudget:
    """Bytes of requests being received or decoded, server-wide, under one cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int, cap: int = 0) -> "BodyTicket":
        """A ticket holding ``nbytes`` (grow it as more arrive; release it when done)."""
        ticket = BodyTicket(self, cap)
        ticket.grow(nbytes)
        return ticket

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken with ``take`` by a skin that counts bytes rather than
        keep tickets (gRPC: one message's size, taken and given back around its call)."""
        self.held -= nbytes


class BodyTicket:
    """What one admitted request holds: its bytes of the budget, its body cap, who it is
    (``caller``, where Jupyter's door judged it), ``pending``: its credential being asked
    of its issuer while the body arrives (the request waits for it before it is served), and
    its ``deadline`` (a gRPC call's, see ``Admission.admit``)."""
    __slots__ = ("budget", "held", "cap", "caller", "pending", "deadline")

    def __init__(self, budget: BodyBudget, cap: int = 0) -> None:
        self.budget = budget
        self.held = 0
        self.cap = cap
        self.caller: Caller | None = None
        self.pending: asyncio.Future | None = None
        self.deadline: float | None = None     # seconds its handler may run (gRPC)

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

    def receive(self, nbytes: int) -> None:
        """``nbytes`` more of a body whose length was not announced: refused past the cap
        the admission set, or past the bytes in flight."""
        if self.held + nbytes > self.cap:
            raise InvalidArgument(f"request body exceeds the maximum input size of {self.cap} "
                                  "bytes (--http-max-input-size)")
        self.grow(nbytes)

    def release(self) -> None:
        self.budget.held -= self.held
        self.held = 0
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()       # refused or gone before it was served


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def grpc_timeout(value: str) -> float | None:
    """gRPC's ``grpc-timeout`` (at most 8 digits and a unit, as the gRPC spec writes it) in
    seconds; None where it is not one, or is 0 (no deadline). A longer run of digits is not
    one: converting it would cost the loop (and past 4,300 digits Python refuses)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or len(digits) > 8 or not digits.isascii() or not digits.isdigit():   # "²" is a digit too
        return None
    return int(digits) * unit or None


def _seen(future: asyncio.Future) -> None:
    # A request refused or gone before it was served never reads the answer.
    if not future.cancelled():
        future.exception()


class Admission:
    """The server's one admission; see the module's docstring. ``access`` None: open (every
    group reachable without a credential, as tritonserver by default). ``identity``: the
    Jupyter skin's hook (``IdentityHook``), for its doors."""

    def __init__(self, access: AccessPolicy | None = None, *,
                 max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
                 max_inflight_bytes: int | None = None,
                 identity: IdentityHook | None = None) -> None:
        self.access = access if access is not None else AccessPolicy.open()
        self.max_input_size = max_input_size
        self.budget = BodyBudget(max_inflight_bytes if max_inflight_bytes is not None
                                 else INFLIGHT_MESSAGES * max_input_size)
        self.identity = identity

    def connect(self, door: Door) -> ConnectionSlot:
        """The decision on a connection just accepted on ``door``: its slot (released when
        it closes, holding the door's ``max_streams``), or ResourceExhausted (503) when the
        door holds its ``max_connections``."""
        cap = door.max_connections
        if cap is not None and door.connected >= cap:
            protocol = "gRPC" if door.kind == "grpc" else "HTTP"
            raise ResourceExhausted(f"the server holds its maximum of {cap} {protocol} "
                                    "connections; retry later")
        door.connected += 1
        return ConnectionSlot(door, door.max_streams)

    def admit(self, door: Door, group: str, method: str, headers: Mapping[str, str],
              length: int | None = None, *, op: str = "", context: Any = None) -> BodyTicket:
        """The decision on one request's head: ``group`` (the Triton API group of operation
        ``op``, called with ``method``), its ``headers`` (lower-case names answer), its body's
        announced ``length`` (None: not announced; 0: none), on ``door``; ``context``: the
        tornado handler of a request on Jupyter's port (what Jupyter's identity is asked
        through). Returns the ticket the request carries (release it when done); raises the
        TritonError it is refused with."""
        hosts = door.hosts
        if hosts is not None:
            host = _get(headers, "host")
            if not (hosts(host, context) if callable(hosts) else host.lower() in hosts):
                raise PermissionDenied(f"Host '{host}' is not this server's address")
        if door.strict_content_type and method == "POST":
            ctype = _get(headers, "content-type").split(";", 1)[0].strip().lower()
            if ctype and ctype not in (JSON, OCTET):
                raise UnsupportedMediaType(
                    f"Content-Type '{ctype}' is not accepted: send {JSON} or {OCTET}")
        access = door.access or self.access
        if group in access.anonymous and not access.restrictions:      # open: nothing to ask
            caller, wait = None, None
        else:
            caller, wait = self._who(door, group, method, op, headers, context)
        cap = self.max_input_size
        if length is not None and length > cap:
            raise InvalidArgument(
                f"request body of {length} bytes exceeds the maximum input size of "
                f"{cap} bytes (--http-max-input-size)")
        ticket = self.budget.take(length or 0, cap)
        ticket.caller = caller
        if door.kind == "grpc":
            timeout = headers.get("grpc-timeout")      # HTTP/2 names are lower-case
            if timeout:
                ticket.deadline = grpc_timeout(timeout)
        if wait is not None:
            ticket.pending = asyncio.ensure_future(wait[0](ticket, *wait[1:]))
            ticket.pending.add_done_callback(_seen)
        return ticket

    def reaches(self, door: Door, ticket: BodyTicket | None, group: str,
                headers: Mapping[str, str]) -> bool:
        """Whether an admitted request's caller may use API ``group`` too (what an answer
        shows beyond its own group: statistics show the lifecycle history to those who may
        load models), by the same rules as ``admit``."""
        caller = ticket.caller if ticket is not None else None
        if caller is not None:
            return caller.reaches(group)
        try:
            caller, wait = self._who(door, group, "GET", "", headers, None)
        except TritonError:
            return False
        return wait is None

    # -- who -------------------------------------------------------------------------------
    def _who(self, door: Door, group: str, method: str, op: str, headers: Mapping[str, str],
             context: Any) -> tuple[Caller | None, tuple | None]:
        """(who the caller is where Jupyter's door asks, what is still to be asked of a
        credential's issuer), or the refusal raised."""
        access = door.access or self.access
        if access.open_to_all(group):
            return None, None
        for r in access.restrictions:
            if group in r.groups and not hmac.compare_digest(
                    _get(headers, r.key).encode(), r.value.encode()):
                raise PermissionDenied(f"This API is restricted, expecting header '{r.key}'")
        credential = bearer(headers)
        hook = self.identity if door.jupyter else None
        if hook is None:
            if group in access.anonymous:
                return None, None
        elif not credential and group in access.anonymous and not hook.signed_in(context):
            return Caller(ANONYMOUS_USER, access.anonymous), None
        groups = access.groups_of(credential) if credential else None
        if groups is not None:
            if group not in groups:
                reason = f"this credential does not reach the '{group}' API"
                if hook is not None:
                    reason = (f"not authorized to {action_of(group, method, op)} {AUTH_RESOURCE} "
                              f"({reason}; inference keys never reach load/unload)")
                raise PermissionDenied(reason)
            return (Caller(KEY_USER, groups) if hook is not None else None), None
        if hook is not None and context is not None:
            return None, (self._identified, hook, context, credential, group,
                          action_of(group, method, op))
        if not credential:
            raise Unauthenticated(f"authentication required for the '{group}' API "
                                  "(Authorization: Bearer <token>)")
        if access.resolve is not None:
            return None, (self._resolved, access, credential, group)
        raise Unauthenticated("the credential presented is not valid for this server")

    async def _resolved(self, ticket: BodyTicket, access: AccessPolicy, credential: str,
                        group: str) -> None:
        groups = await access.resolve(credential)
        if groups is None:
            raise Unauthenticated("the credential presented is not valid for this server")
        if group not in groups:
            raise PermissionDenied(f"this credential does not reach the '{group}' API")

    async def _identified(self, ticket: BodyTicket, hook: IdentityHook, context: Any,
                          credential: str, group: str, action: str) -> None:
        caller = await hook.identify(context, credential)
        if caller is None:
            raise PermissionDenied(
                f"authentication required for the '{group}' API (Authorization: token "
                "<Jupyter token>, or Bearer <inference key>; or a login cookie with its _xsrf)")
        if not caller.reaches(group, action):
            raise PermissionDenied(f"not authorized to {action} {AUTH_RESOURCE}")
        ticket.caller = caller
