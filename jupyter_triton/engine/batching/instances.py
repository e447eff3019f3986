"""Model instances: one worker thread each, handed out first-free, never two batches at once.

``InstancePool.run(batch)`` is where a batch leaves the event loop: it runs the batch on a
free instance's own thread (after the rate limiter's admission where one applies), times
compute input/infer/output for the statistics, resolves each request's future with its
outputs or its error and frees the instance. A tensor backend runs one merged batch: its
requests are merged here and its outputs split back (``execute``); any other backend takes
the requests as they came (``Backend.execute``). ``hold`` hands a free instance's
thread a batch before its queue delay has ended; the thread starts it at the deadline
(``Deferred``), so the hop from the loop to the thread happens during the wait. Schedulers
see only these (``scheduler.Pool``); instances, threads and hand-offs stay here.

A backend whose work runs in another process (the python backend's workers) may let the
loop wait for it (``Backend.start_on_loop``): ``run`` sends the batch from the loop (a batch
waiting for its deadline too, from the batcher's alarm: such a pool does not ``hold``), and
the loop itself reads the answer and delivers it (``OnLoopBatch``): no thread
waits, nothing hops back. Only the blocking part of a failure (restarting a worker) still
runs on the instance's thread.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, Callable

from ...backends.base import Backend, TensorBackend, Tensors
from ...backends.ragged import RaggedPlan, concatenate, split_rows
from ...protocol.errors import Internal, InvalidArgument, TritonError

from ..composition.bls import executing
from ..observation.statistics import StatPadding, mark_failure
from .timer import precise_thread_sleep

if TYPE_CHECKING:
    from .pending import Pending
    from .rate_limiter import RateLimiter
    from ..observation.statistics import ModelStatistics

log = logging.getLogger(__name__)

# A held batch still running this long after its deadline has its start recorded by the loop
# (Deferred, InstancePool._check_later): statistics are at most this late for long executions.
CHECK_S = 0.001


class Instance:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.instance.name
        # One thread per instance: runtimes release the GIL, so instances truly overlap.
        self.thread = InstanceThread(f"triton-{self.name}")
        # rate_limiter resources this instance holds while executing (rate_limiter.instance_resources)
        self.resources: dict[str, int] = {}
        self.rate_priority = 0

    def close(self) -> None:
        try:
            self.backend.unload()
        finally:
            self.thread.shutdown(wait=False)


class Deferred:
    """A batch handed to an instance's thread before its queue delay has ended: the thread
    starts it itself at ``deadline_ns``, so the batch leaves from the thread's own wake-up
    instead of the loop's alarm and a second hop from the loop to the thread (the latency it
    saves: benchmarks/results/notes-engine.md). Until the thread claims it the loop may replace
    the batch (a request arrived that joins it, or left it), move the deadline (``0``: at
    once) or take the batch back; after, the batch is the thread's and runs as claimed.
    ``start_ns`` is when it was claimed: the requests' queue time ends there. ``done`` ends
    once the batch has run and been delivered, or was taken back."""

    __slots__ = ("batch", "deadline_ns", "start_ns", "live", "check", "done", "_release",
                 "_state", "_lock", "_wake")

    OPEN, CLAIMED, RETRACTED = range(3)

    def __init__(self, batch: list["Pending"], deadline_ns: int, done: asyncio.Future | None = None,
                 release: Callable[[], Any] | None = None) -> None:
        self.batch = batch
        self.deadline_ns = deadline_ns
        self.done = done
        self._release = release         # frees the instance of a batch taken back
        self.start_ns = 0
        self.live: list[int] | None = None      # once its start is recorded: indices still wanted
        self.check: asyncio.TimerHandle | None = None   # the loop's look for a long run (defer)
        self._state = self.OPEN
        # Two plain locks, not a Condition (dearer to build, once a batch; see
        # benchmarks/results/notes-engine.md): _lock
        # guards the fields; _wake is held while nobody has news for the thread, which waits
        # on it until its deadline and is woken early by a release.
        self._lock = threading.Lock()
        self._wake = threading.Lock()
        self._wake.acquire()

    def update(self, batch: list["Pending"], deadline_ns: int) -> bool:
        """The loop's new batch and deadline; False if the thread has claimed it already."""
        with self._lock:
            if self._state != self.OPEN:
                return False
            self.batch = batch
            earlier = deadline_ns < self.deadline_ns
            self.deadline_ns = deadline_ns
            if earlier:
                self._notify()
            return True

    def retract(self) -> bool:
        """Take the batch back: the thread skips it, ``done`` ends and the instance is free
        again (on the loop's thread). False if the thread has claimed it already."""
        with self._lock:
            if self._state != self.OPEN:
                return False
            self._state = self.RETRACTED
            self._notify()
        if self.check is not None:
            self.check.cancel()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
        if self._release is not None:
            self._release()
        return True

    def _notify(self) -> None:
        # Only the loop releases, only the thread acquires: a held lock stays held until here.
        if self._wake.locked():
            self._wake.release()

    def _claim(self) -> list["Pending"] | None:
        """On the thread: wait for the deadline, then own the batch (None: retracted)."""
        while True:
            with self._lock:
                if self._state != self.OPEN:
                    return None
                now = time.monotonic_ns()
                if now >= self.deadline_ns:
                    self._state = self.CLAIMED
                    self.start_ns = now
                    return self.batch
                wait_s = (self.deadline_ns - now) / 1e9
            self._wake.acquire(True, wait_s)


