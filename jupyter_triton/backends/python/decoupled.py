"""Decoupled models (``model_transaction_policy { decoupled: true }``): ``execute`` returns
None and the model answers through ``request.get_response_sender()``, zero or more responses
per request, from any thread, also after execute has returned, until
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``.

``Sink`` is one request's way back to the engine's ``ResponseSender``; ``ThreadHost`` writes
a thread-mode model's responses straight to the sinks; ``DecoupledWorker`` is the worker
process of such a model, whose reader thread owns its socket (its responses come after
execute has returned) and hands each response to its request's sink.
"""
from __future__ import annotations

import itertools
import logging
import queue
import select
import threading
import time
from typing import Any, Protocol

from ...protocol.errors import DeadlineExceeded, TritonError, Unavailable
from ..base import ResponseSender, Tensors
from . import triton_python_backend_utils as pb_utils
from .messages import (SIDE, CancelQuery, CancelReply, DecoupledReturned, ExecuteDecoupled, ProtocolError,
                       Response)
from .stub import ModelStub, OrphanCloser, RequestData, ResponseError
from .worker import WorkerDied, WorkerProcess, WorkerTimeout, describe_exit, filled, unexpected

log = logging.getLogger(__name__)

_ALIVE = object()
_DIED = ("died",)


class SinkOwner(Protocol):
    """What a sink reads of the instance whose request it answers (``backend.PythonBackend``,
    which imports this module): its name in messages, how it turns a model's error into a
    Triton one, and its thread mode's open sinks (a final response takes its sink off)."""
    _thread_sinks: set[Sink]

    @property
    def _who(self) -> str: ...

    def _response(self, result: ResponseError, request: None) -> Tensors | TritonError: ...


class Sink:
    """One decoupled request's way back to the engine's ``ResponseSender``: tensors cut to
    the requested outputs, errors given their Triton status, closed once."""

    __slots__ = ("backend", "sender", "wanted", "closed", "_lock")

    def __init__(self, backend: SinkOwner, sender: ResponseSender, wanted: list[str]) -> None:
        self.backend = backend
        self.sender = sender
        self.wanted = wanted
        self.closed = False
        self._lock = threading.Lock()

    def deliver(self, outputs: dict | None, error: tuple[int, str] | None, final: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = final
        err = None
        if error is not None:
            err = self.backend._response(ResponseError(*error), None)
            outputs = None
        elif outputs is not None:
            wanted = self.wanted
            outputs = {n: v for n, v in outputs.items() if not wanted or n in wanted}
        self._send(outputs, err, final)

    def fail(self, kind: str, message: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        cls = DeadlineExceeded if kind == "timeout" else Unavailable
        self._send(None, cls(f"{self.backend._who}: {message}"), True)

    def cancelled(self) -> bool:
        try:
            return bool(self.sender.is_cancelled())
        except Exception:
            return True

    def _send(self, outputs: dict | None, error: TritonError | None, final: bool) -> None:
        try:
            self.sender.send(outputs, error=error, final=final)
        except TritonError as err:   # the engine closed it first (its own error, a cancel)
            log.debug("%s: response not delivered: %s", self.backend._who, err)
        if final:
            self.backend._thread_sinks.discard(self)


class ThreadHost:
    """Thread mode's ``DecoupledHost``: the stub's senders write straight to the sinks."""

    def __init__(self, sinks: list[Sink], orphans: OrphanCloser) -> None:
        self.sinks = sinks
        self._orphans = orphans

    def respond(self, key: int, response: "pb_utils.InferenceResponse | None", final: bool) -> None:
        if response is None:
            self.sinks[key].deliver(None, None, final)
            return
        data = ModelStub.response_data(response)
        if isinstance(data, ResponseError):
            self.sinks[key].deliver(None, (data.code, data.message), final)
        else:
            self.sinks[key].deliver(data, None, final)

    def cancelled(self, key: int) -> bool:
        return self.sinks[key].cancelled()

    def orphaned(self, key: int) -> None:
        self._orphans.put(self.sinks[key])

    def flush(self) -> None:
        pass


class DecoupledWorker(WorkerProcess):
    """A decoupled model's worker process: once it is ready, a reader thread reads its
    socket, delivers responses to their sinks, and queues what answers the server's own
    requests (``_recv``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._exitcode: Any = _ALIVE
        self._sinks: dict[int, Any] = {}
        self._keys = itertools.count(1)

    def wait_ready(self, timeout: float | None = None) -> None:
        super().wait_ready(timeout)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"triton-python-reader-{self.label}")
        self._reader.start()

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
        self._send(ExecuteDecoupled(self._in.name if self._in is not None else "", metas, keys))
        msg = self._recv("execute", timeout)
        if type(msg) is not DecoupledReturned:
            raise unexpected(msg)

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
                try:
                    msg = chan.take()
                except ProtocolError as err:
                    self.refuse(err)
                    break
                if msg is not None:
                    kind = type(msg)
                    if kind is Response:
                        key, outputs, error, final = msg
                        if type(outputs) is tuple:
                            outputs = self.loans.take(outputs)
                        sink = sinks.pop(key, None) if final else sinks.get(key)
                        if sink is not None:
                            sink.deliver(outputs, error, final)
                    elif kind is CancelQuery:
                        sink = sinks.get(msg.key)
                        self._send(CancelReply(msg.call_id, True if sink is None else sink.cancelled()))
                    elif kind in SIDE:
                        self._side_message(msg)
                    else:
                        replies.put(msg)
                    continue
                if not filled(chan, poll.poll()):
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

    def _recv(self, what: str, timeout: float | None = None, deadline: float | None = None) -> Any:
        if self._reader is None:     # initialize (the reader starts after it), or closed
            return super()._recv(what, timeout, deadline)
        if deadline is None and timeout:
            deadline = time.monotonic() + timeout
        if self._exitcode is not _ALIVE:
            raise WorkerDied(self._exitcode, self.refused)
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
            raise WorkerDied(self._exitcode, self.refused)
        return msg
