"""A sub-millisecond alarm on the event loop (the dynamic batcher's queue delay).

asyncio's timers sleep in ``epoll_wait``, which counts whole milliseconds: a 500 us
``max_queue_delay_microseconds`` became a 1 ms sleep plus the loop's latency in the queue.
On Linux an ``Alarm`` is a ``timerfd`` (nanosecond deadline, CLOCK_MONOTONIC)
watched by the loop's own selector: the kernel makes it readable on time and
``epoll_wait`` returns, whatever its millisecond timeout. No thread, no spinning; one
wake-up of the loop per deadline.

Of the ways tried, the timerfd is the least late: a timer thread handing over by
``call_soon_threadsafe`` and ``asyncio.wait_for`` were later (benchmarks/results/notes-engine.md).

Elsewhere (no timerfd, or a loop without ``add_reader``) it falls back to ``loop.call_at``;
kqueue (macOS) and the Proactor (Windows) already sleep with sub-millisecond timeouts.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import sys
import time
import weakref
from typing import Callable

# <sys/timerfd.h> on Linux (the only place these are used)
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create, libc.timerfd_settime   # noqa: B018 -- missing in some libcs
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _timerfd() -> int | None:
    if _LIBC is None:
        return None
    fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
    return fd if fd >= 0 else None


def _settime_function():
    """timerfd_settime, called holding the GIL (a PyDLL function): it never blocks, and
    a CDLL call gives the GIL away and takes it back, a chance for another thread (a model
    instance's) to hold the event loop up for its switch interval."""
    if _LIBC is None:
        return None
    try:
        return ctypes.PyDLL(None, use_errno=True).timerfd_settime
    except (OSError, AttributeError):
        return _LIBC.timerfd_settime


_settime_c = _settime_function()


class _Setting:
    """One timerfd's ``timerfd_settime`` argument, built once: a structure, its ``it_value``
    field (reading a nested field builds a new view object each time) and the pointer to it."""

    __slots__ = ("spec", "value", "ref")

    def __init__(self) -> None:
        self.spec = _Itimerspec()
        self.value = self.spec.it_value
        self.ref = ctypes.byref(self.spec)


def _settime(fd: int, deadline_ns: int, setting: _Setting) -> None:
    """Arm ``fd`` for the absolute monotonic ``deadline_ns`` (0 disarms it)."""
    value = setting.value
    value.tv_sec, value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
    if _settime_c(fd, _TFD_TIMER_ABSTIME, setting.ref, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_PR_SET_TIMERSLACK = 29


def precise_thread_sleep() -> None:
    """Make the calling thread's timed waits end on time: Linux lets each one run up to the
    thread's timer slack late (50 us by default) to merge wake-ups; 1 ns is the smallest.
    Elsewhere, nothing."""
    if _LIBC is not None:
        try:
            _LIBC.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except AttributeError:
            pass


class Alarm:
    """Calls ``callback`` on the running loop once ``time.monotonic_ns()`` reaches the
    deadline given to ``set``; one deadline at a time (``set`` replaces it). Use it from
    the loop's thread only; ``close`` it when done."""

    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback = callback
        self.deadline_ns: int | None = None      # armed and not yet fired
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._setting = _Setting()

    def set(self, deadline_ns: int) -> None:
        if deadline_ns == self.deadline_ns:
            return
        if self._loop is None:
            self._attach(asyncio.get_running_loop())
        self.deadline_ns = deadline_ns
        if self._fd is not None:
            # A deadline already past still fires (at once): 0 is the only "disarm" value.
            _settime(self._fd, max(deadline_ns, 1), self._setting)
            return
        if self._handle is not None:
            self._handle.cancel()
        delay_s = (deadline_ns - time.monotonic_ns()) / 1e9
        self._handle = self._loop.call_at(self._loop.time() + delay_s, self._fire)

    def cancel(self) -> None:
        self.deadline_ns = None
        if self._fd is not None:
            _settime(self._fd, 0, self._setting)
        elif self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        self.cancel()
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._finalizer()
            self._fd = None

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        fd = _timerfd()
        if fd is None:
            return
        try:
            loop.add_reader(fd, self._fire)
        except (NotImplementedError, RuntimeError):
            os.close(fd)
            return
        self._fd = fd
        # A batcher dropped without close() still gives its descriptor back.
        self._finalizer = weakref.finalize(self, os.close, fd)

    def _fire(self) -> None:
        if self._fd is not None:
            try:
                os.read(self._fd, 8)
            except BlockingIOError:       # re-armed or cancelled after it became readable
                return
        self._handle = None
        self.deadline_ns = None
        self._callback()
