"""The worker process's end of the python backend: ``worker_main`` serves one
``ModelStub`` over the socket to the server (``messages``), and ``template_main`` is the
template process that workers are forked from.

One batch costs one read and one write of the socket and nothing polls. The socket is read
by whichever thread of the worker waits (``_Demux``): the main loop while idle, so a batch
costs no thread hand-off, or a model's own thread waiting for an answer (a decoupled
model's cancellation query, a BLS call).

**The template.** A spawned worker paid for a fresh interpreter, ``multiprocessing``'s
re-run of the server's main script and the imports of numpy and the backend's package:
0.45 s on a quiet machine, 1.4-2.5 s on a loaded one, more than a small model's
``initialize``. The server starts one template process (``template_main``) that has done the
imports, and forks each worker from it: ready 0.02-0.05 s after the fork on the same loaded
machine. A worker is still a process of its own (a crash, a leak, a hang costs its own
requests); the template runs no model code and no python threads, so a fork copies nothing
a model did (BLAS's own pool is made again after a fork by the library). Each worker takes
the server's environment and folder of now from its ``Start`` message. A model with a
packed environment (``EXECUTION_ENV_PATH``) runs that environment's python instead, started
afresh (``boot.py``), as every worker is where the template cannot be used (``launch``).

A worker dies with its parent: it asks the kernel for SIGKILL when the parent goes
(``PR_SET_PDEATHSIG``), and it leaves its loop when the socket reports end-of-file. The
template dies with the server the same way, so the chain holds; a template that is killed
takes its workers with it (they fail their requests and are started again, from a new
template).
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Callable

from . import triton_python_backend_utils as pb_utils
from .messages import (LOGGER_MARK, REPLIES, SHM_MESSAGE_BYTES, AutoCompleted, BlsCall, BlsDropped,
                       BlsReply, CancelQuery, Channel, DecoupledReturned, Execute, ExecuteDecoupled,
                       Failed, Finalize, Finalized, Grow, LoanAsk, LoanDone, Metric, OutputRegion,
                       ProtocolError, Ready, Release, Released, Response, Results, Start,
                       payload_bytes)
from .shm import ShmRegion, stage, stage_into
from .stub import (ModelStub, OrphanCloser, RequestData, ResponseError, StubError, bls_response, bls_spec,
                   run_auto_complete_config)

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:   # the server went before the signal was armed
        os._exit(0)


def worker_main(fd: int, out_fd: int, err_fd: int, parent_pid: int) -> None:
    """A worker's life, on socket ``fd`` to the server: its first message says the job
    (``messages.Start``): "serve" (payload: Triton's args) or "auto_complete" (payload:
    (module name, config JSON)), the BLAS threads (0 leaves the library's or the
    environment's choice), the server's environment and working directory (a worker forked
    from the template gets those of the server now, not of when the template started).
    ``out_fd``/``err_fd`` become fds 1 and 2: the server reads them, and a model's prints
    become its log lines. Dies with ``parent_pid`` (the server, or the template)."""
    for target, fd_ in ((1, out_fd), (2, err_fd)):
        os.dup2(fd_, target)
        os.close(fd_)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)   # a pipe is block-buffered otherwise
    _die_with_parent(parent_pid)
    # Ctrl-C in the server's terminal reaches the whole process group; the server decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan = Channel(fd, trust_peer=True)   # the server's messages
    try:
        start = chan.recv()
    except (EOFError, OSError, ValueError, ProtocolError):
        return
    if type(start) is not Start:
        return
    job, model_py, payload, blas_threads, environ, cwd, poll_us = start
    os.environ.clear()
    os.environ.update(environ)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    from . import blas
    threads = blas_threads or blas.env_threads()
    if threads:   # the libraries loaded already (the template's numpy) read no environment now
        blas.set_threads(threads)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [python backend worker %(process)d] %(levelname)s %(message)s")
    if job == "auto_complete":
        try:
            chan.send(AutoCompleted(run_auto_complete_config(model_py, *payload)))
        except StubError as err:
            chan.send(Failed(err.to_tuple()))
        return
    demux = _Demux(chan)
    host = _WorkerHost(demux, _is_decoupled(payload))
    pb_utils._default_bls_host = host   # one model per worker: every thread of it calls here
    host.server_reading = True          # the server waits for "ready": it answers calls
    try:
        stub = ModelStub(model_py, payload)
    except StubError as err:
        demux.send(Failed(err.to_tuple()))
        return
    host.server_reading = host.decoupled
    demux.send(Ready(os.getpid()))
    regions: dict[str, ShmRegion] = {}
    try:
        _serve(demux, host, stub, regions, _output_names(payload), poll_us / 1e6)
    finally:
        for region in regions.values():
            region.close()
        os.close(fd)


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
        # the main loop's next wait polls until then (time.monotonic(); 0: it sleeps at once)
        self.poll_until = 0.0
        # a plain lock: ``with`` on it is one C call, where a Condition's own is a Python method
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
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
        self.send(BlsDropped(call_id))

    def send(self, msg: Any) -> None:
        with self._send_lock:
            self.chan.send(msg)

    def new_id(self) -> int:
        return next(self._ids)

    def abandon(self, call_id: int) -> None:
        """A BLS stream the model stopped reading: drop what came and what comes."""
        with self._lock:
            self.abandoned.add(call_id)
            for key in [k for k in self._replies if type(k) is tuple and k[0] == call_id]:
                msg = self._replies.pop(key)
                self._free(msg)
                if msg.final:
                    self.abandoned.discard(call_id)

    def _free(self, msg: BlsReply) -> None:
        """A dropped BLS answer whose tensors came in a lent region: give the region back."""
        if type(msg.outputs) is tuple:
            self.send(LoanDone(msg.outputs[1]))

    def _wait(self, ready: Callable[[], Any]) -> None:
        cond = self._cond
        with self._lock:
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
                poll_until, self.poll_until = self.poll_until, 0.0
                cond.release()
                try:
                    msg = self.chan.recv(poll_until)
                except (EOFError, OSError, ProtocolError):
                    msg = None
                finally:
                    cond.acquire()
                    self._reading = False
                if msg is None:
                    self._eof = True
                elif type(msg) in REPLIES:
                    key = "o" if type(msg) is OutputRegion else msg[0]
                    if type(key) is tuple and key[0] in self.abandoned:
                        self._free(msg)
                        if msg.final:   # a BLS stream nobody reads any more: drop it to its end
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

    def call(self, kind: type, *args: Any) -> Any:
        """Ask the server (a ``kind`` message, its id first) and wait for its answer."""
        call_id = next(self._ids)
        self.send(kind(call_id, *args))
        return self.reply(call_id)


# Server -> worker messages that answer a waiter rather than start work.




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
        self._orphans = OrphanCloser(lambda key: demux.send(Response(key, None, None, True)))

    def _answerable(self, what: str) -> None:
        if not self.server_reading:
            raise pb_utils.TritonModelException(
                f"{what} from a thread of the model between batches gets no answer: the server "
                "reads a model's messages while its initialize or execute runs, or always for a "
                "model with model_transaction_policy { decoupled: true }")

    def respond(self, key: Any, response: Any, final: bool) -> None:
        if response is None:
            self.demux.send(Response(key, None, None, final))
            return
        data = ModelStub.response_data(response)
        if isinstance(data, ResponseError):
            self.demux.send(Response(key, None, (data.code, data.message), final))
        else:
            self.demux.send(Response(key, self.pack(data), None, final))

    def pack(self, tensors: dict) -> Any:
        """Large tensors into a region the server lends (it reads and frees it)."""
        if not tensors or payload_bytes(tensors) < SHM_MESSAGE_BYTES:
            return tensors
        staged, end = stage(tensors)
        name = self.demux.call(LoanAsk, end).region
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
            self.demux.send(LoanDone(name))

    def cancelled(self, key: Any) -> bool:
        return bool(self.demux.call(CancelQuery, key).cancelled)

    def orphaned(self, key: Any) -> None:
        self._orphans.put(key)

    def flush(self) -> None:
        pass

    def metric_call(self, op: str, args: tuple, what: str) -> Any:
        self._answerable(what)
        _, ok, result = self.demux.call(Metric, op, args)
        if not ok:
            raise pb_utils.TritonModelException(f"{what}: {result}")
        return result

    def metric_send(self, op: str, args: tuple) -> None:
        self.demux.send(Metric(0, op, args))   # id 0: no answer wanted

    def model_log(self, level: str, message: str) -> None:
        # Through stderr, which the server reads at once (the socket is read only while a
        # batch runs, for a model that is not decoupled): one line, one write.
        line = f"{LOGGER_MARK}{level}\t{json.dumps(message)}\n".encode("utf-8", "replace")
        while line:
            line = line[os.write(2, line):]

    def bls_exec(self, request: Any, decoupled: bool) -> Any:
        self._answerable("A BLS request")
        spec = list(bls_spec(request))
        spec[2] = self.pack(spec[2])
        call_id = self.demux.new_id()
        self.demux.send(BlsCall(call_id, decoupled, tuple(spec)))
        if decoupled:
            return _BlsStream(self, call_id)
        msg = self.demux.reply((call_id, 0))
        return bls_response(self.unpack(msg.outputs), msg.error)


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
        self._done = bool(msg.final)
        return bls_response(self._host.unpack(msg.outputs), msg.error)

    def __del__(self) -> None:
        # Dropped before its end: cancel the called request and forget its responses, from
        # the closer's thread (a finalizer may run inside a send that holds the lock).
        if not self._done:
            self._done = True
            self._demux.closer.put(self._id)


def _serve(demux: "_Demux", host: "_WorkerHost", stub: ModelStub, regions: dict[str, ShmRegion],
           all_outputs: list[str], poll_s: float = 0.0) -> None:
    while True:
        try:
            msg = demux.command()
        except EOFError:   # the server went away: nothing left to serve
            return
        kind = type(msg)
        if kind is Execute:
            in_name, out_name, metas = msg
            requests = _requests(regions, in_name, out_name, metas, all_outputs)
            host.server_reading = True
            try:
                results = stub.execute(requests)
            except StubError as err:
                demux.send(Failed(err.to_tuple()))
                continue
            finally:
                host.server_reading = False
            _send_results(demux, regions, out_name, results)
            # Busy polling: after a batch of one (a server waiting on few clients, where a
            # wake-up is a good part of each request's time) the next batch is polled for.
            # Not after bigger batches: under load the cores are the server's and the
            # clients', and batches wait their queue delay anyway. Not beside the model's
            # own threads either: they would wait for the GIL.
            if poll_s and len(metas) == 1 and threading.active_count() == 1:
                demux.poll_until = time.monotonic() + poll_s
        elif kind is ExecuteDecoupled:
            in_name, metas, keys = msg
            requests = _requests(regions, in_name, "", metas, all_outputs)
            try:
                stub.execute_decoupled(requests, keys, host)
                demux.send(DecoupledReturned())
            except StubError as err:
                demux.send(Failed(err.to_tuple()))
        elif kind is Release:
            for region in regions.values():
                region.close()
            regions.clear()
            demux.send(Released())
        elif kind is Finalize:
            try:
                stub.finalize()
                demux.send(Finalized())
            except StubError as err:
                demux.send(Failed(err.to_tuple()))
            return
        else:
            logging.getLogger(__name__).error("python worker: unexpected %s from the server", kind.__name__)



def _requests(regions: dict[str, ShmRegion], in_name: str, out_name: str, metas: list,
              all_outputs: list[str]) -> list[RequestData]:
    if in_name not in regions or (out_name and out_name not in regions):
        for stale in [n for n in regions if n != in_name and n != out_name]:
            regions.pop(stale).close()
    in_region = _region(regions, in_name) if in_name else None
    groups = [meta if type(meta) is list else meta[0] for meta in metas]
    inputs = in_region.read_many(groups) if in_region is not None else [{} for _ in groups]
    # all_outputs is shared: pb_utils.InferenceRequest._of gives each request its own list
    requests = []
    for meta, tensors in zip(metas, inputs):
        if type(meta) is list:   # a plain request: every output, no id, no parameters
            requests.append(RequestData(tensors, "", 0, "{}", all_outputs, 0))
            continue
        _, rid, cid, params, names, flags = meta
        requests.append(RequestData(tensors, rid, cid, params,
                                    all_outputs if names is None else names, flags))
    return requests


def _send_results(chan: _Demux, regions: dict[str, ShmRegion], out_name: str,
                  results: list[dict | ResponseError]) -> None:
    layouts: list[Any] = []     # per request: its refs, or (code, message)
    staged: list = []
    end = 0
    for result in results:
        if type(result) is ResponseError:
            layouts.append((result.code, result.message))
            continue
        mark = len(staged)
        try:
            refs, end = stage_into(staged, result, end)
        except Exception as err:   # e.g. an output whose dtype Triton has no name for
            del staged[mark:]
            layouts.append((1, f"cannot return outputs: {type(err).__name__}: {err}"))
            continue
        layouts.append(refs)
    out_region = _region(regions, out_name)
    if end > out_region.size:
        # Let go of the small region first: its pages count against /dev/shm until unmapped.
        regions.pop(out_name).close()
        chan.send(Grow(end))
        name = chan.reply("o").name
        if name is None:    # no room: the server fails this batch
            return
        out_region = _region(regions, name)
    out_region.write(staged)
    chan.send(Results(layouts))


# ------------------------------------------------------------------------------ the template

#: template -> server: (kind, pid, exit code); kind b"p": forked ``pid``, b"x": ``pid`` ended
TEMPLATE_STATUS = struct.Struct("<cii")


def template_main(sock_fd: int, parent_pid: int) -> None:
    """The template process: on each request (a record carrying a worker's socket and its
    stdout/stderr pipes) fork a worker and say its pid; reap workers and say how they
    ended. Leaves when the server hangs up."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:   # what every model %%serve makes of a notebook callable imports (~50 ms)
        import cloudpickle  # noqa: F401
    except ImportError:
        pass
    sock = socket.socket(fileno=sock_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            while os.read(wake_r, 512) == 512:
                pass
            _reap_all(sock)
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 16, 3)
        except OSError:
            return
        if not data:   # the server is gone; its workers follow (PR_SET_PDEATHSIG)
            return
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            _forked_worker(sock, (wake_r, wake_w), fds, me)
        for fd in fds:
            os.close(fd)
        sock.send(TEMPLATE_STATUS.pack(b"p", pid, 0))


def _reap_all(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(TEMPLATE_STATUS.pack(b"x", pid, os.waitstatus_to_exitcode(status)))


def _forked_worker(sock: socket.socket, wake: tuple[int, int], fds: list[int], template_pid: int) -> None:
    """In the child of a fork: never returns into the template's loop."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        worker_main(*fds, template_pid)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
