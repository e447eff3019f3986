"""Loading on demand, the lifecycle's part: a request for a model that is in the repository,
not loaded, and opted in by the operator (the server's --load-on-demand, or the model's
``load_on_demand`` config parameter: engine/lifecycle/residency.py) loads it, once however many requests
wait; within a residency budget the least recently used idle models are evicted to make room.
Any other name is Triton's 404 and leaves nothing behind: names come from clients. What to
evict, and the counts, are engine/lifecycle/residency.py's."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from ...protocol.errors import TritonError, Unavailable
from ..model import UNAVAILABLE, VersionStatus
from .residency import (EVICTED_REASON, EVICT_WAIT_SECS, FAILED_RETRY_SECS, MAX_COLD_LOADS,
                        RETRY_AFTER_SECS, Residency, opted_in)
from .table import Entry, ModelTable

if TYPE_CHECKING:
    from ...repository import Repository
    from ..options import EngineOptions

log = logging.getLogger(__name__)


class OnDemand:
    """The lifecycle's loads on demand and evictions. Owns the loads under way, the one
    eviction decision at a time, and the names an operator unloaded (held off: a request
    does not load them back); asks ``table`` for the rows and ``load`` (the lifecycle's
    load of one model, under its row's lock) for a load."""

    def __init__(self, table: ModelTable, residency: Residency, repository: "Repository",
                 options: "EngineOptions", load: Callable[[str, Entry], Awaitable[None]]) -> None:
        self.table = table
        self.residency = residency
        self.repository = repository
        self.options = options
        self._load = load
        self._open = False          # between the engine's start and its stop
        self._cold: dict[str, asyncio.Future] = {}      # on-demand loads under way, by model
        # their expected bytes, counted against the budget while they load
        self._loading: dict[str, int] = {}
        # one eviction decision at a time; the loads themselves run side by side, each
        # under its model's own lock, a few at once. Under a memory budget one at a time: the
        # bytes it sums are measured per load, as what the process gained meanwhile
        # (engine/lifecycle/memory.py), which another load in the process would blur.
        self._room = asyncio.Lock()
        bound = 1 if residency.budget_bytes else residency.max_models
        self._cold_slots = asyncio.Semaphore(min(MAX_COLD_LOADS, bound) if bound else MAX_COLD_LOADS)
        self._held_off: set[str] = set()

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        self._open = False

    def hold_off(self, name: str) -> None:
        self._held_off.add(name)

    def release(self, name: str) -> None:
        self._held_off.discard(name)

    def held_off(self, name: str) -> bool:
        return name in self._held_off

    async def loadable(self, name: str) -> bool:
        """Whether a request for ``name`` may load it: in the repository, opted in, not
        held off, and not failed a moment ago."""
        if name in self._held_off or not self._open:
            return False
        if name in self._cold:
            return True
        state = self.residency.models.get(name)
        if state is not None and time.monotonic() - state.failed_at < FAILED_RETRY_SECS:
            return False
        try:
            self.repository.model_dir(name)     # a name not in the repository: nothing read
        except TritonError:
            return False
        if state is not None and state.config is not None:     # evicted: as it served
            return opted_in(state.config, self.options.load_on_demand)
        return await asyncio.get_running_loop().run_in_executor(None, self._opted_in_on_disk, name)

    def _opted_in_on_disk(self, name: str) -> bool:
        try:
            return opted_in(self.repository.read_config(name), self.options.load_on_demand)
        except (TritonError, OSError):
            return False

    async def load(self, name: str, wait: float) -> None:
        """Load ``name`` for a request, once however many wait; Unavailable (retry later)
        past ``wait`` seconds."""
        load = self._cold.get(name)
        if load is None:
            load = self._cold[name] = asyncio.ensure_future(self._cold_load(name))
            load.add_done_callback(lambda f: (self._cold.pop(name, None) if self._cold.get(name) is f
                                              else None, f.cancelled() or f.exception()))
        try:
            # shielded: a client that goes away does not cancel the load others wait for
            await asyncio.wait_for(asyncio.shield(load), max(wait, 0.0))
        except asyncio.TimeoutError:
            raise retry_later(f"model '{name}' is being loaded on demand") from None

    async def _cold_load(self, name: str) -> None:
        async with self._cold_slots:
            if self.table.has_ready_version(name):
                return
            if not self._open:
                raise Unavailable(f"model '{name}' cannot be loaded: the server is stopping")
            state = self.residency.of(name)      # an opted-in repository model: known now
            async with self._room:
                await self._make_room(name, state.size)
                self._loading[name] = state.size
            entry = self.table.entry(name)
            try:
                async with entry.lock:
                    await self._load(name, entry)
            except BaseException:
                state.failed_at = time.monotonic()
                raise
            finally:
                self._loading.pop(name, None)
            self.table.want(name)
            self.residency.loaded(name, entry.serving.values(), cold=True)
            log.info("model '%s' loaded on demand (%d bytes)", name, state.size)
            await self.settle(name)

    def fits_another(self) -> bool:
        """One more model fits the budget without an eviction (what loads at start or by
        the poller stops here)."""
        return not self.residency.enabled or self.residency.fits_another(self.table.resident())

    async def settle(self, loaded: str) -> None:
        """After ``loaded`` loaded: evict what no longer fits beside it."""
        async with self._room:
            await self._make_room(loaded, 0)

    async def _make_room(self, incoming: str, size: int) -> None:
        """Evict what ``residency.victims`` chooses so that ``incoming`` fits."""
        loaded = self.table.resident()
        self.residency.note_resident(sum(self.residency.of(n).size for n in loaded))
        # a model with a staged version (a canary, a golden check) is compared, not evicted;
        # nor is one that no request may load back (not opted in): it would be gone
        busy = {e.name for e in self.table.entries() if e.lock.locked() or e.staged} | {
            n for n, mvs in loaded.items()
            if not all(opted_in(mv.config, self.options.load_on_demand) for mv in mvs)}
        victims = self.residency.victims(loaded, incoming, size, busy, self._loading)
        if victims:
            await asyncio.gather(*(self._evict(n) for n in victims))

    async def _evict(self, name: str) -> None:
        entry = self.table.get(name)
        deadline = time.monotonic() + EVICT_WAIT_SECS
        while entry is not None and entry.serving and not entry.lock.locked():
            busy = [mv for mv in entry.serving.values() if not mv.idle]
            if not busy:
                break
            if time.monotonic() >= deadline:
                return                 # still busy: it stays, over the budget for a while
            # requests take milliseconds; a new one may arrive while we wait: look again
            waits = [asyncio.ensure_future(mv.wait_idle()) for mv in busy]
            try:
                await asyncio.wait(waits, timeout=max(deadline - time.monotonic(), 0.0))
            finally:
                for wait in waits:
                    wait.cancel()
        if entry is None or entry.lock.locked() or not entry.serving:
            return
        old = entry.serve({})
        for v in old:
            entry.status[v] = VersionStatus(UNAVAILABLE, EVICTED_REASON)
        self.table.unwant(name)
        self.residency.evicted(name)
        log.info("model '%s' evicted (residency budget)", name)
        await asyncio.gather(*(mv.unload(drain_seconds=self.options.unload_timeout_secs)
                               for mv in old.values()))


def retry_later(message: str) -> Unavailable:
    err = Unavailable(f"{message}; retry in {RETRY_AFTER_SECS} s")
    # frontends answer it with a Retry-After header
    err.retry_after = RETRY_AFTER_SECS  # type: ignore[attr-defined]
    return err
