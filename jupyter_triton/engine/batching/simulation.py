"""The engine's own scheduler on a virtual clock: what a config does under some traffic,
in seconds of CPU, before it is deployed.

``simulate`` builds the model's real scheduler (``DynamicBatcher`` with a
``dynamic_batching`` block, ``DirectScheduler`` without) on a ``clock.VirtualLoop`` and
feeds it requests; only the instances are simulated: one takes a batch of ``rows`` for
``service(rows, rng)`` virtual ns. Priorities, queue policies (timeouts, DELAY/REJECT,
queue sizes), preferred sizes, preserve_ordering and several instances behave as they do
when serving because they are the same code.

Two differences from serving, neither a batching decision: an instance starts a batch at
its deadline from the loop's alarm, not from a batch handed early to its thread
(``InstancePool.hold``, a hand-off saving); and what lies outside the scheduler is modelled
by two figures per request, each half before the scheduler and half after: ``overhead_ns``,
a delay requests spend side by side (client, network, wake-ups), each request's drawn as
``overhead_ns`` plus one of ``jitter_ns`` (zero-median variations; none: fixed), and
``loop_ns``, the server's own work on its one event loop (read, decode, validate; encode,
write), which requests take in turn: under load it spreads their arrivals at the scheduler
(and bounds throughput at 1 / ``loop_ns``), which is what makes the batches formed at high
concurrency smaller than the concurrency. ``loop_batch_ns`` is the loop's work per batch
(dispatching it, taking its results): taken in turn too, from the moment the batch leaves,
so it runs beside the batch's execution and delays only what needs the loop meanwhile. The
drawn delays also keep closed-loop clients from moving in lockstep, as real ones do not;
``stagger_ns`` spreads their first sends.

Stalls hold the event loop for one of ``stall_ns``: the moments a busy machine gives the
server's threads no core. They come ``stall_rate`` a second while the server works (a
Poisson stream; a stall that comes while every instance and the event loop are idle has
nothing to hold: neighbours' load; stalls that overlap hold it for their union) and with probability ``stall_chance`` at each request's
turn on the loop (the load's own CPU competing for the cores: a lighter load meets fewer a
second). Unlike a request's own delay, a stall holds up every request waiting for the
loop, and answers queue behind it: the correlated tail that a shared machine shows under load.

Requests may carry a length (``Arrival.length``, ``ClosedLoop.lengths``: texts of
different lengths, issue 36): each then holds stand-in inputs of that length (no memory: a
broadcast zero) for the config's variable-length inputs, so the real batcher groups them as it
groups real requests: with ``ragged_batching: "pad"`` (config/padding.py) within a length
bucket and the token budget, padded to the batch's longest member; without it only equal
lengths together. An instance then takes ``service(rows, rng, length)`` ns for a batch padded
to ``length``; ``SimResult.tokens`` holds each such batch's (padded, real) tokens.

Holds are the clients' side of the same thing, shorter than a cycle: moments (``hold_rate``
a second, a Poisson stream, each one of ``hold_ns`` long) when an answer written by the
server does not reach its client; every answer due in one reaches it when the hold ends.
A request's own drawn delay cannot do that: answered together, a group of clients is held
together, comes back late together and may then find another group's clients returning
within the queue delay (the regrouping that closed-loop clients show at a delay shorter
than an execution). Alone (one client) a hold delays an answer due inside it by what is
left of it.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.datatypes import config_to_triton, triton_to_numpy
from ...protocol.errors import TritonError
from .batcher import DynamicBatcher
from .clock import VirtualClock, VirtualLoop
from ..model import instance_specs
from .pending import Pending
from .scheduler import DirectScheduler
from ..observation.statistics import ModelStatistics

__all__ = ["Arrival", "ClosedLoop", "Outcome", "ServiceTime", "SimResult", "simulate"]


@dataclass(frozen=True)
class Arrival:
    """One request of open-loop traffic, sent at ``t_ns`` whatever the server does."""
    t_ns: int
    rows: int = 1
    priority: int = 0
    timeout_us: int = 0
    cls: str = ""
    length: int = 0             # tokens (a variable-length input's length); 0: none


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` clients sending ``requests`` in all, each its next one when the
    previous answer came (+ ``think_ns``): what perf_analyzer does. ``lengths``: the
    requests' lengths in the order they are sent (by any client), cycled; empty: none."""
    concurrency: int
    requests: int
    rows: int = 1
    think_ns: int = 0
    priority: int = 0
    timeout_us: int = 0
    cls: str = ""
    lengths: tuple[int, ...] = ()


