"""Loading on demand, the lifecycle's part: a request for a model that is in the repository,
not loaded, and opted in by the operator (the server's --load-on-demand, or the model's
``load_on_demand`` config parameter: engine/residency.py) loads it, once however many requests
wait; within a residency budget the least recently used idle models are evicted to make room.
Any other name is Triton's 404 and leaves nothing behind: names come from clients. What to
evict, and the counts, are engine/residency.py's."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ...protocol.errors import TritonError, Unavailable
from ..model import UNAVAILABLE, ModelVersion, VersionStatus
from .residency import (EVICTED_REASON, EVICT_WAIT_SECS, FAILED_RETRY_SECS, MAX_COLD_LOADS,
                        ON_DEMAND_WAIT_SECS, RETRY_AFTER_SECS, idle, opted_in, pinned)

if TYPE_CHECKING:
    from .control import Entry   # noqa: F401

log = logging.getLogger(__name__)


class OnDemand:
    """Mixed into ModelLifecycle, whose entries, locks and loads it uses."""

    # how long a request waits for its model's on-demand load before a 503 (Retry-After)
    on_demand_wait_secs: float = ON_DEMAND_WAIT_SECS

    def _init_on_demand(self) -> None:
        self._cold: dict[str, asyncio.Future] = {}      # on-demand loads under way, by model
        # their expected bytes, counted against the budget while they load
        self._loading: dict[str, int] = {}
        # one eviction decision at a time; the loads themselves run side by side, each
        # under its model's own lock, a few at once. Under a memory budget one at a time: the
        # bytes it sums are measured per load, as what the process gained meanwhile
        # (engine/memory.py), which another load in the process would blur.
        self._room = asyncio.Lock()
        bound = 1 if self.residency.budget_bytes else self.residency.max_models
        self._cold_slots = asyncio.Semaphore(min(MAX_COLD_LOADS, bound) if bound else MAX_COLD_LOADS)

    async def resident_version(self, name: str, version: str = "") -> ModelVersion:
        """The version a request for ``name`` runs on: every inference route's lookup (v2
        infer and streams, gRPC, the OpenAI routes). A model that is serving answers at once;
        one in the repository that is not loaded (evicted, or never asked for) and opted in
        to on-demand loading is loaded first, once however many requests wait for it, within
        ``on_demand_wait_secs`` (then Unavailable with ``retry_after``). Anything else raises
        Triton's NotFound, and no state is kept for the name."""
        deadline = time.monotonic() + self.on_demand_wait_secs
        for _ in range(8):     # a model loaded for us may be evicted before we run: ask again
            served = self.serving_version(name, version)
            if served is not None:
                return served
            if self._start_done is not None and not self._start_done.is_set():
                # the Jupyter server answers while the engine still loads the models named at
                # start: a request for one of them waits for that, not a 404
                try:
                    await asyncio.wait_for(self._start_done.wait(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise _retry_later("the server is still loading its models") from None
                continue
            if not await self._loadable(name):
                return self._version(name, version)
            await self._on_demand(name, deadline - time.monotonic())
        raise _retry_later(f"model '{name}' was evicted again before this request could run")

    async def _loadable(self, name: str) -> bool:
        if name in self._held_off or self._started is False:
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
        async with self._cold_slots:
            if self._has_ready_version(name):
                return
            if not self._started:
                raise Unavailable(f"model '{name}' cannot be loaded: the server is stopping")
            state = self.residency.of(name)      # an opted-in repository model: known now
            async with self._room:
                await self._make_room(name, state.size)
                self._loading[name] = state.size
            entry = self._entry(name)
            try:
                async with entry.lock:
                    await self._load_locked(name, entry)
            except BaseException:
                state.failed_at = time.monotonic()
                raise
            finally:
                self._loading.pop(name, None)
            self._wanted.add(name)
            self.residency.loaded(name, entry.serving.values(), cold=True)
            log.info("model '%s' loaded on demand (%d bytes)", name, state.size)
            async with self._room:
                await self._make_room(name, 0)

    def resident_models(self) -> dict[str, list[ModelVersion]]:
        return {n: list(e.serving.values()) for n, e in self._entries.items() if e.serving}

    def _fits_another(self) -> bool:
        """One more model fits the budget without an eviction (what loads at start or by
        the poller stops here)."""
        return not self.residency.enabled or self.residency.fits_another(self.resident_models())

    async def _make_room(self, incoming: str, size: int) -> None:
        """Evict what ``residency.victims`` chooses so that ``incoming`` fits."""
        loaded = self.resident_models()
        self.residency.note_resident(sum(self.residency.of(n).size for n in loaded))
        # a model with a staged version (a canary, a golden check) is compared, not evicted;
        # nor is one that no request may load back (not opted in): it would be gone
        busy = {n for n, e in self._entries.items() if e.lock.locked() or e.staged} | {
            n for n, mvs in loaded.items()
            if not all(opted_in(mv.config, self.options.load_on_demand) for mv in mvs)}
        victims = self.residency.victims(loaded, incoming, size, busy, self._loading)
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