class InstanceThread(Executor):
    """A one-thread executor whose thread is a daemon: a model stuck in execute (a thread
    cannot be killed) must not keep the server process alive at exit, which the standard
    ThreadPoolExecutor would, since it joins its threads at interpreter exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post_deferred(self, loop: asyncio.AbstractEventLoop,
                      done: Callable[[Any, BaseException | None], Any],
                      fn: Callable[[list], Any], deferred: Deferred) -> None:
        """``fn(batch)`` on this thread once ``deferred`` is claimed (its deadline), then
        ``done(result, error)`` on ``loop``; nothing if the loop takes it back first."""
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._jobs.put((done, fn, deferred, loop))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def call(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` on this thread, settling an asyncio future of ``loop``. Leaner than
        ``run_in_executor`` (no concurrent Future chained to an asyncio one); the job runs
        even if the future is cancelled."""
        future = loop.create_future()
        self.post(loop, functools.partial(_settle, future), fn, *args)
        return future

    def post(self, loop: asyncio.AbstractEventLoop, done: Callable[[Any, BaseException | None], Any],
             fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on this thread, then ``done(result, error)`` on ``loop``: the data
        path's hand-off, one ``call_soon_threadsafe`` back and no future at all."""
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._jobs.put((done, fn, args, loop))

    def _run(self) -> None:
        # Deadlines (Deferred) are waited for here: without this, Linux adds the thread's 50 us
        # of timer slack to every timed wait.
        precise_thread_sleep()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, extra = job
            if type(future) is not Future:          # post(): extra is the loop to call back on
                try:
                    if type(args) is Deferred:
                        batch = args._claim()
                        if batch is None:
                            continue                # taken back by the loop
                        result, error = fn(batch), None
                    else:
                        result, error = fn(*args), None
                except BaseException as err:
                    result, error = None, err
                try:
                    extra.call_soon_threadsafe(future, result, error)
                except RuntimeError:
                    pass            # the loop has closed: nobody waits any more
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **extra)
            except BaseException as err:
                future.set_exception(err)
            else:
                future.set_result(result)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def run_in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """``fn()`` on a fresh daemon thread; the returned future may be abandoned (unloading
    a hung model stops waiting for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as err:
            result, error = None, err
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:
            pass        # the loop has closed: nobody waits any more

    threading.Thread(target=run, name="triton-unload", daemon=True).start()
    return future


class OnLoopBatch:
    """One batch the event loop waits for itself (``Backend.start_on_loop``: a backend whose
    work runs in another process, the python backend's workers), called as the ``done`` of
    ``start_on_loop``: the backend's outcome goes to ``pool.ran`` as the instance thread's job
    would give it (results and timing, or the error), with no thread waiting and nothing
    hopping back to the loop; only the blocking part of a failure (``finish``) runs on the
    instance's thread. One object a batch rather than a closure for each step: this runs once
    a batch on the loop. ``started_ns``: when the batch started."""

    __slots__ = ("pool", "loop", "instance", "live", "future", "started_ns")

    def __init__(self, pool: "InstancePool", loop: asyncio.AbstractEventLoop, instance: Instance,
                 live: list["Pending"], future: asyncio.Future, started_ns: int) -> None:
        self.pool = pool
        self.loop = loop
        self.instance = instance
        self.live = live
        self.future = future
        self.started_ns = started_ns

    def __call__(self, responses: list | None, finish: Callable[[], list] | None) -> None:
        if finish is not None:
            try:
                self.instance.thread.post(self.loop, self._finished, self._finish_on_thread, finish)
                return
            except RuntimeError:        # the instance is closing: finish here
                pass
        try:
            result = self._outcome(responses) if finish is None else self._finish_on_thread(finish)
            error = None
        except BaseException as err:
            result, error = None, err
        self._finished(result, error)

    def _finished(self, result: Any, error: BaseException | None) -> None:
        self.pool.ran(self.future, self.instance, self.live, result, error)

    def _outcome(self, responses: list) -> tuple[list, tuple[int, int, int]]:
        backend = self.instance.backend
        if len(responses) != len(self.live):
            raise Internal(f"{backend.instance.name}: backend returned {len(responses)} "
                           f"responses for {len(self.live)} requests")
        ci, co = backend.io_ns
        return responses, (ci, max(0, time.monotonic_ns() - self.started_ns - ci - co), co)

    def _finish_on_thread(self, finish: Callable[[], list]) -> tuple[list, tuple[int, int, int]]:
        try:
            responses = finish()
        except BaseException as err:
            err.compute_ns = (0, time.monotonic_ns() - self.started_ns, 0)  # type: ignore[attr-defined]
            raise
        return self._outcome(responses)


class InstancePool:
    def __init__(self, instances: list[Instance], stats: "ModelStatistics",
                 rate_limiter: "RateLimiter | None" = None) -> None:
        self.instances = instances
        self.stats = stats
        self.rate_limiter = rate_limiter
        # Free instances, and acquire()s waiting for one, each woken in turn by a release (as
        # asyncio.Queue's getters, whose few calls a batch add up on the loop).
        self._idle: deque[Instance] = deque(instances)
        self._waiters: deque[asyncio.Future] = deque()
        # The dynamic batcher's hook: called (synchronously) whenever an instance is free again.
        self.on_release: Callable[[], Any] | None = None
        # A decoupled model's batches run execute_decoupled with each request's stream as its
        # sender (engine/composition/streaming.py); the futures then only say when execute returned.
        self.decoupled = False
        # Backends whose answers the loop reads itself (start_on_loop): no thread waits for them.
        self._on_loop = all(i.backend.executes_on_loop for i in instances) and bool(instances)
        # ragged_batching "pad" where the backend pads (backends/ragged.py; the python backend
        # hands each request to the model as sent): each batch's padded and real tokens counted
        plan = getattr(instances[0].backend, "ragged", None) if instances else None
        self.padding = plan.padding if plan is not None else None
        if self.padding is not None:
            stats.padding = StatPadding()

    @property
    def size(self) -> int:
        return len(self.instances)

    def idle_count(self) -> int:
        return len(self._idle)

    async def acquire(self) -> Instance:
        while not self._idle:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()        # woken, then cancelled: the next waiter takes it
                raise
        return self._idle.popleft()

    def try_acquire(self) -> Instance | None:
        """A free instance now, or None (the batcher's fast path: no task, no wait)."""
        return self._idle.popleft() if self._idle else None

    def release(self, instance: Instance) -> None:
        self._idle.append(instance)
        if self._waiters:
            self._wake()
        if self.on_release is not None:
            self.on_release()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():       # not cancelled meanwhile
                waiter.set_result(None)
                return

    async def execute(self, instance: Instance, batch: list["Pending"]) -> None:
        """Run ``batch`` on ``instance`` and resolve every future; always releases it."""
        limited = self.rate_limiter is not None and bool(instance.resources)
        try:
            if limited:
                await self.rate_limiter.acquire(instance.resources, instance.rate_priority)
            try:
                await self._execute(instance, batch)
            finally:
                if limited:
                    self.rate_limiter.release(instance.resources)
        finally:
            self.release(instance)

    def run(self, batch: list["Pending"], instance: Instance | None = None) -> asyncio.Future:
        """Run ``batch`` on ``instance`` (taken with ``acquire``/``try_acquire``) or, by
        default, on a free one (there must be one: ``idle_count``). Where no rate limiter is
        involved the batch is handed to the instance's thread now and its results are
        delivered by one callback when the thread is done (no task). The returned future ends
        when every request's future is resolved and the instance released."""
        if instance is None:
            instance = self._idle.popleft()
        if self.rate_limiter is not None and instance.resources:
            return asyncio.ensure_future(self.execute(instance, batch))
        # the requests' loop is the running one, without get_running_loop()'s getpid()
        loop = batch[0].future.get_loop() if batch else asyncio.get_running_loop()
        done = loop.create_future()
        try:
            live = self._begin(batch)
            if not live:
                self.release(instance)
                done.set_result(None)
                return done
            if not self._start_on_loop(loop, instance, live, done):
                instance.thread.post(loop, functools.partial(self.ran, done, instance, live),
                                     *self._job(instance, live))
        except BaseException as err:
            self.release(instance)
            done.set_exception(err)
        return done

    def _start_on_loop(self, loop: asyncio.AbstractEventLoop, instance: Instance, live: list["Pending"],
                       done: asyncio.Future) -> bool:
        """Send ``live`` from the loop where the backend lets the loop read the answer
        (``start_on_loop``: its work runs in another process); its outcome then comes to
        ``ran`` on the loop as the thread's would, with no thread involved."""
        if self.decoupled or not self._on_loop:
            return False
        split = instance.backend.start_on_loop(
            loop, OnLoopBatch(self, loop, instance, live, done, time.monotonic_ns()))
        if split is None:
            return False
        split.send([p.inputs for p in live], [p.request for p in live])
        return True

    def ran(self, done: asyncio.Future, instance: Instance, live: list["Pending"], result: Any,
            error: BaseException | None) -> None:
        """A batch's outcome (results and timing, or the error) from its instance: each
        request's future resolved, then ``done`` ended and the instance free."""
        self._settle(done, instance, self._deliver, instance, live, result, error)

    def launch(self, instance: Instance, batch: list["Pending"]) -> asyncio.Future:
        """``run`` on ``instance`` (the name engine/composition/sequence.py calls)."""
        return self.run(batch, instance)

    def can_hold(self) -> bool:
        """Whether a free instance may be handed a batch before its deadline (``hold``): not
        where a rate limiter must admit it first, nor for a decoupled model, nor where the
        loop sends the batch itself (``start_on_loop``): there the loop's alarm (a timerfd)
        sends it with no hop to hand over, while a held batch costs its thread two wake-ups
        (the hand-over, taken while the loop holds the GIL, and the deadline), which at c=1 cost
        throughput and CPU (benchmarks/results/notes-engine.md)."""
        return (not self.decoupled and not self._on_loop and bool(self._idle)
                and (self.rate_limiter is None or not any(i.resources for i in self.instances)))

    def hold(self, batch: list["Pending"], deadline_ns: int,
             claimed: Callable[[Deferred], Any]) -> Deferred:
        """Hand ``batch`` to a free instance's thread to start at ``deadline_ns`` (see
        ``Deferred``: until then the caller may ``update`` or ``retract`` it). Once the thread
        has started it, ``claimed(deferred)`` is called on the loop (the batcher forgets the
        claimed requests) and their queue time and pending count end
        (``_deferred_started``); once it has run, every request's future is resolved, the
        instance released and ``deferred.done`` ends."""
        instance = self._idle.popleft()
        loop = batch[0].future.get_loop()
        done = loop.create_future()
        deferred = Deferred(batch, deadline_ns, done, functools.partial(self.release, instance))
        ran = functools.partial(self._deferred_ran, instance, deferred, claimed, done)
        try:
            instance.thread.post_deferred(loop, ran, functools.partial(_run_batch, instance.backend),
                                          deferred)
        except BaseException:
            self.release(instance)
            raise
        self._check_later(loop, deferred, claimed)
        return deferred

    def _check_later(self, loop: asyncio.AbstractEventLoop, deferred: Deferred,
                     claimed: Callable[[Deferred], Any]) -> None:
        # Triton ends a request's queue time and pending count as its execution starts. The
        # thread does not tell the loop when it starts (that wake-up, measured, cost more than
        # the hand-over saves): a batch that ran quickly is recorded when its results come,
        # one still running CHECK_S after its deadline is recorded then, by this timer (never
        # armed twice, cancelled when the results come: no wake-up for a quick batch).
        delay = (deferred.deadline_ns - time.monotonic_ns()) / 1e9 + CHECK_S
        deferred.check = loop.call_later(max(delay, CHECK_S), self._check, loop, deferred, claimed)

    def _check(self, loop: asyncio.AbstractEventLoop, deferred: Deferred,
               claimed: Callable[[Deferred], Any]) -> None:
        deferred.check = None
        if deferred.live is not None or deferred._state == Deferred.RETRACTED:
            return
        if deferred._state == Deferred.OPEN:    # its thread is late (busy cores): look again
            deferred.check = loop.call_later(CHECK_S, self._check, loop, deferred, claimed)
            return
        self._deferred_started(deferred, claimed)

    def _deferred_started(self, deferred: Deferred, claimed: Callable[[Deferred], Any]) -> None:
        claimed(deferred)
        ran = deferred.batch
        keep = [i for i, p in enumerate(ran) if not p.future.done()]    # left while held
        self._begin([ran[i] for i in keep], deferred.start_ns)
        deferred.live = keep

    def _deferred_ran(self, instance: Instance, deferred: Deferred, claimed: Callable[[Deferred], Any],
                      done: asyncio.Future, result: Any, error: BaseException | None) -> None:
        self._settle(done, instance, self._deliver_deferred, instance, deferred, claimed, result, error)

    def _deliver_deferred(self, instance: Instance, deferred: Deferred,
                          claimed: Callable[[Deferred], Any], result: Any,
                          error: BaseException | None) -> None:
        if deferred.check is not None:
            deferred.check.cancel()
            deferred.check = None
        if deferred.live is None:
            self._deferred_started(deferred, claimed)
        keep = deferred.live
        ran = deferred.batch
        live = [ran[i] for i in keep]
        if live:
            if error is None and len(live) != len(ran):
                results, timing = result
                result = [results[i] for i in keep], timing
            self._deliver(instance, live, result, error)

    def _settle(self, done: asyncio.Future, instance: Instance, deliver: Callable[..., None],
                *args: Any) -> None:
        """``deliver(*args)``, then ``done`` ends with its outcome and the instance is free."""
        try:
            deliver(*args)
        except BaseException as err:
            done.set_exception(err)
        else:
            done.set_result(None)
        finally:
            self.release(instance)

    def _job(self, instance: Instance, live: list["Pending"]) -> tuple:
        if self.decoupled:
            return (_run_decoupled, instance.backend, [p.inputs for p in live],
                    [p.request for p in live], [p.stream for p in live])
        return _run_backend, instance.backend, [p.inputs for p in live], [p.request for p in live]

    def _begin(self, batch: list["Pending"], start_ns: int = 0) -> list["Pending"]:
        live = [p for p in batch if not p.future.done()]   # cancelled while queued
        if not live:
            return live
        start_ns = start_ns or time.monotonic_ns()
        queued = []
        for p in live:
            # Triton's pending count ends when a backend is about to execute the request.
            p.started = True
            p.start_ns = start_ns
            queued.append(start_ns - p.enqueue_ns)
            if p.request.trace is not None:         # engine/observation/trace.py
                p.request.trace.compute_start(p.enqueue_ns, start_ns, p.batch_size)
        stats = self.stats
        stats.record_queues(queued)
        stats.pending -= len(live)
        return live

    async def _execute(self, instance: Instance, batch: list["Pending"]) -> None:
        live = self._begin(batch)
        if not live:
            return
        job = instance.thread.call(live[0].future.get_loop(), *self._job(instance, live))
        try:
            await asyncio.shield(job)
        finally:
            if job.done():
                self._deliver_job(instance, live, job)
            else:       # cancelled while the thread runs: deliver whatever it brings later
                job.add_done_callback(lambda j: self._deliver_job(instance, live, j))

    def _deliver_job(self, instance: Instance, live: list["Pending"], job: asyncio.Future) -> None:
        if job.cancelled():
            self._deliver(instance, live, None, asyncio.CancelledError())
        else:
            error = job.exception()
            self._deliver(instance, live, job.result() if error is None else None, error)

    def _deliver(self, instance: Instance, live: list["Pending"], outcome: Any,
                 err: BaseException | None) -> None:
        """Resolve each request's future from what the instance thread brought back."""
        if err is None:
            results, timing = outcome
        elif isinstance(err, TritonError):
            results, timing = [err] * len(live), getattr(err, "compute_ns", None)
        elif isinstance(err, Exception):   # a backend bug must fail its requests, not the server
            log.error("instance %s failed", instance.name, exc_info=err)
            results = [Internal(f"{instance.name}: {type(err).__name__}: {err}")] * len(live)
            timing = getattr(err, "compute_ns", None)
        else:
            raise err
        rows = failed = failed_rows = failed_queue_ns = 0
        for p, result in zip(live, results):
            rows += p.batch_size
            if p.request.trace is not None:         # engine/observation/trace.py
                p.request.trace.compute_end(timing)
            if isinstance(result, BaseException):
                failed += 1
                failed_rows += p.batch_size
                failed_queue_ns += p.start_ns - p.enqueue_ns
                if not p.future.done():
                    p.future.set_exception(mark_failure(result, "BACKEND"))
            elif not p.future.done():
                p.future.set_result(result)
        if timing is not None:
            # Triton: a failed request counts in execution_count, not in inference_count
            self.stats.record_execution(rows, len(live), *timing,
                                        failed_rows, failed, failed_queue_ns)
            if self.padding is not None:
                self.stats.record_padding(*self.padding.tokens([p.inputs for p in live]))

    def close(self) -> None:
        for inst in self.instances:
            try:
                inst.close()
            except Exception:
                log.exception("unloading instance %s", inst.name)


def execute(backend: Backend, inputs: list[Tensors], requests: list | None = None
            ) -> tuple[list[Tensors | TritonError], tuple[int, int]]:
    """One batch on ``backend``, on the calling thread: per request, its outputs or the
    TritonError that fails only it; and the batch's (compute_input, compute_output)
    nanoseconds. A ``TensorBackend`` runs the requests merged; any other backend is handed them
    (``Backend.execute``, which tells its own copies in ``io_ns``)."""
    if isinstance(backend, TensorBackend):
        return _run_tensors(backend, inputs)
    results = backend.execute(inputs, requests)
    return results, backend.io_ns


def _run_tensors(backend: TensorBackend, inputs: list[Tensors]
                 ) -> tuple[list[Tensors | TritonError], tuple[int, int]]:
    ragged = backend.ragged
    if ragged is not None:
        try:
            return _run_merged(backend, inputs, ragged.merge, ragged.split)
        except (InvalidArgument, Internal):
            if len(inputs) == 1:
                raise
            # Requests of different shapes: one the model fails on alone (inputs that
            # disagree in length, too long for the model) fails the batch it was merged
            # into; each runs alone, so that only its own answer is the error.
            return _each_alone(backend, inputs, ragged)
    if len(inputs) > 1 and backend.config.max_batch_size > 0:
        return _run_merged(backend, inputs, concatenate,
                           functools.partial(split_rows, backend.files.model_name))
    results, copy_in, copy_out = [], 0, 0
    for request in inputs:      # one request, or a model without a batch dimension
        backend.io_ns = (0, 0)
        results.append(backend.run(request))
        copy_in, copy_out = copy_in + backend.io_ns[0], copy_out + backend.io_ns[1]
    return results, (copy_in, copy_out)


def _run_merged(backend: TensorBackend, inputs: list[Tensors],
                merge: Callable[[list[Tensors]], tuple[Tensors, Any]],
                split: Callable[[Tensors, Any], list[Tensors]]
                ) -> tuple[list[Tensors | TritonError], tuple[int, int]]:
    # The merge and the split are the batch's compute_input and compute_output, with the
    # copies ``run`` makes itself (``io_ns``).
    t0 = time.monotonic_ns()
    merged, layout = merge(inputs)
    t1 = time.monotonic_ns()
    backend.io_ns = (0, 0)
    outputs = backend.run(merged)
    t2 = time.monotonic_ns()
    parts = split(outputs, layout)
    run_in, run_out = backend.io_ns
    return parts, (t1 - t0 + run_in, time.monotonic_ns() - t2 + run_out)


def _each_alone(backend: TensorBackend, inputs: list[Tensors], ragged: RaggedPlan
                ) -> tuple[list[Tensors | TritonError], tuple[int, int]]:
    results: list[Tensors | TritonError] = []
    copy_in = copy_out = 0
    for request in inputs:
        try:
            [result], (ci, co) = _run_merged(backend, [request], ragged.merge, ragged.split)
        except (InvalidArgument, Internal) as err:
            result, ci, co = err, 0, 0
        results.append(result)
        copy_in, copy_out = copy_in + ci, copy_out + co
    return results, (copy_in, copy_out)


def _run_backend(backend: Backend, inputs: list[dict], requests: list) -> tuple[list, tuple[int, int, int]]:
    # Triton's compute_input/output cover the tensor copies in and out around the model
    # (``execute``); the rest of the call is compute_infer.
    t0 = time.monotonic_ns()
    executing.requests = requests       # a BLS call made by this execute nests one deeper
    try:
        results, (ci, co) = execute(backend, inputs, requests)
    except BaseException as err:
        # a failed execution still counts in execution_count and batch_stats (Triton)
        err.compute_ns = (0, time.monotonic_ns() - t0, 0)  # type: ignore[attr-defined]
        raise
    finally:
        executing.requests = None
    t1 = time.monotonic_ns()
    if len(results) != len(inputs):
        raise Internal(f"{backend.instance.name}: backend returned {len(results)} responses "
                       f"for {len(inputs)} requests")
    return results, (ci, max(0, t1 - t0 - ci - co), co)


def _run_batch(backend: Backend, batch: list["Pending"]) -> tuple[list, tuple[int, int, int]]:
    return _run_backend(backend, [p.inputs for p in batch], [p.request for p in batch])


def _run_decoupled(backend: Backend, inputs: list[dict], requests: list,
                   streams: list) -> tuple[list, tuple[int, int, int]]:
    # The instance is busy only while execute_decoupled runs; responses may come later.
    t0 = time.monotonic_ns()
    for stream in streams:
        stream.compute_started(t0)
    executing.requests = requests
    try:
        backend.execute_decoupled(inputs, requests, streams)
    finally:
        executing.requests = None
    ci, co = backend.io_ns          # the copies in and out, where the backend tells them apart
    return [None] * len(inputs), (ci, max(0, time.monotonic_ns() - t0 - ci - co), co)