#: (rows, rng) -> ns; where requests carry lengths, (rows, rng, padded length) -> ns
ServiceTime = Callable[[int, random.Random], int]


@dataclass
class Outcome:
    """One request as its client saw it: sent at ``arrival_ns``, answered at ``end_ns``;
    its batch started at ``start_ns`` with ``batch_rows`` rows."""
    cls: str
    arrival_ns: int
    start_ns: int | None
    end_ns: int | None
    batch_rows: int
    status: str          # "ok" | "rejected" (refused on arrival) | "timeout" (dropped from the queue)
    length: int = 0      # its tokens (0: the traffic carried no lengths)


@dataclass
class SimResult:
    requests: list[Outcome]
    batches: list[tuple[int, int, int]]     # (start_ns, rows, instance index)
    duration_ns: int
    tokens: list[tuple[int, int]] = field(default_factory=list)  # a batch's (padded, real) tokens


class _SimPool:
    """``scheduler.Pool`` with virtual instances (the batcher's ``hold`` is never offered:
    it only saves a hand-off between threads)."""

    def __init__(self, count: int, loop: VirtualLoop, service: ServiceTime, rng: random.Random) -> None:
        self.instances = list(range(count))
        self._loop = loop
        self._service = service
        self._rng = rng
        self._idle: asyncio.Queue[int] = asyncio.Queue()
        for i in self.instances:
            self._idle.put_nowait(i)
        self.on_release: Callable[[], object] | None = None
        self.on_run: Callable[[], object] | None = None      # the server's loop dispatches it
        self.batches: list[tuple[int, int, int]] = []
        self.tokens: list[tuple[int, int]] = []

    @property
    def size(self) -> int:
        return len(self.instances)

    def idle_count(self) -> int:
        return self._idle.qsize()

    async def acquire(self) -> int:
        return await self._idle.get()

    def release(self, instance: int) -> None:
        self._idle.put_nowait(instance)
        if self.on_release is not None:
            self.on_release()

    def can_hold(self) -> bool:
        return False

    def run(self, batch: list[Pending], instance: int | None = None) -> asyncio.Future:
        if instance is None:
            instance = self._idle.get_nowait()
        loop = self._loop
        done = loop.create_future()
        live = [p for p in batch if not p.future.done()]      # cancelled while queued
        if not live:
            self.release(instance)
            done.set_result(None)
            return done
        now = loop.now
        rows = sum(p.batch_size for p in live)
        for p in live:
            p.started = True
            p.start_ns = now
            p.request.start_ns = now            # the Outcome (a stand-in keeps the same one)
            p.request.batch_rows = rows
        self.batches.append((now, rows, instance))
        if self.on_run is not None:
            self.on_run()
        longest = max(p.request.length for p in live)
        if longest:
            # padded to its longest member (without padding its members' lengths are equal)
            self.tokens.append((rows * longest, sum(p.batch_size * p.request.length for p in live)))
            took = max(0, int(self._service(rows, self._rng, longest)))  # type: ignore[call-arg]
        else:
            took = max(0, int(self._service(rows, self._rng)))
        loop.call_at((now + took) / 1e9, self._ran, instance, live, done)
        return done

    def _ran(self, instance: int, live: list[Pending], done: asyncio.Future) -> None:
        for p in live:
            if not p.future.done():
                p.future.set_result(None)
        done.set_result(None)
        self.release(instance)


@dataclass
class _Client:
    """The request stream of one ``ClosedLoop`` (its ``left`` to send) or of the arrivals."""
    spec: ClosedLoop | None
    left: int
    arrivals: deque = field(default_factory=deque)
    lengths: "itertools.cycle | None" = None       # a closed loop's next lengths


