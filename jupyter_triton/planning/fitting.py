"""What the bursts' figures mean for the simulation, fitted into a ``ServiceModel``.

Two loads give two unknowns each (``_split_by_load``): the event loop's CPU a request and a
batch, and the stalls a second and a request, so a lighter load meets fewer a second (and a load
served faster than the saturating burst, with less CPU a request, no more a second than the
burst: ``CapacityPlan.run`` does not extrapolate past ``burst_qps``).

How long the stalls are (``_fit_stalls``): the least hold a stall left is about the stall, the
rest the backlog behind it, which the simulation forms itself; those lengths are scaled until
the simulation of the saturating burst has the burst's own p99. Where no scale of them gives it
(none seen, or the burst's tail longer than ``STALL_SCALE_MAX`` times their lengths give: most
validation runs, benchmarks/results/planning-notes.md), that tail is holds shorter than a cycle,
more a second under load than one client met: ``hold_scale``, fitted the same way, is how many
times as many at the burst's request rate (``ServiceModel.hold_load``); where no scale up to
``HOLD_SCALE_MAX`` gives it either, the holds stay as one client met them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .bursts import BURST_CLIENTS
from .capacity import CapacityPlan, Load

if TYPE_CHECKING:
    from .bursts import Burst
    from .service import ServiceModel

#: the stalls' lengths are fitted within [0, this] times the shortest hold each left
STALL_SCALE_MAX = 4.0
#: the holds a second at the saturating burst's load are fitted within [1, this] times one client's
HOLD_SCALE_MAX = 8.0
#: requests of each simulated burst in the fit: its p99 rests on the slowest 80 (of 2000, on 20,
#: which a few stalls drawn more or less moved from seed to seed)
FIT_REQUESTS = 8000


def _split_by_load(result: ServiceModel, busy: "Burst", alone: "Burst") -> None:
    """Two loads, two unknowns each. The event loop's CPU per request is a part per request and
    a part per batch shared by its requests: alone (one request a batch) it costs both, at
    saturation the batch's part divided by the burst's mean batch. The stalls are some a second
    whatever the load (neighbours) and some a request (this load's own CPU, the clients' and the
    server's, competing for the cores): the rates at the two request rates give both."""
    if busy.loop_ns and alone.loop_ns and busy.rows > 1:
        per_batch = max(0.0, (alone.loop_ns - busy.loop_ns) / (1 - 1 / busy.rows))
        result.loop_batch_ns = int(per_batch)
        result.loop_ns = int(max(0.0, busy.loop_ns - per_batch / busy.rows))
    if busy.qps > alone.qps:
        chance = (busy.stall_rate - alone.stall_rate) / (busy.qps - alone.qps)
        chance = min(max(0.0, chance), busy.stall_rate / busy.qps)
        result.stall_chance = chance
        result.stall_rate = max(0.0, busy.stall_rate - chance * busy.qps)
    result.stall_ns = sorted(busy.stall_ns + alone.stall_ns)


def _fit_stalls(result: ServiceModel, config: dict, busy: "Burst", requests: int = 0) -> None:
    """How long the stalls are, from the tail they left. A stall shows as requests held
    beyond a cycle, but how much of that hold was the stall and how much the backlog behind
    it the latencies cannot say (``_stalls`` takes the least held). So the burst is
    simulated (its clients, config and load, the stalls as seen times a scale) and the scale
    chosen whose simulated p99 is the burst's own: the stalls that, with the backlog the
    simulation forms behind them, give the tail that was measured.

    Where the stalls cannot give that tail (none seen, or the longest scale still short: the
    burst's tail is made of holds shorter than a cycle, more of them under its load than one
    client met), the holds come ``hold_scale`` times as often at the burst's load: the scale
    whose simulated burst has the burst's p99 (``ServiceModel.hold_load``); 1 where none up to
    ``HOLD_SCALE_MAX`` gives it."""
    if not busy.p99_ns:
        return
    mbs = int(config.get("max_batch_size", 1) or 1)
    delay = int((config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)
    instances = sum(int(g.get("count", 1) or 1) for g in config.get("instance_group") or [{}])
    load = [Load("concurrency", float(BURST_CLIENTS))]
    requests = requests or FIT_REQUESTS

    def p99() -> float:
        plan = CapacityPlan(result.model, config, result, load, [(mbs, delay, instances)], requests=requests)
        return plan.results[0]["p99_ms"] * 1e6

    def largest_within(apply, lo: float, hi: float) -> float:
        """The largest value in [lo, hi] (within 1/128 of the range) whose simulated p99 is
        at most the burst's."""
        apply(hi)
        if p99() <= busy.p99_ns:
            return hi
        for _ in range(7):
            mid = (lo + hi) / 2
            apply(mid)
            if p99() < busy.p99_ns:
                lo = mid
            else:
                hi = mid
        apply(lo)
        return lo

    result.hold_scale = 1.0
    stalled = bool(result.stall_ns) and bool(result.stall_rate or result.stall_chance)
    if stalled:
        seen = list(result.stall_ns)

        def stalls(scale: float) -> None:
            result.stall_ns = [max(1, int(v * scale)) for v in seen]
        result.stall_scale = largest_within(stalls, 0.0, STALL_SCALE_MAX)
        if result.stall_scale < STALL_SCALE_MAX:
            return
    if result.holds()[0]:
        def holds(scale: float) -> None:
            result.hold_scale = scale
        if largest_within(holds, 1.0, HOLD_SCALE_MAX) >= HOLD_SCALE_MAX:
            # Not even the most holds give that tail: holds of these lengths are not what made
            # it, and as many more of them would only part the groups of clients a batch
            # answers together (the merged state at c=4), so they stay as one client met them.
            result.hold_scale = 1.0
