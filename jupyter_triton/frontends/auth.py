"""Who may reach which API, for every listener: the Jupyter routes, the standalone and
in-kernel HTTP fronts, and the gRPC port. One policy object, asked the same question by
each skin: "these headers (or gRPC metadata) want this API group; yes or which error?".

API groups are tritonserver's (``--http-restricted-api`` / ``--grpc-restricted-protocol``):
a restricted group needs its header ``<key>: <value>``, as in Triton. Bearer credentials
(``Authorization: Bearer <t>`` or ``token <t>``) reach the groups they were issued for.
Loading a model runs code: it is the ``model-repository`` group, which no inference key
reaches; nor does one reach ``shared-memory`` (a region is any /dev/shm object the server
can open).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping

from ..protocol.errors import InvalidArgument, PermissionDenied, Unauthenticated

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
    """``tokens``: credential -> groups it reaches. ``anonymous``: groups reachable with no
    credential at all. ``restrictions``: Triton's header rules, checked on top. ``verify``:
    an extra credential check (e.g. the Jupyter server's own token) returning its groups or
    None, from what is known now. ``resolve``: where ``verify`` does not know a credential,
    ask its issuer (Jupyter's identity provider and authorizer, e.g. for a JupyterHub token);
    what it answers, ``verify`` knows from then on (for as long as the issuer's answer holds)."""
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

    def check(self, group: str, headers: Mapping[str, str]) -> None:
        """Raise Unauthenticated / PermissionDenied unless ``headers`` may reach ``group``."""
        self.check_restrictions(group, headers)
        if group in self.anonymous:
            return
        credential = bearer(headers)
        if not credential:
            raise Unauthenticated(f"authentication required for the '{group}' API "
                                  "(Authorization: Bearer <token>)")
        groups = self.groups_of(credential)
        if groups is None:
            raise Unauthenticated("the credential presented is not valid for this server")
        if group not in groups:
            raise PermissionDenied(f"this credential does not reach the '{group}' API")

    def check_restrictions(self, group: str, headers: Mapping[str, str]) -> None:
        """Triton's header rules alone (PermissionDenied)."""
        for r in self.restrictions:
            if group in r.groups and not hmac.compare_digest(
                    _get(headers, r.key).encode(), r.value.encode()):
                raise PermissionDenied(f"This API is restricted, expecting header '{r.key}'")

    def unresolved(self, group: str, headers: Mapping[str, str]) -> str | None:
        """The credential of ``headers`` that ``check`` would refuse for not knowing it yet,
        and that ``resolve`` may know (None otherwise)."""
        if self.resolve is None or group in self.anonymous:
            return None
        credential = bearer(headers)
        if not credential or self.groups_of(credential) is not None:
            return None
        return credential

    async def authenticate(self, group: str, headers: Mapping[str, str]) -> None:
        """``check``, with a credential not known yet asked of ``resolve`` first."""
        credential = self.unresolved(group, headers)
        if credential:
            await self.resolve(credential)
        self.check(group, headers)