class _Simulation:
    def __init__(self, config: mc.ModelConfig, service: ServiceTime,
                 traffic: Sequence[Arrival | ClosedLoop], seed: int, overhead_ns: int,
                 loop_ns: int, jitter_ns: Sequence[int] = (), stagger_ns: int = 0,
                 stall_ns: Sequence[int] = (), stall_rate: float = 0.0, stall_chance: float = 0.0,
                 loop_batch_ns: int = 0, hold_ns: Sequence[int] = (), hold_rate: float = 0.0) -> None:
        self.loop = VirtualLoop()
        self.pool = _SimPool(len(instance_specs(config)), self.loop, service, random.Random(seed))
        self.config = config
        self.overhead_ns = overhead_ns
        self.jitter_ns = list(jitter_ns)
        self.stagger_ns = stagger_ns
        self.outside_rng = random.Random(f"outside/{seed}")    # apart: service draws stay the same
        self.stall_ns = list(stall_ns) if max(stall_rate, stall_chance) > 0 else []
        self.stall_rate = stall_rate
        self.stall_chance = stall_chance
        self.stall_rng = random.Random(f"stalls/{seed}")
        self.hold_ns = list(hold_ns) if hold_rate > 0 else []
        self.hold_rate = hold_rate / 1e9    # a ns
        self.hold_rng = random.Random(f"holds/{seed}")
        self.hold_starts: list[int] = []    # the holds so far, overlapping ones as their union
        self.hold_ends: list[int] = []
        self.hold_next = int(self.hold_rng.expovariate(self.hold_rate)) if self.hold_ns else 0
        self.loop_stage = bool(loop_ns or self.stall_ns or loop_batch_ns)   # requests pass the loop in turn
        self.loop_batch_ns = loop_batch_ns
        if loop_batch_ns:
            self.pool.on_run = self._dispatched
        self.loop_in = loop_ns // 2
        self.loop_out = loop_ns - self.loop_in
        self.loop_free_ns = 0               # when the server's event loop is next free
        self.stalled_until_ns = 0           # when the latest stall a second ends
        self.outcomes: list[Outcome] = []
        self.end_ns = 0
        self.open = 0
        arrivals = sorted((a for a in traffic if isinstance(a, Arrival)), key=lambda a: a.t_ns)
        self.open_loop = _Client(None, len(arrivals), deque(arrivals))
        self.closed = [_Client(c, c.requests, lengths=itertools.cycle(c.lengths) if c.lengths else None)
                       for c in traffic if isinstance(c, ClosedLoop)]
        self.variable = _variable_inputs(config)
        self.open = len(arrivals) + sum(c.left for c in self.closed)
        for c in traffic:
            if not isinstance(c, (Arrival, ClosedLoop)):
                raise TypeError(f"traffic must be Arrival or ClosedLoop, not {type(c).__name__}")
            if isinstance(c, ClosedLoop) and c.requests and c.concurrency < 1:
                raise ValueError(f"ClosedLoop concurrency must be 1 or more, got {c.concurrency}")
            if any(n < 0 for n in (c.lengths if isinstance(c, ClosedLoop) else (c.length,))):
                raise ValueError("request lengths must be 0 or more")
        self.finished: asyncio.Future | None = None

    def run(self) -> SimResult:
        if not self.open:
            return SimResult([], [], 0)
        errors: list[dict] = []
        self.loop.set_exception_handler(lambda _, context: errors.append(context))
        outer = asyncio.events._get_running_loop()     # a notebook's loop may be running
        asyncio.events._set_running_loop(None)
        try:
            self.loop.run_until_complete(self._main())
        finally:
            asyncio.events._set_running_loop(outer)
            self.loop.close()
        if errors:
            context = errors[0]
            raise RuntimeError(f"simulation failed: {context.get('message')}") from context.get("exception")
        return SimResult(self.outcomes, self.pool.batches, self.end_ns, self.pool.tokens)

    async def _main(self) -> None:
        clock = VirtualClock(self.loop)
        if self.config.HasField("dynamic_batching"):
            self.scheduler = DynamicBatcher(self.config, self.pool, ModelStatistics(self.config.name, "1"),
                                            clock=clock)
        else:
            self.scheduler = DirectScheduler(self.pool, self.config)
        self.finished = self.loop.create_future()
        if self.stall_ns and self.stall_rate:
            self._next_stall()
        if self.open_loop.arrivals:
            self._next_arrival()
        for client in self.closed:
            for _ in range(min(client.spec.concurrency, client.left)):
                start = int(self.outside_rng.random() * self.stagger_ns) if self.stagger_ns else 0
                self._send_at(client, start)
        await self.finished
        await self.scheduler.close()

    def _dispatched(self) -> None:
        """A batch left for its instance: the loop's work per batch (beside the execution)."""
        self._take_loop(self.loop_batch_ns)

    def _take_loop(self, work_ns: int, request: bool = False) -> int:
        """The loop does ``work_ns`` in its turn (a stall may come with it); when it is done."""
        end = max(self.loop.now, self.loop_free_ns) + work_ns
        if request and self.stall_ns and self.stall_chance and self.stall_rng.random() < self.stall_chance:
            end += self.stall_rng.choice(self.stall_ns)
        self.loop_free_ns = end
        return end

    def _next_stall(self) -> None:
        self.loop.call_at(self.loop.now / 1e9 + self.stall_rng.expovariate(self.stall_rate), self._stall)

    def _stall(self) -> None:
        if self.finished is None or self.finished.done():
            return
        now = self.loop.now
        if self.pool.idle_count() < self.pool.size or self.loop_free_ns > now:    # at work
            # Stalls that overlap hold the loop once, as their union: two neighbours taking the
            # cores at once do not take them twice as long (added up, a rate times a length past
            # one second a second would hold the loop for ever and the run would never end).
            end = now + self.stall_rng.choice(self.stall_ns)
            extra = end - max(now, self.stalled_until_ns)
            if extra > 0:
                self.loop_free_ns = max(now, self.loop_free_ns) + extra
                self.stalled_until_ns = end
        self._next_stall()

    def _held(self, t: int) -> int:
        """When an answer due at ``t`` reaches its client: at the end of the hold it falls in."""
        starts, ends = self.hold_starts, self.hold_ends
        while self.hold_next <= t:          # the Poisson stream drawn as far as ``t``
            start, end = self.hold_next, self.hold_next + self.hold_rng.choice(self.hold_ns)
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
            self.hold_next = start + max(1, int(self.hold_rng.expovariate(self.hold_rate)))
        i = bisect.bisect_right(starts, t) - 1
        return ends[i] if i >= 0 and t < ends[i] else t

    def _outside(self) -> tuple[int, int]:
        """One request's delay outside the server: (before it, after it)."""
        delay = self.overhead_ns
        if self.jitter_ns:
            delay = max(0, delay + self.outside_rng.choice(self.jitter_ns))
        return delay // 2, delay - delay // 2

    def _next_arrival(self) -> None:
        a = self.open_loop.arrivals[0]
        before, after = self._outside()
        self.loop.call_at((a.t_ns + before) / 1e9, self._arrive, self.open_loop, a.t_ns, after)

    def _send_at(self, client: _Client, sent_ns: int) -> None:
        client.left -= 1
        before, after = self._outside()
        self.loop.call_at((sent_ns + before) / 1e9, self._arrive, client, sent_ns, after)

    def _arrive(self, client: _Client, sent_ns: int, after_ns: int) -> None:
        """The request reaches the server; it reaches the scheduler once the loop has read it."""
        if client.spec is None:
            spec = client.arrivals.popleft()
            if client.arrivals:
                self._next_arrival()
        else:
            spec = client.spec
        length = spec.length if isinstance(spec, Arrival) else next(client.lengths) if client.lengths else 0
        if self.loop_stage:
            ready = self._take_loop(self.loop_in, request=True)
            self.loop.call_at(ready / 1e9, self._submit, client, spec, sent_ns, after_ns, length)
        else:
            self._submit(client, spec, sent_ns, after_ns, length)

    def _submit(self, client: _Client, spec: Arrival | ClosedLoop, sent_ns: int, after_ns: int,
                length: int = 0) -> None:
        outcome = Outcome(spec.cls, sent_ns, None, None, 0, "ok", length)
        self.outcomes.append(outcome)
        future = self.loop.create_future()
        inputs = {}
        if length:
            # shapes only: the batcher reads a request's length from its inputs' shapes
            inputs = {name: np.broadcast_to(np.zeros((), dtype), (spec.rows, *(length if d < 0 else d for d in dims)))
                      for name, (dtype, dims) in self.variable.items()}
        # The Outcome stands in for the request: only the pool reads it (start, batch rows, length).
        pending = Pending(outcome, inputs, spec.rows, future, priority=spec.priority,  # type: ignore[arg-type]
                          timeout_ns=spec.timeout_us * 1000, enqueue_ns=self.loop.now)
        submit = self.scheduler.submit(pending)
        try:
            submit.send(None)
        except StopIteration:
            pass
        except TritonError:
            outcome.status = "rejected"
            self._answered(client, outcome, after_ns)
            return
        else:
            submit.close()
            raise RuntimeError("a scheduler's submit waited: the simulation cannot drive it")
        future.add_done_callback(lambda f: self._done(client, outcome, f, after_ns))

    def _done(self, client: _Client, outcome: Outcome, future: asyncio.Future, after_ns: int) -> None:
        if future.cancelled() or future.exception() is not None:
            outcome.status = "timeout" if outcome.start_ns is None else "error"
        self._answered(client, outcome, after_ns)

    def _answered(self, client: _Client, outcome: Outcome, after_ns: int) -> None:
        now = self.loop.now
        if self.loop_stage:                 # the loop writes the answer in its turn
            now = self._take_loop(self.loop_out)
        end = now + after_ns
        if self.hold_ns:
            end = self._held(end)
        outcome.end_ns = end
        self.end_ns = max(self.end_ns, end)
        self.open -= 1
        if client.spec is not None and client.left > 0:
            self._send_at(client, end + client.spec.think_ns)
        if not self.open:
            self.finished.set_result(None)


