"""A model instance's worker process, the server's end of it (the worker's end is
``worker_main``, what they say to each other is ``messages``, how the process starts is
``launch``).

``WorkerProcess`` is the server's handle: tensors travel through two shared-memory regions
(inputs, outputs) that live as long as the worker and grow when a batch does not fit; a
small header travels through a socket. One batch costs one write and one read on each side,
and nothing polls: the server blocks in ``poll`` on the socket and the process's pidfd
together, so a worker that dies (segfault, ``os._exit``, the OOM killer) is noticed at once,
and a worker past its deadline is killed.

On the server, a non-decoupled batch is usually split in two (``watch``): the event loop
sends it and reads the answer itself (``LoopWatch``: readers on the socket and the pidfd, registered once
per worker), so no thread waits for the worker and nothing hops back to the loop. Where that
cannot be done without waiting (a restart's ``initialize``, a region to replace, unload), a
thread runs ``execute``: it reads until the batch is done and hands side messages on. A
decoupled model's worker has a reader thread of its own, because its responses come after
execute has returned (``decoupled.DecoupledWorker``). Regions lent for one message are
``loans``; the worker's stdout and stderr, ``worker_logs``.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import select
import signal
import socket
import threading
import time
import weakref
from typing import Any, Callable

from ...model_logs import ModelLogs
from . import launch
from .envs import PackedEnv
from .loans import Loans
from .messages import (SIDE, BlsCall, Channel, Execute, Failed, Finalize, Grow, LoanAsk, LoanDone,
                       LoanReply, OutputRegion, ProtocolError, Release, Results)
from .shm import SharedMemoryFull, ShmRegion, stage_into, sweep_once
from .stub import RequestData, ResponseError, StubError
from .worker_logs import read_output

log = logging.getLogger(__name__)


class WorkerDied(Exception):
    def __init__(self, exitcode: int | None, refused: str | None = None) -> None:
        super().__init__(f"worker died (exit code {exitcode})" if refused is None
                         else f"worker killed: {refused}")
        self.exitcode = exitcode
        #: why the server killed it, when it sent what the protocol does not carry
        self.refused = refused


class WorkerTimeout(Exception):
    """The worker did not answer within its bound; it has been killed."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} did not finish within {seconds:g} s")
        self.what = what
        self.seconds = seconds


def unexpected(msg: Any) -> StubError:
    """``Failed``'s error, or a StubError naming what a confused worker sent."""
    if type(msg) is Failed:
        return StubError(*msg.error)
    return StubError("execute", f"the python worker answered {type(msg).__name__}")


def filled(chan: Channel, events: list) -> bool:
    """After a poll on a worker's socket and pidfd: True when the socket gave more bytes,
    False when the worker is gone (only the pidfd fired: a child it forked may still hold
    the socket open, so end-of-file alone is not to be waited for)."""
    if any(fd == chan.fd for fd, _ in events):
        try:
            return chan.fill()
        except OSError:
            pass
    return False


def how_it_ended(err: WorkerDied) -> str:
    """"died (exit code ...)", or why the server killed it."""
    if err.refused is not None:
        return f"was killed for a message the protocol does not carry ({err.refused})"
    return f"died ({describe_exit(err.exitcode)})"


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        hint = "; the system may have run out of memory" if sig == "SIGKILL" else ""
        return f"exit code {exitcode}, {sig}{hint}"
    return f"exit code {exitcode}"


