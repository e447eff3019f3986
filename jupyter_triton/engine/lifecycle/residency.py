"""Which models stay loaded when the operator sets a memory budget (``model_residency_bytes``)
or a count (``max_loaded_models``): the bookkeeping and the choice of what to evict.

The lifecycle does the loading and unloading; this module only remembers, per model name,
when it was last asked for, what it weighed when last loaded, and how often it was loaded
on demand or evicted, and answers "which idle models go, least recently used first, so that
what is resident fits". Sizes are what ``engine/lifecycle/memory.py`` measures for each loaded version
(CPU and GPU bytes together).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from tritonclient.grpc import model_config_pb2 as mc

if TYPE_CHECKING:
    from ..model import ModelVersion

#: config.pbtxt ``parameters { key: "residency" value: { string_value: "pinned" } }``
RESIDENCY_PARAMETER, PINNED = "residency", "pinned"
#: config.pbtxt ``parameters { key: "load_on_demand" value: { string_value: "true" } }``: a
#: request may load this model (the server's --load-on-demand is the default for models that
#: do not say; "false" opts a model out of it)
ON_DEMAND_PARAMETER = "load_on_demand"
EVICTED_REASON = "evicted: residency budget"
#: how long a request waits for its model's on-demand load before a 503
ON_DEMAND_WAIT_SECS = 60.0
#: what the 503 tells a client to wait before it asks again
RETRY_AFTER_SECS = 1
#: how long an eviction waits for a chosen model's requests in flight to finish
EVICT_WAIT_SECS = 2.0
#: a model whose on-demand load failed is not tried again for this long (each request would)
FAILED_RETRY_SECS = 5.0
#: on-demand loads under way at once, at most (fewer with a smaller --max-loaded-models, one
#: under a memory budget: engine/lifecycle/on_demand.py): one slow load does not hold the others, and a
#: burst of requests does not load everything at once
MAX_COLD_LOADS = 4


def pinned(config: mc.ModelConfig) -> bool:
    param = config.parameters.get(RESIDENCY_PARAMETER)
    return param is not None and param.string_value.strip().lower() == PINNED


def opted_in(config: mc.ModelConfig, server_default: bool) -> bool:
    """Whether a request may load the model of ``config`` (``ON_DEMAND_PARAMETER``, else the
    server's --load-on-demand)."""
    param = config.parameters.get(ON_DEMAND_PARAMETER)
    if param is None:
        return server_default
    return param.string_value.strip().lower() in ("true", "1", "yes", "on")


def version_bytes(mv: "ModelVersion") -> int:
    reader = mv.stats.memory
    if reader is None:
        return 0
    return sum(int(u.get("byte_size", 0)) for u in reader())


@dataclass
class ModelResidency:
    """What the residency control remembers of one model name, loaded or not."""
    last_used: float = 0.0
    size: int = 0                 # bytes when last loaded (0: never measured)
    cold_starts: int = 0          # loads a request caused
    evictions: int = 0
    evicted: bool = False         # unloaded by the control (not by an operator)
    failed_at: float = 0.0        # monotonic time of the last failed on-demand load
    # what it served with when last loaded: metadata and config answer from it while it
    # is evicted (a client asks for them before its first request)
    config: mc.ModelConfig | None = None
    versions: tuple[int, ...] = ()


class Residency:
    """The budget and what it knows of each model; ``enabled`` is False with both bounds 0.
    A model is known from its first load or on-demand load on (never from a request alone:
    names come from clients)."""

    def __init__(self, budget_bytes: int, max_models: int) -> None:
        self.budget_bytes = max(int(budget_bytes), 0)
        self.max_models = max(int(max_models), 0)
        self.enabled = bool(self.budget_bytes or self.max_models)
        self.models: dict[str, ModelResidency] = {}
        self.peak_bytes = 0
        self.largest_bytes = 0        # the most one model has weighed at a load

    def of(self, name: str) -> ModelResidency:
        found = self.models.get(name)
        if found is None:
            found = self.models[name] = ModelResidency()
        return found

    def touch(self, name: str) -> None:
        state = self.models.get(name)
        if state is not None:
            state.last_used = time.monotonic()

    def loaded(self, name: str, versions: Iterable["ModelVersion"], cold: bool) -> None:
        state = self.of(name)
        versions = list(versions)
        state.size = sum(version_bytes(mv) for mv in versions)
        if versions:
            state.config = max(versions, key=lambda mv: mv.version).config
            state.versions = tuple(sorted(mv.version for mv in versions))
        self.largest_bytes = max(self.largest_bytes, state.size)
        state.evicted = False
        state.failed_at = 0.0
        state.last_used = time.monotonic()
        if cold:
            state.cold_starts += 1

    def evicted(self, name: str) -> None:
        state = self.of(name)
        state.evicted = True
        state.evictions += 1

    def note_resident(self, resident: int) -> None:
        self.peak_bytes = max(self.peak_bytes, resident)

    def fits_another(self, loaded: dict[str, list["ModelVersion"]]) -> bool:
        """Whether one more model fits beside ``loaded`` without an eviction (its size
        guessed as the largest model's so far): what loads at start stops here."""
        if self.max_models and len(loaded) >= self.max_models:
            return False
        resident = sum(version_bytes(mv) for mvs in loaded.values() for mv in mvs)
        return not (self.budget_bytes and loaded and
                    resident + self.largest_bytes > self.budget_bytes)

    def victims(self, loaded: dict[str, list["ModelVersion"]], incoming: str,
                incoming_size: int, busy: set[str], loading: dict[str, int] | None = None
                ) -> list[str]:
        """Unpinned models to evict, least recently used first, so that ``incoming`` (about
        ``incoming_size`` bytes; already in ``loaded`` or not) fits both bounds beside the
        other loads under way (``loading``: name -> expected bytes). The caller
        waits (bounded) for a busy one to go idle; what cannot be evicted (pinned, loading,
        busy past that wait) stays: the budget is then exceeded, not a request failed."""
        sizes = {n: sum(version_bytes(mv) for mv in mvs) for n, mvs in loaded.items()}
        others = {n: b for n, b in (loading or {}).items() if n != incoming and n not in loaded}
        total = sum(sizes.values()) + sum(others.values()) + \
            (0 if incoming in loaded else incoming_size)
        count = len(loaded) + len(others) + (0 if incoming in loaded else 1)
        candidates = sorted(
            (n for n, mvs in loaded.items()
             if n != incoming and n not in busy and mvs
             and not any(pinned(mv.config) for mv in mvs)),
            # idle ones first, then the least recently used
            key=lambda n: (not all(mv.idle for mv in loaded[n]), self.of(n).last_used))
        chosen = []
        for name in candidates:
            over_bytes = self.budget_bytes and total > self.budget_bytes
            over_count = self.max_models and count > self.max_models
            if not (over_bytes or over_count):
                break
            chosen.append(name)
            total -= sizes[name]
            count -= 1
        return chosen

    def to_json(self, loaded: dict[str, list["ModelVersion"]]) -> dict:
        """The statistics' ``residency`` object: the bounds, what is resident now, and per
        model its state and counts."""
        resident = {n: sum(version_bytes(mv) for mv in mvs) for n, mvs in loaded.items() if mvs}
        total = sum(resident.values())
        self.note_resident(total)
        models = []
        for name in sorted(set(self.models) | set(resident)):
            state = self.of(name)
            models.append({
                "name": name,
                "state": "RESIDENT" if name in resident else
                         "EVICTED" if state.evicted else "NOT_LOADED",
                "pinned": any(pinned(mv.config) for mv in loaded.get(name, ())),
                "resident_bytes": resident.get(name, 0),
                "size_bytes": state.size,           # as measured at its last load
                "cold_starts": state.cold_starts,
                "evictions": state.evictions,
            })
        return {"budget_bytes": self.budget_bytes, "max_loaded_models": self.max_models,
                "resident_bytes": total, "peak_resident_bytes": self.peak_bytes,
                "largest_model_bytes": self.largest_bytes,
                "resident_models": len(resident),
                "cold_starts": sum(s.cold_starts for s in self.models.values()),
                "evictions": sum(s.evictions for s in self.models.values()),
                "models": models}
