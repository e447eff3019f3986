"""The model table: per model name, which versions serve, which are staged, what state each
is in, and the lock every change of that name runs under. One owner: the lifecycle, on-demand
loading, rollouts and the engine's queries all ask this table; none keeps a dict of its own.

A row (``Entry``) is changed under its ``lock`` by the lifecycle's loads and unloads, a
rollout's staging and the on-demand evictions; ``serve`` is the one way the served versions
change, so ``changes`` (what a failed ensemble waits on) counts every swap.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Iterator

from ...repository import PendingUpload
from ..model import ModelVersion, VersionStatus


@dataclass
class Canary:
    """A staged version that takes ``fraction`` of the requests naming no version (started
    and ended by the rollout, engine/lifecycle/rollout.py; the row only holds it)."""
    version: int
    fraction: float
    pending: PendingUpload          # committed only by a promotion


@dataclass
class Entry:
    """Everything known about one model name."""
    name: str
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    status: dict[int, VersionStatus] = field(default_factory=dict)
    # poll mode: the model's files as they were when its last load began (whether that
    # load succeeded or failed): the poller loads the model again once they differ
    fingerprint: str = ""
    reason: str = ""            # why the model as a whole could not be prepared
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changes: int = 0            # bumped whenever the versions it serves change
    # a failed ensemble: its composing models' ``changes`` at the failure; the poller
    # tries it again when one of them loads or goes, even if its own files did not change
    waits_on: dict[str, int] = field(default_factory=dict)
    failed: bool = False        # its last load failed, with this error:
    last_error: str = ""
    # poll mode, a failed model whose files did not change: polls between its tries and
    # polls left before the next one
    retry_every: int = 0
    retry_in: int = 0
    # versions loaded for a promotion's golden check or a canary: callable by explicit
    # version; a canary's also takes its fraction of the requests naming no version
    staged: dict[int, ModelVersion] = field(default_factory=dict)
    canary: Canary | None = None

    def serve(self, versions: dict[int, ModelVersion]) -> dict[int, ModelVersion]:
        """Serve ``versions`` from now on; answers what served before."""
        old, self.serving = self.serving, versions
        if old.keys() != versions.keys() or any(old[v] is not versions[v] for v in old):
            self.changes += 1
        return old

    def served(self) -> int | None:
        """The version a request naming none runs on (the highest ready one)."""
        ready = [v for v, mv in self.serving.items() if mv.ready]
        return max(ready) if ready else None

    def has_ready_version(self) -> bool:
        return any(mv.ready for mv in self.serving.values())

    def known(self) -> bool:
        """Whether there is anything to say about the name: served, a version's state, or
        why the model could not be prepared."""
        return bool(self.serving or self.status or self.reason)


class ModelTable:
    """Model name -> ``Entry``, and the names the server was asked to serve (strict
    readiness: those loaded at start or since; an explicit unload or an eviction takes a
    name off the list)."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        # the data path's lookup is the dict's own get: no Python frame between a request
        # and its model's row
        self.get = self._entries.get
        self._wanted: set[str] = set()

    def entry(self, name: str) -> Entry:
        """The row of ``name``, made empty if there is none."""
        found = self._entries.get(name)
        if found is None:
            found = self._entries[name] = Entry(name)
        return found

    def forget(self, name: str) -> None:
        self._entries.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def serving_versions(self) -> list[ModelVersion]:
        return [mv for e in self._entries.values() for mv in e.serving.values()]

    def resident(self) -> dict[str, list[ModelVersion]]:
        """Per model with a version loaded, its served versions."""
        return {n: list(e.serving.values()) for n, e in self._entries.items() if e.serving}

    def changes(self, name: str) -> int:
        entry = self._entries.get(name)
        return entry.changes if entry is not None else 0

    def has_ready_version(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.has_ready_version()

    def take_all(self) -> list[ModelVersion]:
        """Every served and staged version, each row left serving none (the engine stops)."""
        versions = [mv for e in self._entries.values()
                    for mv in (*e.serving.values(), *e.staged.values())]
        for entry in self._entries.values():
            entry.serving.clear()
            entry.staged.clear()
            entry.canary = None
        return versions

    # ---- strict readiness ----------------------------------------------------------------
    def want(self, name: str) -> None:
        self._wanted.add(name)

    def unwant(self, name: str) -> None:
        self._wanted.discard(name)

    def wanted_ready(self) -> bool:
        """Every model the server was asked to serve has a ready version."""
        return all(self.has_ready_version(name) for name in self._wanted)
