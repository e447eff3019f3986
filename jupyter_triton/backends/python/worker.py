"""A model instance's worker process, both ends of it.

``worker_main`` runs in the child (spawned, never forked: the server is threaded) and
serves one ``ModelStub``. ``WorkerProcess`` is the server's handle: tensors travel through
two shared-memory regions (inputs, outputs) that live as long as the worker and grow when a
batch does not fit; a small header travels through a socket. One batch costs one write and
one read on each side, and nothing polls: the server blocks in ``poll`` on the socket and the
process sentinel together, so a worker that dies (segfault, ``os._exit``, the OOM killer) is
noticed at once, and a worker past its deadline is killed.

A worker dies with its server: it asks the kernel for SIGKILL when its parent goes
(``PR_SET_PDEATHSIG`` on Linux, armed from a spawner thread that lives as long as the server,
because the kernel ties that signal to the thread that started the child), and it leaves its
loop when the socket reports end-of-file.

Wire format: a 4-byte little-endian length, then a pickle of a tuple of plain values (no
classes: they cost several times more to pickle). A tensor is (name, dtype, shape, offset,
nbytes) in a region.
    server -> worker  ("x", in_region, out_region, [meta])   one batch; meta is a list of tensors,
                      or (tensors, id, correlation id, parameters, output names, flags)
                      ("o", region | None)   the bigger output region asked for (None: no room)
                      ("r",)   release every mapped region     ("f",)   finalize and leave
                      ("xd", in_region, [meta], [key])   a decoupled model's batch
                      ("cr", id, cancelled)   ("br", id, ...)   answers to the worker's questions
    worker -> server  ("ready", pid)  ("error", StubError tuple)  ("res", [tensors | (code, msg)])
                      ("grow", nbytes)  ("r",)  ("done",)  ("xdone",)   a decoupled execute returned
                      ("d", key, {name: array} | None, (code, msg) | None, final)   one response
                      ("cq", id, key)   is request ``key`` cancelled?   ("b", id, ...) a BLS call
                      ("m", ...)   a custom-metric operation

Either side may send at any time. The worker's socket is read by whichever of its threads
waits (``_Demux``). On the server, the thread that runs a batch reads until the batch is done
and hands side messages on (the non-decoupled path: no thread hand-off per batch); a decoupled
model's worker has a reader thread of its own, because its responses come after execute has
returned. Decoupled responses and BLS calls carry small tensors inside the message and large
ones (``SHM_MESSAGE_BYTES``) in a region lent for that message: ("a", id, nbytes) -> ("ar", id,
name) when the worker sends, ("af", name) once the worker has read what the server sent. The
server creates and unlinks every region, so a worker that dies leaks nothing.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import ctypes
import json
import logging
import multiprocessing
import os
import pickle
import queue
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable

from ...model_logs import LOGS
from .shm import SharedMemoryFull, ShmRegion, stage, sweep_once
from . import triton_python_backend_utils as pb_utils
from .stub import (ModelStub, OrphanCloser, RequestData, ResponseError, StubError, bls_response, bls_spec,
                   run_auto_complete_config)

log = logging.getLogger(__name__)

_CONTEXT = multiprocessing.get_context("spawn")
_LEN = struct.Struct("<I")
_READ_CHUNK = 1 << 16
PR_SET_PDEATHSIG = 1


class WorkerDied(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"worker died (exit code {exitcode})")
        self.exitcode = exitcode


class WorkerTimeout(Exception):
    """The worker did not answer within its bound; it has been killed."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} did not finish within {seconds:g} s")
        self.what = what
        self.seconds = seconds


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


# ----------------------------------------------------------------------------- the wire

