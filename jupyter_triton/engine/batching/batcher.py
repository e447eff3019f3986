"""Triton's dynamic batcher: which queued requests run together, and when.

One asyncio task per model version. Whenever an instance is free it forms a batch the
way Triton's ``DynamicBatchScheduler::GetDynamicBatch`` does:

* requests are taken in service order (priority level 1 first; within a level, arrival
  order, then requests DELAYed by their queue policy), never split, while their rows fit
  in ``max_batch_size`` and their shapes agree with the first one (the first request that
  does not fit or does not agree ends the batch, which then leaves at once);
* if the rows taken reach a preferred batch size, the batch of the largest preferred size
  found leaves at once;
* otherwise it waits until the oldest request taken has been queued
  ``max_queue_delay_microseconds`` (0: no wait) or until more requests arrive, then sends
  whatever it has. After a batch of one request (one client at a time) with an instance
  free, the batch that would leave is handed to its thread at once and the thread starts it
  at the deadline (``InstancePool.hold``: the hop to the thread happens during the wait);
  until then arrivals reshape it as above. Otherwise the wait ends on the loop's alarm
  (``clock.alarm``: a ``timer.Alarm``, tens of microseconds late, not an asyncio timer, up
  to a millisecond late): under load (the last batch held several requests), so that
  requests the loop is still reading at the deadline join the batch, as tritonserver's
  whole wave does (its front reads requests in parallel threads; larger batches than when the
  thread left on the dot: benchmarks/results/notes-engine.md); and
  where the thread cannot hold it (queue timeouts pending, every instance busy,
  preserve_ordering, a rate limiter, a decoupled model).

Priorities and timeouts follow Triton's code: a priority of 0 or above ``priority_levels``
is the default level (``InferenceRequest::SetPriority``); a request's timeout can only
lower a level's non-zero ``default_timeout_microseconds`` (``PolicyQueue::Enqueue``).

Without ``preferred_batch_size`` Triton prefers ``max_batch_size``; so do we.

A queue policy's ``max_queue_size`` bounds its priority level, as in Triton. Where it is 0
(Triton: unbounded) a version-wide bound applies instead, so that a flood of requests cannot
grow the server's memory without end: ``parameters { key: "default_max_queue_size" }``,
``DEFAULT_MAX_QUEUE_SIZE`` (4096) requests by default, 0 for none. Past it a request is
refused with Unavailable (503) "Exceeds maximum queue size", like Triton's full queue.

The batcher only raises: a request it refuses (negative priority, full queue, unloading) makes
``submit`` raise; a request it drops (timeout REJECT, unload) gets the error on its future.
Errors are tagged with their ``nv_inference_request_failure`` reason (see
``statistics.failure_reason``); the engine records success/failure when the future ends.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import deque
from itertools import chain
from typing import TYPE_CHECKING, Callable, Iterator

from tritonclient.grpc import model_config_pb2 as mc

from ...config.padding import padding
from ...protocol.errors import Internal, InvalidArgument, Unavailable
from .clock import MONOTONIC, Clock
from .pending import Pending
from .scheduler import DEFAULT_MAX_QUEUE_SIZE, Pool, Scheduler, default_max_queue_size
from ..observation.statistics import ModelStatistics, mark_failure

if TYPE_CHECKING:
    from .instances import Deferred

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_QUEUE_SIZE", "DynamicBatcher"]

#: ragged_batching "pad": how many queued requests (at least; 4 x max_batch_size where more)
#: one pass over the queue looks at to group them by length bucket
PADDED_LOOKAHEAD = 256


class _Level:
    """One priority level's queue: requests in arrival order, then the DELAYed ones."""

    def __init__(self, level: int, policy: mc.ModelQueuePolicy) -> None:
        self.level = level
        self.policy = policy
        # read once: a protobuf field costs an attribute lookup a request
        self.default_timeout_ns = policy.default_timeout_microseconds * 1000
        self.queue: deque[Pending] = deque()
        self.delayed: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self.queue) + len(self.delayed)

    def __iter__(self) -> Iterator[Pending]:
        return chain(self.queue, self.delayed)

    def remove(self, p: Pending) -> None:
        try:
            self.queue.remove(p)
        except ValueError:
            self.delayed.remove(p)