def _variable_inputs(config: mc.ModelConfig) -> dict[str, tuple[np.dtype, list[int]]]:
    """The config's inputs with a variable dimension (-1): their dtype and dims (without the
    batch dimension), which a request's length fills."""
    out = {}
    for tensor in config.input:
        if -1 in tensor.dims and tensor.data_type != mc.TYPE_STRING:
            dtype = triton_to_numpy(config_to_triton(mc.DataType.Name(tensor.data_type)))
            out[tensor.name] = (np.dtype(dtype), list(tensor.dims))
    return out


def simulate(config: mc.ModelConfig, service: ServiceTime, traffic: Sequence[Arrival | ClosedLoop], *,
             seed: int = 0, overhead_ns: int = 0, loop_ns: int = 0, jitter_ns: Sequence[int] = (),
             stagger_ns: int = 0, stall_ns: Sequence[int] = (), stall_rate: float = 0.0,
             stall_chance: float = 0.0, loop_batch_ns: int = 0, hold_ns: Sequence[int] = (),
             hold_rate: float = 0.0) -> SimResult:
    """Run ``traffic`` through ``config``'s scheduler on virtual time (see the module)."""
    if min(overhead_ns, loop_ns, loop_batch_ns, stagger_ns, stall_rate, stall_chance, hold_rate) < 0 or \
            any(v < 0 for v in (*stall_ns, *hold_ns)) or stall_chance > 1:
        raise ValueError(f"overhead_ns, loop_ns, loop_batch_ns, stagger_ns, stall_rate, hold_rate, stalls "
                         f"and holds must be 0 or more and stall_chance in [0, 1], got {overhead_ns}, "
                         f"{loop_ns}, {loop_batch_ns}, {stagger_ns}, {stall_rate}, {hold_rate}, {stall_chance}")
    return _Simulation(config, service, traffic, seed, overhead_ns, loop_ns, jitter_ns, stagger_ns,
                       stall_ns, stall_rate, stall_chance, loop_batch_ns, hold_ns, hold_rate).run()
