"""Loading on demand within a residency budget, the lifecycle's part: a request for a model
that is in the repository but not loaded loads it (once, however many requests wait), and
the least recently used idle models are evicted to make room. What to evict, and the counts,
are engine/residency.py's."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..protocol.errors import TritonError, Unavailable
from .model import UNAVAILABLE, ModelVersion, VersionStatus
from .residency import (EVICTED_REASON, EVICT_WAIT_SECS, FAILED_RETRY_SECS, ON_DEMAND_WAIT_SECS,
                        RETRY_AFTER_SECS, idle, pinned)

if TYPE_CHECKING:
    from .lifecycle import Entry   # noqa: F401

log = logging.getLogger(__name__)


class OnDemand:
    """Mixed into ModelLifecycle, whose entries, locks and loads it uses."""

    # how long a request waits for its model's on-demand load before a 503 (Retry-After)
    on_demand_wait_secs: float = ON_DEMAND_WAIT_SECS

    async def resident_version(self, name: str, version: str = "") -> ModelVersion:
        """``_version``, but a model that is in the repository and not loaded (evicted, or
        never asked for) is loaded first, once however many requests wait for it, within
        ON_DEMAND_WAIT_SECS (then Unavailable with ``retry_after``)."""
        deadline = time.monotonic() + self.on_demand_wait_secs
        for _ in range(8):     # a model loaded for us may be evicted before we run: ask again
            entry = self._entries.get(name)
            if (entry is not None and entry.serving) or not self._loadable(name):
                self.residency.touch(name)
                return self._version(name, version)
            await self._on_demand(name, deadline - time.monotonic())
        raise _retry_later(f"model '{name}' was evicted again before this request could run")

    def _loadable(self, name: str) -> bool:
        if name in self._held_off or self._started is False:
            return False
        if time.monotonic() - self.residency.of(name).failed_at < FAILED_RETRY_SECS:
            return False
        try:
            self.repository.model_dir(name)
        except TritonError:
            return False
        return True

    async def _on_demand(self, name: str, wait: float) -> None:
        load = self._cold.get(name)
        if load is None:
            load = self._cold[name] = asyncio.ensure_future(self._cold_load(name))
            load.add_done_callback(lambda f: (self._cold.pop(name, None) if self._cold.get(name) is f
                                              else None, f.cancelled() or f.exception()))
        try:
            # shielded: a client that goes away does not cancel the load others wait for
            await asyncio.wait_for(asyncio.shield(load), max(wait, 0.0))
        except asyncio.TimeoutError:
            raise _retry_later(f"model '{name}' is being loaded on demand") from None

    async def _cold_load(self, name: str) -> None:
        async with self._room:
            if self._has_ready_version(name):
                return
            if not self._started:
                raise Unavailable(f"model '{name}' cannot be loaded: the server is stopping")
            state = self.residency.of(name)
            await self._make_room(name, state.size)
            entry = self._entry(name)
            try:
                async with entry.lock:
                    await self._load_locked(name, entry)
            except BaseException:
                state.failed_at = time.monotonic()
                raise
            self._wanted.add(name)
            self.residency.loaded(name, entry.serving.values(), cold=True)
            log.info("model '%s' loaded on demand (%d bytes)", name, state.size)
            await self._make_room(name, 0)

    def resident_models(self) -> dict[str, list[ModelVersion]]:
        return {n: list(e.serving.values()) for n, e in self._entries.items() if e.serving}

    async def _make_room(self, incoming: str, size: int) -> None:
        """Evict what ``residency.victims`` chooses so that ``incoming`` fits."""
        loaded = self.resident_models()
        self.residency.note_resident(sum(self.residency.of(n).size for n in loaded))
        # a model with a staged version (a canary, a golden check) is compared, not evicted
        busy = {n for n, e in self._entries.items() if e.lock.locked() or e.staged}
        victims = self.residency.victims(loaded, incoming, size, busy)
        if victims:
            await asyncio.gather(*(self._evict(n) for n in victims))

    async def _evict(self, name: str) -> None:
        entry = self._entries.get(name)
        deadline = time.monotonic() + EVICT_WAIT_SECS
        while entry is not None and entry.serving and not entry.lock.locked():
            busy = [mv for mv in entry.serving.values() if not idle(mv)]
            if not busy:
                break
            if time.monotonic() >= deadline:
                return                 # still busy: it stays, over the budget for a while
            # requests take milliseconds; a new one may arrive while we wait: look again
            waits = [asyncio.ensure_future(mv._idle.wait()) for mv in busy]
            try:
                await asyncio.wait(waits, timeout=max(deadline - time.monotonic(), 0.0))
            finally:
                for wait in waits:
                    wait.cancel()
        if entry is None or entry.lock.locked() or not entry.serving:
            return
        old, entry.serving = entry.serving, {}
        entry.changes += 1
        for v in old:
            entry.status[v] = VersionStatus(UNAVAILABLE, EVICTED_REASON)
        self._wanted.discard(name)
        self.residency.evicted(name)
        log.info("model '%s' evicted (residency budget)", name)
        await asyncio.gather(*(mv.unload(drain_seconds=self.options.unload_timeout_secs)
                               for mv in old.values()))

    def _pinned_on_disk(self, name: str) -> bool:
        try:
            return pinned(self.repository.read_config(name))
        except (TritonError, OSError):
            return False


def _retry_later(message: str) -> Unavailable:
    err = Unavailable(f"{message}; retry in {RETRY_AFTER_SECS} s")
    # frontends answer it with a Retry-After header
    err.retry_after = RETRY_AFTER_SECS  # type: ignore[attr-defined]
    return err
