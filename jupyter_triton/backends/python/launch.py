"""How the server starts a python backend process: forked from the template (the default),
or a packed environment's own python (``EXECUTION_ENV_PATH``); both hand back the same
small process handle (pid, a pollable ``sentinel``, ``exitcode``, ``is_alive``, ``join``,
``kill``).

The template is one process per server that has imported numpy and the worker's modules
(``worker_main.template_main``); a worker forked from it starts in milliseconds instead of
the ~0.4 s of a fresh interpreter and its imports. It is started on first use, or ahead of
time by ``prestart()``, and again if it dies. Handles are pidfds: polled for the exit, and
signalled without the race of a pid reused after its process was reaped.

Every process is started from one daemon thread (``_SPAWNER``): ``PR_SET_PDEATHSIG``
fires when the thread that forked the child ends, and a pool or instance thread may end
long before the server.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable

from .envs import PackedEnv
from .messages import Channel, Start
from .worker_main import TEMPLATE_STATUS

log = logging.getLogger(__name__)

_BOOT = str(Path(__file__).with_name("boot.py"))
_PACKAGE_DIR = str(Path(__file__).resolve().parents[2])
#: how long the template may take to answer a fork (it forks at once; a busy machine...)
FORK_TIMEOUT_S = 30.0
#: a pidfd tells when a process ends and signals it without a pid race (Linux 5.3+); without
#: one, the end of a pipe the child holds tells when it ends (multiprocessing's sentinel)
def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))   # the call exists where the kernel may not have it
    except (AttributeError, OSError):
        return False
    return hasattr(signal, "pidfd_send_signal")


USE_PIDFD = _pidfds_work()
#: the template needs pidfds (its workers are not our children); without them every worker
#: is a fresh interpreter, as a packed environment's is
USE_TEMPLATE = USE_PIDFD


class _Spawner:
    """Runs every process start on one daemon thread that lives as long as the server."""

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


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` is readable (or hung up) within ``timeout`` s (None: wait). poll, not
    select: select refuses descriptors past FD_SETSIZE (1024), which a server holding many
    connections and workers reaches (a long test run did: every unload then failed)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else math.ceil(max(0.0, timeout) * 1000)))


def _exited(pidfd: int) -> bool:
    return _readable(pidfd, 0)


class ForkedProcess:
    """A worker forked by the template: not our child, so its exit code comes from the
    template (None if the template went first)."""

    def __init__(self, template: "_Template", pid: int) -> None:
        self.pid = pid
        self._template = template
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:   # ended and reaped already: a pidfd of our own, readable
            r, w = os.pipe()
            os.close(w)
            self.sentinel = r

    @property
    def exitcode(self) -> int | None:
        return self._template.exitcode(self.pid) if _exited(self.sentinel) else None

    def is_alive(self) -> bool:
        return not _exited(self.sentinel)

    def join(self, timeout: float | None = None) -> None:
        if _readable(self.sentinel, timeout):
            self._template.wait_exit(self.pid, 1.0)

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def __del__(self) -> None:
        try:
            os.close(self.sentinel)
            self._template.forget(self.pid)
        except (OSError, AttributeError):
            pass


class ChildProcess:
    """A process of our own (the template, a packed environment's worker)."""

    def __init__(self, popen: subprocess.Popen, sentinel: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = sentinel

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def __del__(self) -> None:
        try:
            os.close(self.sentinel)
        except (OSError, AttributeError):
            pass


def _boot(python: str, role: str, fds: tuple[int, ...], paths: list[str],
          environ: dict[str, str] | None = None) -> ChildProcess:
    resource_tracker.ensure_running()
    tracker = resource_tracker.getfd()
    args = [python, _BOOT, role, str(fds[0]), _PACKAGE_DIR, str(os.getpid()), json.dumps(paths),
            str(tracker), *map(str, fds[1:])]
    keep = (*fds, tracker)
    if not USE_PIDFD:   # the child holds the write end: its end is end-of-file here
        sentinel, held = os.pipe()
        keep += (held,)
    try:
        popen = _SPAWNER.run(lambda: subprocess.Popen(
            args, pass_fds=keep, stdin=subprocess.DEVNULL, close_fds=True, env=environ))
    finally:
        if not USE_PIDFD:
            os.close(held)
    return ChildProcess(popen, os.pidfd_open(popen.pid) if USE_PIDFD else sentinel)


class _Template:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._process: ChildProcess | None = None
        self._sock: socket.socket | None = None
        self._forks: queue.SimpleQueue = queue.SimpleQueue()
        self._exits: dict[int, int] = {}

    def ensure(self) -> None:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = _boot(sys.executable, "template", (theirs.fileno(),), list(sys.path))
        finally:
            theirs.close()
        self._sock = ours
        self._forks = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(ours, self._forks), daemon=True,
                         name="triton-python-template").start()

    def _read(self, sock: socket.socket, forks: queue.SimpleQueue) -> None:
        try:
            while True:
                data = sock.recv(64)
                if len(data) != TEMPLATE_STATUS.size:
                    break
                kind, pid, code = TEMPLATE_STATUS.unpack(data)
                if kind == b"p":
                    forks.put(pid)
                else:
                    with self._cond:
                        self._exits[pid] = code
                        self._cond.notify_all()
        except OSError:
            pass
        finally:
            forks.put(None)
            with self._cond:
                self._cond.notify_all()
            sock.close()

    def fork(self, fds: tuple[int, int, int]) -> ForkedProcess:
        with self._lock:
            for attempt in range(2):   # a template that died since: start another, once
                if self._process is None or not self._process.is_alive():
                    self._start()
                try:
                    socket.send_fds(self._sock, [b"f"], list(fds))
                    pid = self._forks.get(timeout=FORK_TIMEOUT_S)
                except (OSError, queue.Empty):
                    pid = None
                if pid is not None:
                    return ForkedProcess(self, pid)
                self._stop_locked()
        raise OSError("the python backend's template process did not fork a worker")

    def exitcode(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits and self._process is not None and self._process.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _stop_locked(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def forget(self, pid: int) -> None:
        with self._cond:
            self._exits.pop(pid, None)


TEMPLATE = _Template()


def prestart() -> None:
    """Start the template now (in the background of a server's start), so that the first
    python model's worker does not wait for it."""
    threading.Thread(target=_prestart, daemon=True, name="triton-python-prestart").start()


def _prestart() -> None:
    try:
        TEMPLATE.ensure()
    except Exception:
        log.exception("python backend: the template process did not start")


def start(job: str, model_py: str, payload: Any, blas_threads: int = 0,
          env: PackedEnv | None = None, poll_us: int = 0) -> tuple[socket.socket, int, int, Any]:
    """A worker process for ``job``: forked from the template, or run by a packed
    environment's python. Returns its socket, the read ends of its stdout and stderr, and
    its handle; its first message (the job, the environment now) is already sent."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    fds = (theirs.fileno(), out_w, err_w)
    environ = dict(os.environ) if env is None else env.environ(dict(os.environ))
    try:
        if env is not None:
            process: Any = _boot(env.python, "worker", fds,
                                 list(sys.path) if _same_python(env.python) else [], environ)
        elif USE_TEMPLATE:
            process = TEMPLATE.fork(fds)
        else:
            process = _boot(sys.executable, "worker", fds, list(sys.path), environ)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        ours.close()
        raise
    finally:
        theirs.close()
        os.close(out_w)
        os.close(err_w)
    try:
        Channel(ours.fileno()).send(Start(job, model_py, payload, blas_threads, environ, os.getcwd(),
                                     poll_us))
    except OSError:
        pass   # it died at once: the caller sees end-of-file and its exit
    return ours, out_r, err_r, process


_SAME: dict[str, bool] = {}


def _same_python(python: str) -> bool:
    """Whether ``python`` is this python's version (then the server's packages can be a
    fallback for what an environment lacks: their compiled parts fit)."""
    same = _SAME.get(python)
    if same is None:
        try:
            out = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        same = _SAME[python] = out == str(sys.version_info[:2])
    return same