class _Group:
    """One length bucket's batch as a padded pass forms it (``_form_padded_batch``)."""

    __slots__ = ("taken", "rows", "best", "longest", "full")

    def __init__(self) -> None:
        self.taken: list[Pending] = []
        self.rows = 0
        self.best = 0           # requests of the largest preferred size reached (0: none)
        self.longest = 0
        self.full = False


class DynamicBatcher(Scheduler):
    def __init__(self, config: mc.ModelConfig, pool: Pool, stats: ModelStatistics,
                 clock: Clock = MONOTONIC) -> None:
        super().__init__(pool)
        self._now = clock.now_ns          # a virtual clock in engine/batching/simulation.py
        self.stats = stats
        self.model = config.name
        db = config.dynamic_batching
        self.max_batch_size = max(1, config.max_batch_size)
        preferred = set(db.preferred_batch_size) or {self.max_batch_size}
        self.preferred_batch_sizes = preferred
        self.max_preferred_batch_size = max(preferred)
        self.delay_ns = db.max_queue_delay_microseconds * 1000
        self.default_max_queue_size = default_max_queue_size(config)
        self.preserve_ordering = db.preserve_ordering
        self.priority_levels = db.priority_levels
        self.default_priority_level = db.default_priority_level or 1
        # Ragged inputs may differ in shape inside one batch; nothing else may.
        self._ragged = {i.name for i in config.input if i.allow_ragged_batch}
        self._batching = config.max_batch_size > 0
        # ragged_batching "pad" (config/padding.py): padded inputs mix lengths, within a length
        # bucket and a token budget; without it, forming a batch costs nothing more
        self._padding = padding(config)
        if self._padding is not None:
            self._form_batch = self._form_padded_batch      # type: ignore[method-assign]
        levels = range(1, self.priority_levels + 1) if self.priority_levels else (0,)
        self._levels = {
            lvl: _Level(lvl, db.priority_queue_policy[lvl] if lvl in db.priority_queue_policy
                        else db.default_queue_policy)
            for lvl in levels}
        self._where: dict[Pending, _Level] = {}
        self._timed = 0                   # queued requests carrying a timeout still to enforce
        self._alarm = clock.alarm(self._pump)   # sub-ms deadlines (asyncio's are ms-late)
        self._pumping = False
        self._pump_soon: asyncio.Handle | None = None
        # A batch a free instance's thread holds to start at its deadline (pool.hold); with
        # preserve_ordering the batch leaves from the loop instead.
        self._deferred: Deferred | None = None
        self._defer_ok = not self.preserve_ordering
        # Whether the last batch held one request (see _pump: only then is a batch deferred).
        self._solo = True
        # told of each wait for a deadline (the requests the batch holds so far, the deadline):
        # the engine's BusyPoll.rest, where the model's loop polls for its requests
        self.on_wait: Callable[[int, int], object] | None = None
        pool.on_release = self._pump
        self._inflight: set[asyncio.Future] = set()
        self._order: deque[tuple[Pending, asyncio.Future]] = deque()
        self._closed = False

    # -- taking requests ---------------------------------------------------------------

    async def submit(self, pending: Pending) -> None:
        if self._closed:
            raise mark_failure(Unavailable(
                f"model '{self.model}' is unloading: its scheduler has stopped accepting new "
                f"inference requests"), "REJECTED")
        level = self._levels[self._resolve_priority(pending) if self.priority_levels else 0]
        # a level whose default is 0 has no timeouts (see _resolve_timeout)
        pending.timeout_ns = self._resolve_timeout(pending, level) if level.default_timeout_ns else 0
        self._check_queue_size(level)
        level.queue.append(pending)
        self._where[pending] = level
        if pending.timeout_ns:
            self._timed += 1
        pending.forget = functools.partial(self._forget, pending)
        pending.future.add_done_callback(pending.forget)
        if len(self._where) == 1:
            self._pump()        # alone in the queue: its batch (or its alarm) at once
        elif self._pump_soon is None:
            # Several requests arrive in one loop iteration: one pass over the queue for all.
            # the future's loop is the one running (asyncio.get_running_loop() is a getpid()
            # syscall a call on Python 3.11), virtual in engine/batching/simulation.py
            self._pump_soon = pending.future.get_loop().call_soon(self._pump)

    def _check_queue_size(self, level: _Level) -> None:
        if level.policy.max_queue_size:
            bound, queued, name = level.policy.max_queue_size, len(level), "max_queue_size"
            where = f" at priority level {level.level}" if level.level else ""
        else:
            bound, queued, name = self.default_max_queue_size, len(self._where), "default_max_queue_size"
            where = ""
        if bound and queued >= bound:
            raise mark_failure(Unavailable(
                f"Exceeds maximum queue size: model '{self.model}' already queues {queued} "
                f"requests{where} ({name} {bound})"), "REJECTED")

    def _resolve_priority(self, p: Pending) -> int:
        """Triton's level for ``p.priority`` (the request's 'priority' parameter, 0 if absent)
        where there are ``priority_levels`` (without, like Triton, priority means nothing: level
        0): 0 and anything above them mean the default level, as in Triton's
        ``InferenceRequest::SetPriority``."""
        if p.priority < 0:
            raise InvalidArgument(
                f"inference request to model '{self.model}' has priority {p.priority}: a "
                f"priority is 0 (the default level) or more")
        if not p.priority or p.priority > self.priority_levels:
            p.priority = self.default_priority_level
        return p.priority

    def _resolve_timeout(self, p: Pending, level: _Level) -> int:
        """Queue timeout in ns (0: none) from ``p.timeout_ns`` (the request's 'timeout'
        parameter): the level's default, which a request may only lower, and only when
        allow_timeout_override is set. As in Triton's ``PolicyQueue::Enqueue``, a level
        whose default is 0 has no timeouts: a request's own is ignored there."""
        default_ns = level.default_timeout_ns
        asked = p.timeout_ns
        if level.policy.allow_timeout_override and 0 < asked < default_ns:
            return asked
        return default_ns

    def _forget(self, p: Pending, _: asyncio.Future) -> None:
        """``p``'s future ended; if still queued (the client went away), drop it."""
        level = self._where.get(p)
        if level is not None:
            self._unqueue(p, level)
            if self._deferred is not None and self._pump_soon is None and not self._closed:
                # a thread may hold it in a batch for later: that batch is formed again
                self._pump_soon = p.future.get_loop().call_soon(self._pump)

    def _unqueue(self, p: Pending, level: _Level) -> None:
        level.remove(p)
        del self._where[p]
        p.future.remove_done_callback(p.forget)
        p.forget = None         # (the partial holds ``p``: no cycle left for the collector)
        if p.timeout_ns:
            self._timed -= 1

    # -- forming batches ---------------------------------------------------------------

    def _pump(self) -> None:
        """Form and send every batch that can leave now; otherwise hand the batch that would
        leave at its deadline to a free instance's thread, which starts it then (``defer``),
        or arm the alarm for when one can (a queue timeout, no free instance). Runs
        synchronously from ``submit``, the alarm and an instance's release: no batcher task,
        no wake-up between them."""
        self._pump_soon = None
        if self._pumping or self._closed:
            return
        self._pumping = True
        try:
            while self._where:
                now = self._now()
                if self._timed:
                    self._expire(now)
                    if not self._where:
                        break
                deferred = self._deferred
                if deferred is not None and self._timed:
                    # timeouts are the alarm's: the batch comes back to the loop
                    if not self._take_back(deferred):
                        continue
                    deferred = None
                if deferred is None and not self.pool.idle_count():
                    # every instance busy: a release pumps again; meanwhile only timeouts wake
                    if self._timed:
                        self._alarm.set(self._next_timeout_ns())
                    elif self._alarm.deadline_ns is not None:
                        self._alarm.cancel()
                    return
                batch, wait_ns, taken = self._form_batch(now)
                if deferred is not None:
                    # The queue changed while a thread holds a batch for later: it becomes
                    # what the queue says now (leaving at once if it should).
                    if not deferred.update(batch or taken, 0 if batch else now + wait_ns):
                        self._claimed(deferred)       # it started: look again without it
                        continue
                    if not batch:
                        return
                    self._deferred = None
                    for p in batch:
                        self._unqueue(p, self._where[p])
                    continue
                if not batch:
                    deadline = now + wait_ns
                    if self._timed:
                        deadline = min(deadline, self._next_timeout_ns())
                    if self.on_wait is not None:
                        self.on_wait(len(taken), deadline)
                    if self._defer_ok and self._solo and not self._timed and self.pool.can_hold():
                        self._hold(taken, deadline)
                        break
                    # Usually the deadline already set (oldest request + delay): then a no-op.
                    self._alarm.set(deadline)
                    return
                for p in batch:
                    self._unqueue(p, self._where[p])
                self._dispatch(batch)
            if self._deferred is not None and not self._where:
                self._take_back(self._deferred)   # its requests have left (cancelled)
            if self._alarm.deadline_ns is not None:
                self._alarm.cancel()          # its requests have left: no wake-up for nothing
        except Exception:
            # A bug here must not leave clients waiting forever.
            log.exception("model '%s': dynamic batcher failed", self.model)
            self._fail_queued(Internal(f"model '{self.model}': dynamic batcher failed"), "OTHER")
        finally:
            self._pumping = False

    def _hold(self, taken: list[Pending], deadline_ns: int) -> None:
        deferred = self.pool.hold(taken, deadline_ns, self._claimed)
        self._deferred = deferred
        self._inflight.add(deferred.done)
        deferred.done.add_done_callback(lambda t: self._finished(deferred.batch, t))

    def _take_back(self, deferred: Deferred) -> bool:
        """Retract the batch a thread holds for later (True: it will never run, its instance
        is free), or, where it has started already, forget its requests here (False)."""
        if deferred.retract():
            self._inflight.discard(deferred.done)
            self._deferred = None
            return True
        self._claimed(deferred)
        return False

    def _claimed(self, deferred: Deferred) -> None:
        """``deferred``'s thread has started it: its requests are no longer queued."""
        if self._deferred is not deferred:
            return
        self._deferred = None
        self._solo = len(deferred.batch) == 1
        for p in deferred.batch:
            level = self._where.get(p)
            if level is not None:
                self._unqueue(p, level)

    def _ordered(self) -> Iterator[Pending]:
        return chain.from_iterable(self._levels[lvl] for lvl in sorted(self._levels))

    def _shape_key(self, p: Pending) -> tuple:
        if not self._ragged and self._batching:
            return p.shape_key()
        return tuple((name, arr.dtype.str, arr.shape[1:] if self._batching else arr.shape)
                     for name, arr in sorted(p.inputs.items()) if name not in self._ragged)

    def _form_batch(self, now_ns: int) -> tuple[list[Pending], int, list[Pending]]:
        """Triton's GetDynamicBatch: (batch to send now, 0, _) or ([], ns to wait, the batch
        that would leave if nothing else came)."""
        taken: list[Pending] = []
        rows = 0
        best = 0                          # requests in the best batch found so far
        send_now = False
        key = None
        # A lone request (c=1) needs no service order and no shape comparison.
        for p in self._where if len(self._where) == 1 else self._ordered():
            size = max(1, p.batch_size)
            if taken:
                if rows + size > self.max_preferred_batch_size and best == 0:
                    best = len(taken)     # can't grow past the largest preferred size
                if key is None:
                    key = self._shape_key(taken[0])
                if rows + size > self.max_batch_size or self._shape_key(p) != key:
                    send_now = True
                    break
            taken.append(p)
            rows += size
            if rows in self.preferred_batch_sizes:
                best = len(taken)
        # (inline, not a call of _leave: at c=1 the call is a visible part of this; see
        # benchmarks/results/notes-engine.md)
        oldest = min(p.enqueue_ns for p in taken) if len(taken) > 1 else taken[0].enqueue_ns
        waited = now_ns - oldest
        delay_exceeded = self.delay_ns != 0 and waited >= self.delay_ns
        if best and not delay_exceeded:
            return taken[:best], 0, taken
        if send_now or rows >= self.max_preferred_batch_size or delay_exceeded or not self.delay_ns:
            return taken, 0, taken
        return [], self.delay_ns - waited, taken

    def _leave(self, taken: list[Pending], rows: int, best: int, send_now: bool,
               now_ns: int) -> tuple[list[Pending], int, list[Pending]]:
        """Whether the batch ``taken`` (``best``: the requests of its preferred size, 0: none)
        leaves now: ``_form_batch``'s answer, for a padded pass's groups."""
        oldest = min(p.enqueue_ns for p in taken) if len(taken) > 1 else taken[0].enqueue_ns
        waited = now_ns - oldest
        delay_exceeded = self.delay_ns != 0 and waited >= self.delay_ns
        if best and not delay_exceeded:
            return taken[:best], 0, taken
        if send_now or rows >= self.max_preferred_batch_size or delay_exceeded or not self.delay_ns:
            return taken, 0, taken
        return [], self.delay_ns - waited, taken

    def _form_padded_batch(self, now_ns: int) -> tuple[list[Pending], int, list[Pending]]:
        """``_form_batch`` where batches are padded. Requests batch only with their group (their
        length bucket, and the shapes of their inputs that are not padded); each group's batch
        takes its requests in service order while its padded tokens (rows x its longest
        length) stay within ``max_batch_tokens`` (a request over the budget alone runs alone).
        The oldest request's batch leaves first; while it waits, another group's batch that
        can leave now (full, or its delay over) does."""
        budget = self._padding.max_batch_tokens
        groups: dict[tuple, _Group] = {}
        first: _Group | None = None
        lookahead = max(PADDED_LOOKAHEAD, 4 * self.max_batch_size)
        for seen, p in enumerate(self._where if len(self._where) == 1 else self._ordered()):
            if seen == lookahead:
                break               # a pass over the queue stays short on the loop
            key = p._shape_key      # (group, length), computed once a request (_padded_key)
            if key is None:
                key = p._shape_key = self._padded_key(p)
            g = groups.get(key[0])
            if g is None:
                g = groups[key[0]] = _Group()
                if first is None:
                    first = g
            elif g.full:
                continue
            size = max(1, p.batch_size)
            if g.taken:
                if g.rows + size > self.max_preferred_batch_size and g.best == 0:
                    g.best = len(g.taken)
                length = max(g.longest, key[1])
                if g.rows + size > self.max_batch_size or (budget and (g.rows + size) * length > budget):
                    g.full = True
                    if g is first:
                        break       # the oldest request's batch leaves now
                    continue
            g.taken.append(p)
            g.rows += size
            g.longest = max(g.longest, key[1])
            if g.rows in self.preferred_batch_sizes:
                g.best = len(g.taken)
        waiting = None
        for g in groups.values():   # the oldest request's group first
            if budget and (g.rows + 1) * g.longest > budget:
                g.full = True       # not one more row fits: nothing to wait for
            formed = self._leave(g.taken, g.rows, g.best, g.full, now_ns)
            if formed[0]:
                return formed
            if waiting is None:
                waiting = formed
        return waiting

    def _padded_key(self, p: Pending) -> tuple:
        padding = self._padding
        length = padding.length(p.inputs)
        shapes = tuple((name, arr.dtype.str, None if name in padding.axes else arr.shape[1:])
                       for name, arr in sorted(p.inputs.items()))
        return (padding.bucket(length), shapes), length

    def _expire(self, now_ns: int) -> None:
        """Apply each level's timeout_action to requests whose queue timeout has passed
        (where some are ``_timed``)."""
        for level in self._levels.values():
            expired = [p for p in level.queue if p.timeout_ns and now_ns >= p.enqueue_ns + p.timeout_ns]
            for p in expired:
                if level.policy.timeout_action == mc.ModelQueuePolicy.DELAY:
                    # Behind every request of this level that has not timed out; never again timed.
                    level.queue.remove(p)
                    level.delayed.append(p)
                    p.timeout_ns = 0
                    self._timed -= 1
                else:
                    self._unqueue(p, level)
                    if not p.future.done():
                        p.future.set_exception(mark_failure(Unavailable(
                            f"Request timeout expired: request to model '{self.model}' waited in "
                            f"the queue longer than its timeout of {p.timeout_ns // 1000} us"),
                            "REJECTED"))

    def _next_timeout_ns(self) -> int:
        """The earliest queue timeout (where some are ``_timed``)."""
        return min(p.enqueue_ns + p.timeout_ns for p in self._where if p.timeout_ns)

    # -- running batches ---------------------------------------------------------------

    def _dispatch(self, batch: list[Pending]) -> None:
        self._solo = len(batch) == 1
        if self.preserve_ordering:
            batch = [self._in_order(p) for p in batch]
        task = self.pool.run(batch)         # no task per batch (unless rate-limited)
        self._inflight.add(task)
        task.add_done_callback(functools.partial(self._finished, batch))

    def _finished(self, batch: list[Pending], task: asyncio.Future) -> None:
        self._inflight.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # execute() resolves every future itself; if it crashed, nobody else will.
        log.error("model '%s': batch execution failed", self.model, exc_info=task.exception())
        for p in batch:
            if not p.future.done():
                p.future.set_exception(mark_failure(Internal(
                    f"model '{self.model}': batch execution failed: {task.exception()}"), "BACKEND"))

    def _in_order(self, p: Pending) -> Pending:
        """A stand-in whose result is handed to ``p`` only after every earlier request's."""
        inner = p.future.get_loop().create_future()
        self._order.append((p, inner))
        inner.add_done_callback(self._deliver_in_order)
        p.future.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        return dataclasses.replace(p, future=inner)

    def _deliver_in_order(self, _: asyncio.Future) -> None:
        while self._order and self._order[0][1].done():
            outer, inner = self._order.popleft()
            if outer.future.done():
                continue
            if inner.cancelled():
                outer.future.cancel()
            elif inner.exception() is not None:
                outer.future.set_exception(inner.exception())
            else:
                outer.future.set_result(inner.result())

    # -- stopping ----------------------------------------------------------------------

    def _fail_queued(self, err: Exception, reason: str) -> None:
        for p, level in list(self._where.items()):
            self._unqueue(p, level)
            if not p.future.done():
                p.future.set_exception(mark_failure(type(err)(str(err)), reason))

    def queued_count(self) -> int:
        return len(self._where)

    async def close(self) -> None:
        """Refuse new requests, fail queued ones with Unavailable, stop forming batches,
        and wait for the batches already running to finish."""
        self._closed = True
        self._alarm.close()
        if self._pump_soon is not None:
            self._pump_soon.cancel()
            self._pump_soon = None
        if self._deferred is not None:
            # taken back (its instance freed: nothing is formed once closed), or it runs:
            # then not failed as queued
            self._take_back(self._deferred)
        self._fail_queued(Unavailable(
            f"model '{self.model}' was unloaded before the request could be scheduled"), "REJECTED")
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