_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Workers are not our children (the template's): end them before the interpreter goes.
    workers = list(_LIVE)
    for worker in workers:
        worker.hang_up()   # every idle worker sees end-of-file and leaves at once
    for worker in workers:
        worker.close()


class WorkerProcess:
    """The server's handle on one worker process and the two regions it reads and writes."""

    def __init__(self, model_py: str, args: dict[str, str], label: str,
                 side: Callable[["WorkerProcess", Any], None] | None = None, blas_threads: int = 0,
                 env: PackedEnv | None = None, poll_us: int = 0,
                 logs: ModelLogs | None = None) -> None:
        self.model_py = model_py
        self.args = args
        self.label = label
        self.blas_threads = blas_threads
        #: how long the worker polls for its next batch after a batch of one (busy polling)
        self.poll_us = poll_us
        #: the model's packed environment (EXECUTION_ENV_PATH), else forked from the template
        self.env = env
        #: where its output's lines are kept (the engine's); None: the server's streams only
        self.logs = logs if logs is not None else ModelLogs(max_lines=0)
        self.ready = False
        #: why open decoupled requests are failed when the worker ends: (kind, message),
        #: set by whoever kills it on purpose before the kill
        self.end_reason: tuple[str, str] | None = None
        self._side = side
        self._sock: socket.socket | None = None
        self._chan: Channel | None = None
        self._poll: Any = None
        self._process: Any = None
        self._in: ShmRegion | None = None
        self._out: ShmRegion | None = None
        self._send_lock = threading.Lock()
        # Decoupled models only (``DecoupledWorker``): a reader thread owns the socket once
        # the worker is ready.
        self._reader: threading.Thread | None = None
        self._logs: threading.Thread | None = None
        #: regions lent for tensors that travel with a message (BLS, decoupled responses)
        self.loans = Loans(label)
        self._closed = False
        #: set when it sent what the protocol does not carry (it was killed for it)
        self.refused: str | None = None
        self._watch: LoopWatch | None = None    # the event loop reading it (watch)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> "WorkerProcess":
        """Start the process; ``wait_ready`` waits for ``initialize`` to finish."""
        sweep_once()
        self._sock, out_r, err_r, self._process = launch.start(
            "serve", self.model_py, self.args, self.blas_threads, self.env, self.poll_us)
        self._logs = threading.Thread(
            target=read_output, args=(self.logs, self.label, self.args.get("model_name", ""),
                                       self.args.get("model_version", ""), out_r, err_r),
            daemon=True, name=f"triton-python-output-{self.label}")
        self._logs.start()
        self._chan = Channel(self._sock.fileno())
        self._poll = select.poll()
        self._poll.register(self._chan.fd, select.POLLIN)
        self._poll.register(self._process.sentinel, select.POLLIN)
        _LIVE.add(self)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Raises ``StubError`` (initialize failed), ``WorkerDied`` or ``WorkerTimeout``."""
        msg = self._recv("initialize", timeout)
        if type(msg) is Failed:
            raise StubError(*msg.error)
        self.ready = True

    def _stage_inputs(self, requests: list[RequestData], all_outputs: list[str] | None) -> list:
        staged, end, metas = self._plan_inputs(requests, all_outputs)
        if staged and (self._in is None or self._in.size < end):
            self._grow("_in", end)
        if staged:
            self._in.write(staged)
        return metas

    @staticmethod
    def _plan_inputs(requests: list[RequestData], all_outputs: list[str] | None) -> tuple[list, int, list]:
        """(tensors to stage, bytes they need in the input region, each request's meta)."""
        staged: list = []
        end, metas = 0, []
        for req in requests:
            refs, end = stage_into(staged, req.inputs, end)
            names = None if all_outputs is not None and req.requested_output_names == all_outputs \
                else req.requested_output_names
            if not req.request_id and not req.correlation_id and req.parameters == "{}" \
                    and names is None and not req.flags:
                metas.append(refs)
            else:
                metas.append((refs, req.request_id, req.correlation_id, req.parameters, names, req.flags))
        return staged, end, metas

    def execute(self, requests: list[RequestData], timeout: float | None = None,
                all_outputs: list[str] | None = None) -> list[dict | ResponseError]:
        """Run one batch. Raises ``StubError`` when execute raised, ``WorkerDied`` on death,
        ``WorkerTimeout`` past ``timeout`` seconds (the worker is killed), and
        ``SharedMemoryFull`` when the batch does not fit in /dev/shm (the worker lives on)."""
        metas = self._stage_inputs(requests, all_outputs)
        if self._out is None:
            self._grow("_out", 0)
        deadline = None if not timeout else time.monotonic() + timeout
        self._send(Execute(self._in.name if self._in is not None else "", self._out.name, metas))
        msg = self._recv("execute", timeout, deadline)
        if type(msg) is Grow:
            self._grow_output(msg.nbytes)
            msg = self._recv("execute", timeout, deadline)
        return self._results(msg)

    def _grow_output(self, nbytes: int) -> None:
        """Answer ``Grow``: a bigger output region, or ``SharedMemoryFull`` (the worker is told
        there is no room and fails nothing more: the batch is the server's to fail)."""
        self._out.close()   # its content is not needed: free its pages before asking for more
        self._out = None
        try:
            self._out = ShmRegion.create(nbytes)
        except SharedMemoryFull:
            self._send(OutputRegion(None))
            raise
        self._send(OutputRegion(self._out.name))

    def _results(self, msg: Any) -> list[dict | ResponseError]:
        if type(msg) is not Results:
            raise unexpected(msg)
        items = msg.items
        groups = [item for item in items if type(item) is list]
        tensors = self._out.read_many(groups)
        if len(groups) == len(items):   # the usual case: no request failed
            return tensors
        taken = iter(tensors)
        return [next(taken) if type(item) is list else ResponseError(*item) for item in items]

    def watch(self, loop: asyncio.AbstractEventLoop, done: Callable[[Any, BaseException | None], None],
              timeout: float | None = None) -> "LoopWatch | None":
        """``execute`` in two halves, neither of which blocks: ``loop`` reads this worker's
        socket and pidfd itself (``LoopWatch``, kept between batches), and ``LoopWatch.send``
        sends the batch whose answer ``done(outputs, error)`` then brings on ``loop``: what
        ``execute`` returns or raises (``NeedsThread``: nothing was sent, ``execute`` on a
        thread must do it). ``timeout`` counts from now. Call on ``loop``'s thread. None where
        the loop cannot read (not ready yet, a decoupled worker's reader owns the socket,
        closed)."""
        if not self.ready or self._reader is not None or self._closed or self._process is None:
            return None
        watch = self._watch
        if watch is None or watch.loop is not loop:
            if watch is not None:
                watch.detach()
            watch = self._watch = LoopWatch(self, loop)
        elif not watch.attached:
            if not self._process.is_alive():
                return None
            watch.attach()
        watch.begin(done, timeout)
        return watch

    def _unwatch(self) -> None:
        """Stop the loop reading this worker before a thread does (unload, close)."""
        watch = self._watch
        if watch is None or not watch.attached:
            return
        loop = watch.loop
        if threading.get_ident() == watch.thread or not loop.is_running():
            watch.detach()
            return
        detached = threading.Event()
        try:
            loop.call_soon_threadsafe(lambda: (watch.detach(), detached.set()))
        except RuntimeError:
            return                  # the loop has closed: its readers went with it
        detached.wait(2.0)

    @property
    def closed(self) -> bool:
        """Closed, or its process has ended."""
        process = self._process
        return self._closed or process is None or not process.is_alive()

    def _side_message(self, msg: Any) -> None:
        kind = type(msg)
        if kind is LoanAsk:     # the worker wants a region for tensors it is about to send
            self._send(LoanReply(msg.call_id, self.loans.lend(msg.nbytes)))
            return
        if kind is LoanDone:
            self.loans.returned(msg.region)
            return
        if kind is BlsCall and type(msg.spec[2]) is tuple:
            spec = list(msg.spec)
            spec[2] = self.loans.take(spec[2])
            msg = msg._replace(spec=tuple(spec))
        if self._side is not None:
            try:
                self._side(self, msg)
            except Exception:
                log.exception("python worker %s: side message %s failed", self.label, kind.__name__)

    def _grow(self, attr: str, nbytes: int) -> None:
        old = getattr(self, attr)
        if old is not None:
            setattr(self, attr, None)
            old.close()   # unlinks the name; the worker's mapping lives until it lets go
        try:
            setattr(self, attr, ShmRegion.create(nbytes))
            return
        except SharedMemoryFull:
            if old is None:
                raise
        # The worker still maps the old region, whose pages count until it lets go of them.
        self._send(Release())
        self._recv("release")
        setattr(self, attr, ShmRegion.create(nbytes))

    def _send(self, msg: Any) -> None:
        try:
            with self._send_lock:
                self._chan.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise WorkerDied(self._reap(), self.refused) from None

    def send_side(self, msg: Any) -> None:
        """An answer to a side message (BLS), from any thread; a dead worker is not an error."""
        try:
            self._send(msg)
        except WorkerDied:
            pass

    def _recv(self, what: str, timeout: float | None = None, deadline: float | None = None) -> Any:
        """The next message; ``WorkerTimeout`` (after killing the worker) past ``deadline``
        (or ``timeout`` seconds from now), ``WorkerDied`` when the worker goes."""
        if deadline is None and timeout:
            deadline = time.monotonic() + timeout
        chan = self._chan
        while True:
            try:
                msg = chan.take()
            except ProtocolError as err:
                raise self.refuse(err) from None
            if msg is not None:
                if type(msg) in SIDE:
                    self._side_message(msg)
                    continue
                return msg
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            events = self._poll.poll(wait_ms)
            if not events:
                if time.monotonic() >= deadline:
                    self.kill()
                    self._reap()
                    raise WorkerTimeout(what, timeout or 0)
                continue
            if not filled(chan, events):
                raise WorkerDied(self._reap(), self.refused)

    def refuse(self, err: ProtocolError) -> WorkerDied:
        """A message the protocol does not carry: the model wrote on the socket, and what
        comes after it cannot be trusted to be an answer. Kill the worker; its batch fails as
        one whose worker died (and it is restarted, or given up on)."""
        self.refused = str(err)
        died = WorkerDied(None, self.refused)
        if self.end_reason is None:
            self.end_reason = ("died", f"the python worker {how_it_ended(died)}")
        log.error("python worker %s: %s; killing it", self.label, err)
        self.kill()
        died.exitcode = self._reap()
        return died

    def kill(self) -> None:
        """SIGKILL now; safe from another thread while a batch waits on this worker."""
        process = self._process
        if process is not None:
            process.kill()

    def hang_up(self) -> None:
        if self._reader is not None and self._reader.is_alive() and self._chan is not None:
            # The reader polls this fd: shut the socket down (the worker sees end-of-file)
            # and let close() release the fd once the reader has left.
            try:
                with socket.socket(fileno=os.dup(self._chan.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _reap(self) -> int | None:
        if self._process is None:
            return None
        self._process.join(5)
        if self._process.is_alive():   # closed its socket but lives on: not ours to trust
            self._process.kill()
            self._process.join(5)
        return self._process.exitcode

    def stop(self, timeout: float = 5.0) -> StubError | None:
        """Run ``finalize`` (bounded by ``timeout``), then end the process and free its regions."""
        error = None
        grace = 2.0
        self._unwatch()
        if self.end_reason is None:
            self.end_reason = ("closed", "the model instance was unloaded")
        try:
            if self.ready and self._process is not None and self._process.is_alive():
                self._send(Finalize())
                msg = self._recv("finalize", timeout)
                if type(msg) is Failed:
                    error = StubError(*msg.error)
        except WorkerTimeout:
            log.warning("python worker %s: finalize did not return within %g s; killed it",
                        self.label, timeout)
            grace = 0
        except WorkerDied:
            pass
        finally:
            self.close(grace)
        return error

    def close(self, grace: float = 2.0) -> None:
        """End the process (end-of-file, then SIGKILL after ``grace`` s) and unlink both
        regions. Idempotent."""
        self._unwatch()
        self.hang_up()
        if self._process is not None:
            if grace > 0:
                self._process.join(grace)
            if self._process.is_alive():
                if self.end_reason is None:
                    self.end_reason = ("closed", "the model instance was unloaded")
                self._process.kill()
                self._process.join(5)
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None
            self.hang_up()
        if self._logs is not None:
            # its last lines (finalize's prints) reach the log before unload returns; a child
            # process of the model that keeps the pipe open is not waited for long
            self._logs.join(2)
            self._logs = None
        self._process = None
        for attr in ("_in", "_out"):
            region = getattr(self, attr)
            if region is not None:
                region.close()
                setattr(self, attr, None)
        self._closed = True
        self.loans.close()
        _LIVE.discard(self)


def _ready_now(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class NeedsThread(Exception):
    """The batch needs a round trip with the worker before it can be sent (a region to
    create, or to replace while /dev/shm is full): ``execute`` on a thread does that."""


class LoopWatch:
    """A worker's socket and pidfd read on the event loop (``WorkerProcess.watch``): what
    ``_recv`` does on a thread, as callbacks, registered once and kept between batches (a
    reader added and removed per batch is a cost the loop would pay on every batch). Side messages are answered as
    they come (a BLS call goes to its pool, never runs here); ``Grow`` gets its region; the
    pidfd says the worker died; one timer, re-armed only when it fires, kills a worker past
    its bound. A batch's ``done`` is called once, on the loop, which also sends the batch
    (``send``, right after ``begin``: no death can come between them). After a failure the
    loop lets go of the worker (``detach``): a thread restarts it or runs the batch."""

    __slots__ = ("worker", "loop", "thread", "attached", "done", "timeout", "deadline", "timer",
                 "expired", "fds")

    def __init__(self, worker: WorkerProcess, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        self.thread = threading.get_ident()
        self.done: Callable[[Any, BaseException | None], None] | None = None
        self.timeout: float | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False
        self.fds = (worker._chan.fd, worker._process.sentinel)
        self.attached = False
        self.attach()

    def attach(self) -> None:
        self.loop.add_reader(self.fds[0], self._readable)
        self.loop.add_reader(self.fds[1], self._exited)
        self.attached = True

    def detach(self) -> None:
        if self.attached:
            self.attached = False
            for fd in self.fds:
                self.loop.remove_reader(fd)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def begin(self, done: Callable[[Any, BaseException | None], None], timeout: float | None) -> None:
        """On the loop: the next batch's answer goes to ``done``."""
        self.done = done
        self.expired = False
        self.timeout = timeout
        if timeout:
            self.deadline = time.monotonic() + timeout
            if self.timer is None:
                self.timer = self.loop.call_later(timeout, self._check_deadline)

    def send(self, requests: list[RequestData], all_outputs: list[str] | None) -> None:
        """Stage the batch and send it; never waits for the worker and never raises: what
        goes wrong ends the batch."""
        worker = self.worker
        try:
            if worker._out is None:
                worker._grow("_out", 0)     # a first region: created, no round trip
            staged, end, metas = worker._plan_inputs(requests, all_outputs)
            if staged:
                if worker._in is None:
                    worker._grow("_in", end)
                elif worker._in.size < end:
                    # replacing it may need the worker to let go of the old one first
                    raise NeedsThread("the input region must grow")
                worker._in.write(staged)
            msg = Execute(worker._in.name if worker._in is not None else "", worker._out.name, metas)
        except Exception as err:
            self._end(None, err)
            return
        try:
            worker._send(msg)
        except WorkerDied:
            pass                    # its pidfd, watched, ends the batch

    def _readable(self) -> None:
        try:
            if not self.worker._chan.fill():
                # end-of-file: the worker is going; its pidfd says when it has gone
                self.loop.remove_reader(self.fds[0])
                return
        except OSError:
            self.loop.remove_reader(self.fds[0])
            return
        self._take()

    def _take(self) -> bool:
        """Handle every whole message read; True once the batch has ended."""
        worker = self.worker
        chan = worker._chan
        try:
            while True:
                msg = chan.take()
                if msg is None:
                    return False
                kind = type(msg)
                if kind in SIDE:
                    worker._side_message(msg)
                elif self.done is None:
                    log.error("python worker %s: %s while no batch runs", worker.label, kind.__name__)
                elif kind is Grow:
                    worker._grow_output(msg.nbytes)
                else:
                    self._end(worker._results(msg), None)
                    return True
        except ProtocolError as err:
            self._end(None, worker.refuse(err))
        except Exception as err:     # StubError (Failed), SharedMemoryFull, a confused worker
            self._end(None, err)
        return True

    def _exited(self) -> None:
        worker = self.worker
        # the answer may have come just before the end (a model that exits after returning)
        try:
            while self.done is not None and _ready_now(self.fds[0]) and worker._chan.fill():
                if self._take():
                    return
        except OSError:
            pass
        if self.done is None:       # died between batches: the next one finds out on a thread
            self.detach()
            return
        exitcode = worker._reap()
        if self.expired:
            self._end(None, WorkerTimeout("execute", self.timeout or 0))
        else:
            self._end(None, WorkerDied(exitcode))

    def _check_deadline(self) -> None:
        self.timer = None
        if self.done is None or not self.timeout:
            return                  # armed again by the next batch
        left = self.deadline - time.monotonic()
        if left > 0:
            self.timer = self.loop.call_later(left, self._check_deadline)
            return
        self.expired = True
        self.worker.kill()          # its pidfd fires next: _exited reports the timeout

    def _end(self, outputs: Any, error: BaseException | None) -> None:
        done, self.done = self.done, None
        if done is None:
            return
        if error is not None and not isinstance(error, (StubError, SharedMemoryFull)):
            self.detach()           # a thread takes the worker over (restart, region set-up)
        done(outputs, error)