class Channel:
    """Length-prefixed pickles over one socket, with raw ``os.read``/``os.write`` (no
    ``multiprocessing.Connection`` layers, no selector built per wait)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=5)
        frame = memoryview(_LEN.pack(len(data)) + data)
        while frame:
            frame = frame[os.write(self.fd, frame):]

    def take(self) -> Any:
        """The next whole message already read, or ``None``."""
        buf = self._buf
        if len(buf) < 4:
            return None
        end = 4 + _LEN.unpack_from(buf)[0]
        if len(buf) < end:
            return None
        msg = pickle.loads(bytes(buf[4:end]))
        del buf[:end]
        return msg

    def fill(self) -> bool:
        """One read; False at end-of-file."""
        need = 4 + _LEN.unpack_from(self._buf)[0] - len(self._buf) if len(self._buf) >= 4 else 0
        chunk = os.read(self.fd, max(_READ_CHUNK, need))
        if not chunk:
            return False
        self._buf += chunk
        return True

    def recv(self) -> Any:
        """Blocking; ``EOFError`` when the other end is gone."""
        while True:
            msg = self.take()
            if msg is not None:
                return msg
            if not self.fill():
                raise EOFError


# ----------------------------------------------------------------------------- child side

def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:   # the server went before the signal was armed
        os._exit(0)


def worker_main(conn: Connection, job: str, model_py: str, payload: Any,
                log_pipes: tuple[Connection, Connection] | None = None, blas_threads: int = 0,
                parent_pid: int = 0) -> None:
    """Entry point of the child. ``job`` is "serve" (payload: Triton's args) or
    "auto_complete" (payload: (module name, config JSON)). ``log_pipes``: where fds 1 and 2
    go (the server reads them: the model's prints become its log lines). ``blas_threads``:
    threads for BLAS (numpy's OpenBLAS, MKL) before the model is imported; 0 leaves them."""
    if log_pipes is not None:
        for fd, pipe in zip((1, 2), log_pipes):
            os.dup2(pipe.fileno(), fd)
            pipe.close()
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)   # a pipe is block-buffered otherwise
    if parent_pid:
        _die_with_parent(parent_pid)
    if blas_threads:
        from . import blas
        blas.set_threads(blas_threads)
    # Ctrl-C in the server's terminal reaches the whole process group; the server decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [python backend worker %(process)d] %(levelname)s %(message)s")
    chan = Channel(conn.fileno())
    if job == "auto_complete":
        try:
            chan.send(("ok", run_auto_complete_config(model_py, *payload)))
        except StubError as err:
            chan.send(("error", err.to_tuple()))
        return
    demux = _Demux(chan)
    host = _WorkerHost(demux, _is_decoupled(payload))
    pb_utils._default_bls_host = host   # one model per worker: every thread of it calls here
    host.server_reading = True          # the server waits for "ready": it answers calls
    try:
        stub = ModelStub(model_py, payload)
    except StubError as err:
        demux.send(("error", err.to_tuple()))
        return
    host.server_reading = host.decoupled
    demux.send(("ready", os.getpid()))
    regions: dict[str, ShmRegion] = {}
    try:
        _serve(demux, host, stub, regions, _output_names(payload))
    finally:
        for region in regions.values():
            region.close()
        conn.close()


def _is_decoupled(args: dict[str, str]) -> bool:
    try:
        return bool(json.loads(args["model_config"]).get("model_transaction_policy", {}).get("decoupled"))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def _output_names(args: dict[str, str]) -> list[str]:
    try:
        return [o["name"] for o in json.loads(args["model_config"]).get("output", [])]
    except (KeyError, TypeError, ValueError):
        return []


def _region(regions: dict[str, ShmRegion], name: str) -> ShmRegion:
    region = regions.get(name)
    if region is None:
        region = regions[name] = ShmRegion.attach(name)
    return region


class _Demux:
    """The worker's end of the socket, shared by the main loop (batches) and the model's own
    threads (decoupled responses, cancellation queries, BLS calls): whoever waits reads, one
    at a time, and hands what it reads to its waiter. The main loop reads while idle, so a
    batch costs no thread hand-off."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self._cond = threading.Condition()
        self._reading = False
        self._eof = False
        self._commands: collections.deque = collections.deque()
        self._replies: dict[Any, Any] = {}
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.abandoned: set[int] = set()
        self._waiters = 0
        self.closer = OrphanCloser(self._abandon)

    def _abandon(self, call_id: int) -> None:
        self.abandon(call_id)
        self.send(("bx", call_id))

    def send(self, msg: Any) -> None:
        with self._send_lock:
            self.chan.send(msg)

    def new_id(self) -> int:
        return next(self._ids)

    def abandon(self, call_id: int) -> None:
        """A BLS stream the model stopped reading: drop what came and what comes."""
        with self._cond:
            self.abandoned.add(call_id)
            for key in [k for k in self._replies if type(k) is tuple and k[0] == call_id]:
                msg = self._replies.pop(key)
                self._free(msg)
                if msg[4]:
                    self.abandoned.discard(call_id)

    def _free(self, msg: Any) -> None:
        """A dropped BLS answer whose tensors came in a lent region: give the region back."""
        if type(msg[2]) is tuple:
            self.send(("af", msg[2][1]))

    def _wait(self, ready: Callable[[], Any]) -> None:
        cond = self._cond
        with cond:
            while not ready():
                if self._eof:
                    raise EOFError
                if self._reading:
                    self._waiters += 1
                    try:
                        cond.wait()
                    finally:
                        self._waiters -= 1
                    continue
                self._reading = True
                cond.release()
                try:
                    msg = self.chan.recv()
                except (EOFError, OSError):
                    msg = None
                finally:
                    cond.acquire()
                    self._reading = False
                if msg is None:
                    self._eof = True
                elif msg[0] in _REPLIES:
                    key = "o" if msg[0] == "o" else msg[1]
                    if type(key) is tuple and key[0] in self.abandoned:
                        self._free(msg)
                        if msg[4]:   # a BLS stream nobody reads any more: drop it to its end
                            self.abandoned.discard(key[0])
                    else:
                        self._replies[key] = msg
                else:
                    self._commands.append(msg)
                if self._waiters or self._eof:   # the main loop alone (a plain model): no one to wake
                    cond.notify_all()

    def command(self) -> Any:
        """The next batch / release / finalize message; ``EOFError`` when the server is gone."""
        commands = self._commands
        if not commands:
            self._wait(commands.__len__)
        return commands.popleft()

    def reply(self, key: Any) -> Any:
        replies = self._replies
        self._wait(lambda: key in replies)
        return replies.pop(key)

    def call(self, kind: str, *args: Any) -> Any:
        """Ask the server and wait for its answer (``(kind, id, answer...)``)."""
        call_id = next(self._ids)
        self.send((kind, call_id, *args))
        return self.reply(call_id)


# Server -> worker messages that answer a waiter rather than start work.
_REPLIES = frozenset({"o", "cr", "br", "mr", "ar"})

#: tensors of one message past this size travel in a shared-memory region, not the socket
SHM_MESSAGE_BYTES = 1 << 20


def _payload_bytes(tensors: dict) -> int:
    return sum(a.nbytes if a.dtype.kind != "O" else 64 * a.size for a in tensors.values())


class _WorkerHost:
    """A decoupled model's responses and questions, over the worker's socket. Response
    tensors travel inside the message: they leave at any time, where the output region is
    a batch's."""

    def __init__(self, demux: _Demux, decoupled: bool = False) -> None:
        self.demux = demux
        self.decoupled = decoupled
        #: whether the server reads this socket now: always for a decoupled model (a reader
        #: thread), else only while initialize or a batch runs (the waiting thread reads)
        self.server_reading = decoupled
        self._orphans = OrphanCloser(lambda key: demux.send(("d", key, None, None, True)))

    def _answerable(self, what: str) -> None:
        if not self.server_reading:
            raise pb_utils.TritonModelException(
                f"{what} from a thread of the model between batches gets no answer: the server "
                "reads a model's messages while its initialize or execute runs, or always for a "
                "model with model_transaction_policy { decoupled: true }")

    def respond(self, key: Any, response: Any, final: bool) -> None:
        if response is None:
            self.demux.send(("d", key, None, None, final))
            return
        data = ModelStub.response_data(response)
        if isinstance(data, ResponseError):
            self.demux.send(("d", key, None, (data.code, data.message), final))
        else:
            self.demux.send(("d", key, self.pack(data), None, final))

    def pack(self, tensors: dict) -> Any:
        """Large tensors into a region the server lends (it reads and frees it)."""
        if not tensors or _payload_bytes(tensors) < SHM_MESSAGE_BYTES:
            return tensors
        staged, end = stage(tensors)
        name = self.demux.call("a", end)[2]
        if name is None:              # no room in /dev/shm: the socket carries them
            return tensors
        region = ShmRegion.attach(name)
        try:
            refs = region.write(staged)
        finally:
            region.close()
        return ("shm", name, refs)

    def unpack(self, packed: Any) -> dict | None:
        if type(packed) is not tuple:
            return packed
        _, name, refs = packed
        region = ShmRegion.attach(name)
        try:
            return region.read(refs)
        finally:
            region.close()
            self.demux.send(("af", name))

    def cancelled(self, key: Any) -> bool:
        return bool(self.demux.call("cq", key)[2])

    def orphaned(self, key: Any) -> None:
        self._orphans.put(key)

    def flush(self) -> None:
        pass

    def metric_call(self, op: str, args: tuple, what: str) -> Any:
        self._answerable(what)
        _, _, ok, result = self.demux.call("m", op, args)
        if not ok:
            raise pb_utils.TritonModelException(f"{what}: {result}")
        return result

    def metric_send(self, op: str, args: tuple) -> None:
        self.demux.send(("m", 0, op, args))   # id 0: no answer wanted

    def model_log(self, level: str, message: str) -> None:
        # Through stderr, which the server reads at once (the socket is read only while a
        # batch runs, for a model that is not decoupled): one line, one write.
        line = f"{_LOGGER_MARK}{level}\t{json.dumps(message)}\n".encode("utf-8", "replace")
        while line:
            line = line[os.write(2, line):]

    def bls_exec(self, request: Any, decoupled: bool) -> Any:
        self._answerable("A BLS request")
        spec = list(bls_spec(request))
        spec[2] = self.pack(spec[2])
        call_id = self.demux.new_id()
        self.demux.send(("b", call_id, decoupled, tuple(spec)))
        if decoupled:
            return _BlsStream(self, call_id)
        msg = self.demux.reply((call_id, 0))
        return bls_response(self.unpack(msg[2]), msg[3])


class _BlsStream:
    """``exec(decoupled=True)`` in a worker: the responses as the server relays them."""

    def __init__(self, host: "_WorkerHost", call_id: int) -> None:
        self._host = host
        self._demux = host.demux
        self._id = call_id
        self._seq = 0
        self._done = False

    def __iter__(self) -> "_BlsStream":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            msg = self._demux.reply((self._id, self._seq))
        except EOFError:
            self._done = True
            raise StopIteration from None
        self._seq += 1
        self._done = bool(msg[4])
        return bls_response(self._host.unpack(msg[2]), msg[3])

    def __del__(self) -> None:
        # Dropped before its end: cancel the called request and forget its responses, from
        # the closer's thread (a finalizer may run inside a send that holds the lock).
        if not self._done:
            self._done = True
            self._demux.closer.put(self._id)


def _serve(demux: "_Demux", host: "_WorkerHost", stub: ModelStub, regions: dict[str, ShmRegion],
           all_outputs: list[str]) -> None:
    while True:
        try:
            msg = demux.command()
        except EOFError:   # the server went away: nothing left to serve
            return
        kind = msg[0]
        if kind == "f":
            try:
                stub.finalize()
                demux.send(("done",))
            except StubError as err:
                demux.send(("error", err.to_tuple()))
            return
        if kind == "r":
            for region in regions.values():
                region.close()
            regions.clear()
            demux.send(("r",))
            continue
        if kind == "xd":
            _, in_name, metas, keys = msg
            requests = _requests(regions, in_name, "", metas, all_outputs)
            try:
                stub.execute_decoupled(requests, keys, host)
                demux.send(("xdone",))
            except StubError as err:
                demux.send(("error", err.to_tuple()))
            continue
        _, in_name, out_name, metas = msg
        requests = _requests(regions, in_name, out_name, metas, all_outputs)
        host.server_reading = True
        try:
            results = stub.execute(requests)
        except StubError as err:
            demux.send(("error", err.to_tuple()))
            continue
        finally:
            host.server_reading = False
        _send_results(demux, regions, out_name, results)


def _requests(regions: dict[str, ShmRegion], in_name: str, out_name: str, metas: list,
              all_outputs: list[str]) -> list[RequestData]:
    if in_name not in regions or (out_name and out_name not in regions):
        for stale in [n for n in regions if n != in_name and n != out_name]:
            regions.pop(stale).close()
    in_region = _region(regions, in_name) if in_name else None
    groups = [meta if type(meta) is list else meta[0] for meta in metas]
    inputs = in_region.read_many(groups) if in_region is not None else [{} for _ in groups]
    requests = []
    for meta, tensors in zip(metas, inputs):
        if type(meta) is list:   # a plain request: every output, no id, no parameters
            requests.append(RequestData(tensors, "", 0, "{}", list(all_outputs), 0))
            continue
        _, rid, cid, params, names, flags = meta
        requests.append(RequestData(tensors, rid, cid, params,
                                    list(all_outputs) if names is None else names, flags))
    return requests


def _send_results(chan: _Demux, regions: dict[str, ShmRegion], out_name: str,
                  results: list[dict | ResponseError]) -> None:
    layouts: list[Any] = []
    end = 0
    for result in results:
        if isinstance(result, ResponseError):
            layouts.append((result.code, result.message))
            continue
        try:
            staged, end = stage(result, end)
        except Exception as err:   # e.g. an output whose dtype Triton has no name for
            layouts.append((1, f"cannot return outputs: {type(err).__name__}: {err}"))
            continue
        layouts.append(staged)
    out_region = _region(regions, out_name)
    if end > out_region.size:
        # Let go of the small region first: its pages count against /dev/shm until unmapped.
        regions.pop(out_name).close()
        chan.send(("grow", end))
        msg = chan.reply("o")
        if msg[1] is None:    # no room: the server fails this batch
            return
        out_region = _region(regions, msg[1])
    reply = [out_region.write(item) if type(item) is list else item for item in layouts]
    chan.send(("res", reply))


# ---------------------------------------------------------------------------- server side

# Worker -> server messages that are not answers to the server's own request: metrics,
# BLS calls (the reader, or the thread that waits for a batch, hands them on).
_SIDE = frozenset({"b", "bx", "m", "a", "af"})
_ALIVE = object()
_DIED = ("died",)

class _Spawner:
    """Starts every worker from one daemon thread: PR_SET_PDEATHSIG fires when the thread
    that forked the child ends, and a pool or instance thread may end long before the server."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="triton-python-spawner", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)


_SPAWNER = _Spawner()

_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Runs before multiprocessing's own exit hook, which would otherwise wait forever on
    # non-daemon workers still blocked reading their pipe.
    workers = list(_LIVE)
    for worker in workers:
        worker.hang_up()   # every idle worker sees end-of-file and leaves at once
    for worker in workers:
        worker.close()


def _start_process(target: Callable, name: str, args: tuple) -> tuple[Connection, Any]:
    conn, child = _CONTEXT.Pipe(duplex=True)
    # Not a daemon: a model may start processes of its own (DataLoader workers...).
    process = _CONTEXT.Process(target=target, name=name, args=(child, *args, os.getpid()))
    _SPAWNER.run(process.start)
    child.close()   # so the socket reports end-of-file when the worker goes
    return conn, process


class WorkerProcess:
    """The server's handle on one worker process and the two regions it reads and writes."""

    def __init__(self, model_py: str, args: dict[str, str], label: str, decoupled: bool = False,
                 side: Callable[["WorkerProcess", Any], None] | None = None, blas_threads: int = 0) -> None:
        self.model_py = model_py
        self.args = args
        self.label = label
        self.blas_threads = blas_threads
        self.ready = False
        self.decoupled = decoupled
        #: why open decoupled requests are failed when the worker ends: (kind, message),
        #: set by whoever kills it on purpose before the kill
        self.end_reason: tuple[str, str] | None = None
        self._side = side
        self._conn: Connection | None = None
        self._chan: Channel | None = None
        self._poll: Any = None
        self._process: Any = None
        self._in: ShmRegion | None = None
        self._out: ShmRegion | None = None
        self._send_lock = threading.Lock()
        # Decoupled models only: a reader thread owns the socket once the worker is ready.
        self._reader: threading.Thread | None = None
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._exitcode: Any = _ALIVE
        self._sinks: dict[int, Any] = {}
        self._keys = itertools.count(1)
        self._logs: threading.Thread | None = None
        # regions lent for tensors that travel with a message (BLS, decoupled responses)
        self._loans: dict[str, ShmRegion] = {}
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> "WorkerProcess":
        """Spawn the process; ``wait_ready`` waits for ``initialize`` to finish."""
        sweep_once()
        out_r, out_w = _CONTEXT.Pipe(duplex=False)
        err_r, err_w = _CONTEXT.Pipe(duplex=False)
        try:
            self._conn, self._process = _start_process(
                worker_main, f"triton-python-{self.label}",
                ("serve", self.model_py, self.args, (out_w, err_w), self.blas_threads))
        finally:
            out_w.close()
            err_w.close()
        self._logs = threading.Thread(target=_read_output, args=(self, out_r, err_r), daemon=True,
                                      name=f"triton-python-output-{self.label}")
        self._logs.start()
        self._chan = Channel(self._conn.fileno())
        self._poll = select.poll()
        self._poll.register(self._chan.fd, select.POLLIN)
        self._poll.register(self._process.sentinel, select.POLLIN)
        _LIVE.add(self)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Raises ``StubError`` (initialize failed), ``WorkerDied`` or ``WorkerTimeout``."""
        msg = self._recv("initialize", timeout)
        if msg[0] == "error":
            raise StubError(*msg[1])
        self.ready = True
        if self.decoupled:
            self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                            name=f"triton-python-reader-{self.label}")
            self._reader.start()

    def _stage_inputs(self, requests: list[RequestData], all_outputs: list[str] | None) -> list:
        staged, end, metas = [], 0, []
        for req in requests:
            s, end = stage(req.inputs, end)
            staged.extend(s)
            refs = [x[0] for x in s]
            names = None if all_outputs is not None and req.requested_output_names == all_outputs \
                else req.requested_output_names
            if not req.request_id and not req.correlation_id and req.parameters == "{}" \
                    and names is None and not req.flags:
                metas.append(refs)
            else:
                metas.append((refs, req.request_id, req.correlation_id, req.parameters, names, req.flags))
        if staged and (self._in is None or self._in.size < end):
            self._grow("_in", end)
        if staged:
            self._in.write(staged)
        return metas

    def execute(self, requests: list[RequestData], timeout: float | None = None,
                all_outputs: list[str] | None = None) -> list[dict | ResponseError]:
        """Run one batch. Raises ``StubError`` when execute raised, ``WorkerDied`` on death,
        ``WorkerTimeout`` past ``timeout`` seconds (the worker is killed), and
        ``SharedMemoryFull`` when the batch does not fit in /dev/shm (the worker lives on)."""
        metas = self._stage_inputs(requests, all_outputs)
        if self._out is None:
            self._grow("_out", 0)
        deadline = None if not timeout else time.monotonic() + timeout
        self._send(("x", self._in.name if self._in is not None else "", self._out.name, metas))
        msg = self._recv("execute", timeout, deadline)
        if msg[0] == "grow":
            self._out.close()   # its content is not needed: free its pages before asking for more
            self._out = None
            try:
                self._out = ShmRegion.create(msg[1])
            except SharedMemoryFull:
                self._send(("o", None))
                raise
            self._send(("o", self._out.name))
            msg = self._recv("execute", timeout, deadline)
        if msg[0] == "error":
            raise StubError(*msg[1])
        items = msg[1]
        tensors = iter(self._out.read_many([item for item in items if type(item) is list]))
        return [next(tensors) if type(item) is list else ResponseError(*item) for item in items]

    def execute_decoupled(self, requests: list[RequestData], sinks: list[Any],
                          timeout: float | None = None, all_outputs: list[str] | None = None) -> None:
        """A decoupled batch: returns when the model's execute has returned; request ``i``'s
        responses reach ``sinks[i].deliver(outputs, error, final)`` from the reader thread,
        and ``sinks[i].fail(kind, message)`` closes it if the worker ends first. Raises as
        ``execute`` does."""
        metas = self._stage_inputs(requests, all_outputs)
        keys = []
        for sink in sinks:
            key = next(self._keys)
            self._sinks[key] = sink
            keys.append(key)
        self._send(("xd", self._in.name if self._in is not None else "", metas, keys))
        msg = self._recv("execute", timeout)
        if msg[0] == "error":
            raise StubError(*msg[1])

    @property
    def closed(self) -> bool:
        """Closed, or its process has ended."""
        process = self._process
        return self._closed or process is None or process.exitcode is not None

    def open_requests(self) -> int:
        """Decoupled requests whose final response has not been sent yet."""
        return len(self._sinks)

    def _read_loop(self) -> None:
        chan, sinks, replies = self._chan, self._sinks, self._replies
        poll = select.poll()
        poll.register(chan.fd, select.POLLIN)
        poll.register(self._process.sentinel, select.POLLIN)
        try:
            while True:
                msg = chan.take()
                if msg is not None:
                    kind = msg[0]
                    if kind == "d":
                        _, key, outputs, error, final = msg
                        if type(outputs) is tuple:
                            outputs = self._take_loan(outputs)
                        sink = sinks.pop(key, None) if final else sinks.get(key)
                        if sink is not None:
                            sink.deliver(outputs, error, final)
                    elif kind == "cq":
                        sink = sinks.get(msg[2])
                        self._send(("cr", msg[1], True if sink is None else sink.cancelled()))
                    elif kind in _SIDE:
                        self._side_message(msg)
                    else:
                        replies.put(msg)
                    continue
                events = poll.poll()
                if any(fd == chan.fd for fd, _ in events):
                    try:
                        if chan.fill():
                            continue
                    except OSError:
                        pass
                break
        except BaseException:   # a bug here must not leave requests open forever
            log.exception("python worker %s: reader failed", self.label)
        finally:
            self._exitcode = self._reap()
            replies.put(_DIED)
            kind, message = self.end_reason or (
                "died", f"the python worker died ({describe_exit(self._exitcode)})")
            while sinks:
                _, sink = sinks.popitem()
                try:
                    sink.fail(kind, message)
                except Exception:
                    log.exception("python worker %s: failing an open request", self.label)

    def _side_message(self, msg: Any) -> None:
        kind = msg[0]
        if kind == "a":     # the worker wants a region for tensors it is about to send
            self._send(("ar", msg[1], self._lend(msg[2])))
            return
        if kind == "af":    # it has read the region it was sent
            region = self._loans.pop(msg[1], None)
            if region is not None:
                region.close()
            return
        if kind == "b" and type(msg[3][2]) is tuple:
            spec = list(msg[3])
            spec[2] = self._take_loan(spec[2])
            msg = (*msg[:3], tuple(spec))
        if self._side is not None:
            try:
                self._side(self, msg)
            except Exception:
                log.exception("python worker %s: side message %r failed", self.label, msg[0])

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
        self._send(("r",))
        self._recv("release")
        setattr(self, attr, ShmRegion.create(nbytes))

    def _send(self, msg: Any) -> None:
        try:
            with self._send_lock:
                self._chan.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise WorkerDied(self._reap()) from None

    def send_side(self, msg: Any) -> None:
        """An answer to a side message (BLS), from any thread; a dead worker is not an error."""
        try:
            self._send(msg)
        except WorkerDied:
            pass

    def pack(self, tensors: dict | None) -> Any:
        """Tensors for a message to the worker: inline when small, else in a region lent to
        it (it says ``("af", name)`` once read; the region goes with the worker otherwise)."""
        if not tensors or _payload_bytes(tensors) < SHM_MESSAGE_BYTES:
            return tensors
        staged, end = stage(tensors)
        try:
            region = ShmRegion.create(end)
        except SharedMemoryFull:
            return tensors            # no room: the socket carries them
        refs = region.write(staged)
        self._keep(region)
        return ("shm", region.name, refs)

    def _lend(self, nbytes: int) -> str | None:
        try:
            region = ShmRegion.create(nbytes)
        except SharedMemoryFull:
            return None
        self._keep(region)
        return region.name

    def _keep(self, region: ShmRegion) -> None:
        self._loans[region.name] = region
        if self._closed:   # closed meanwhile (a BLS answer racing the worker's end)
            self._loans.pop(region.name, None)
            region.close()

    def _take_loan(self, packed: tuple) -> dict:
        _, name, refs = packed
        region = self._loans.pop(name, None)
        if region is None:   # never lent (a confused worker): no tensors rather than a dead reader
            log.error("python worker %s: tensors in region %s, which it was not lent", self.label, name)
            return {}
        try:
            return region.read(refs)
        finally:
            region.close()

    def _recv(self, what: str, timeout: float | None = None, deadline: float | None = None) -> Any:
        """The next message; ``WorkerTimeout`` (after killing the worker) past ``deadline``
        (or ``timeout`` seconds from now), ``WorkerDied`` when the worker goes."""
        if deadline is None and timeout:
            deadline = time.monotonic() + timeout
        if self._reader is not None:
            return self._recv_queued(what, timeout, deadline)
        chan = self._chan
        while True:
            msg = chan.take()
            if msg is not None:
                if msg[0] in _SIDE:
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
            # Only the sentinel fired: the worker is gone (a child it forked may still hold
            # the socket open, so end-of-file alone is not to be waited for).
            if any(fd == chan.fd for fd, _ in events):
                try:
                    if chan.fill():
                        continue
                except OSError:
                    pass
            raise WorkerDied(self._reap())

    def _recv_queued(self, what: str, timeout: float | None, deadline: float | None) -> Any:
        if self._exitcode is not _ALIVE:
            raise WorkerDied(self._exitcode)
        try:
            msg = self._replies.get(timeout=None if deadline is None
                                    else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if self.end_reason is None:
                self.end_reason = ("timeout", f"{what} did not finish within {timeout or 0:g} s; "
                                   "the worker was killed")
            self.kill()
            self._reader.join(10)
            raise WorkerTimeout(what, timeout or 0) from None
        if msg is _DIED:
            self._replies.put(_DIED)   # for whoever asks next
            raise WorkerDied(self._exitcode)
        return msg

    def kill(self) -> None:
        """SIGKILL now; safe from another thread while a batch waits on this worker."""
        process = self._process
        if process is not None and process.pid is not None and process.exitcode is None:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

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
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

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
        if self.end_reason is None:
            self.end_reason = ("closed", "the model instance was unloaded")
        try:
            if self.ready and self._process is not None and self._process.is_alive():
                self._send(("f",))
                msg = self._recv("finalize", timeout)
                if msg[0] == "error":
                    error = StubError(*msg[1])
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
        while self._loans:
            self._loans.popitem()[1].close()
        _LIVE.discard(self)


_WORKER_LOG_LINE = re.compile(r"^\S+ \S+ \[python backend worker \d+\] (INFO|WARNING|ERROR|DEBUG|CRITICAL) ")
_LOG_LEVEL_NAMES = {"DEBUG": "VERBOSE", "CRITICAL": "ERROR"}
_LOGGER_MARK = "\x1b[jt-model-log]"


def _read_output(worker: WorkerProcess, out_r: Connection, err_r: Connection) -> None:
    """A worker's stdout and stderr, line by line: to the server's own streams as before, and
    into the model's log lines."""
    model, version = worker.args.get("model_name", ""), worker.args.get("model_version", "")
    streams = {out_r.fileno(): ("stdout", out_r, bytearray()), err_r.fileno(): ("stderr", err_r, bytearray())}
    poll = select.poll()
    for fd in streams:
        poll.register(fd, select.POLLIN)
    try:
        while streams:
            for fd, _ in poll.poll():
                source, pipe, pending = streams[fd]
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except OSError:
                    chunk = b""
                if chunk:
                    pending += chunk
                    if b"\n" not in chunk:
                        continue
                    done, _, rest = bytes(pending).rpartition(b"\n")
                    pending[:] = rest
                    _emit(worker, model, version, source, done.decode("utf-8", "replace") + "\n")
                    continue
                if pending:
                    _emit(worker, model, version, source, pending.decode("utf-8", "replace") + "\n")
                poll.unregister(fd)
                pipe.close()
                del streams[fd]
    except Exception:
        log.exception("python worker %s: reading its output failed", worker.label)


def _emit(worker: WorkerProcess, model: str, version: str, source: str, text: str) -> None:
    raw = []
    for line in text.rstrip("\n").split("\n"):   # not splitlines(): it splits at \x1c-\x1e too
        if source == "stderr" and line.startswith(_LOGGER_MARK):   # a pb_utils.Logger line
            level, _, message = line[len(_LOGGER_MARK):].partition("\t")
            try:
                message = json.loads(message)
            except ValueError:
                pass
            LOGS.record(model, version, level, str(message), "logger", worker.label)
            continue
        raw.append(line)
        match = _WORKER_LOG_LINE.match(line) if source == "stderr" else None
        level = (_LOG_LEVEL_NAMES.get(match.group(1), match.group(1)) if match
                 else "INFO" if source == "stdout" else "WARNING")
        LOGS.record(model, version, level, line, source, worker.label, to_server_log=False)
    if not raw:
        return
    # The server's own fd, as the worker wrote to it before its output was read here: a
    # terminal, a log file, or whatever captures the server's output sees the same bytes.
    data = memoryview(("\n".join(raw) + "\n").encode("utf-8", "replace"))
    try:
        while data:
            data = data[os.write(1 if source == "stdout" else 2, data):]
    except OSError:
        pass


def auto_complete_in_worker(model_py: str, module: str, config_json: str, timeout: float | None = None) -> dict:
    """Run ``auto_complete_config`` in a short-lived worker, so model.py's imports and
    side effects stay out of the server process."""
    conn, process = _start_process(worker_main, "triton-python-autocomplete",
                                   ("auto_complete", model_py, (module, config_json), None, 0))
    chan = Channel(conn.fileno())
    try:
        if not conn.poll(timeout):
            process.kill()
            raise WorkerTimeout("auto_complete_config", timeout or 0)
        try:
            msg = chan.recv()
        except (EOFError, OSError):
            process.join(5)
            raise WorkerDied(process.exitcode) from None
        if msg[0] == "error":
            raise StubError(*msg[1])
        return msg[1]
    finally:
        conn.close()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(2)
