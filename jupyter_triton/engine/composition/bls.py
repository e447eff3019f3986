"""BLS (business logic scripting): a model calling other models through the server's engine.

``Bls`` is the engine's; ``Bls.for_model(name)`` is what each backend instance of one
model gets as ``Backend.server_calls`` (``backends.base.ServerCalls``): blocking ``infer`` and
``infer_stream``, called from the model's thread (never the event loop), each running
``Engine.infer`` / ``Engine.infer_stream`` on the loop; beside them, the engine's
``model_logs`` and ``custom_metrics``, where the model's own lines and metrics go. A BLS
request is a request like any other: it reaches any served model and ensembles, and is
counted in the called model's statistics, as Triton counts it.

Two bounds keep a model from hurting the server:

* depth: a request made by a model executing a request of depth ``d`` has depth ``d + 1``
  (``InferRequest.bls_depth``); past ``MAX_BLS_DEPTH`` the call fails with InvalidArgument
  naming the chain (a model that calls itself, two models calling each other);
* in flight: at most ``MAX_BLS_IN_FLIGHT`` calls of one calling model at a time; the next one
  fails at once with Unavailable, so a call storm is refused instead of queued without end.

The depth of the request a model is executing is known from the instance thread that runs
it (``executing``, set by ``engine/batching/instances.py`` around each execute) and from the BLS
request itself (a worker process passes ``bls_depth`` on), whichever is deeper.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from typing import TYPE_CHECKING

from ...protocol.errors import DeadlineExceeded, Internal, InvalidArgument, TritonError, Unavailable
from ...protocol.types import InferRequest, InferResponse
from ..observation.trace import bls_parent

if TYPE_CHECKING:
    from .. import Engine

MAX_BLS_DEPTH = 8
MAX_BLS_IN_FLIGHT = 64
#: responses a BLS stream holds for a model that reads slower than its callee answers
STREAM_BUFFER = 256

#: per instance thread: the requests of the batch it executes (``requests``), and the model
executing = threading.local()

_END = object()


class Bls:
    """The engine's side of BLS: hands each model its own ``ModelCalls``."""

    def __init__(self, engine: "Engine", max_depth: int = MAX_BLS_DEPTH,
                 max_in_flight: int = MAX_BLS_IN_FLIGHT) -> None:
        self.engine = engine
        self.max_depth = max_depth
        self.max_in_flight = max_in_flight

    def for_model(self, caller: str) -> "ModelCalls":
        """The ``ServerCalls`` of model ``caller``; call on the engine's loop (it is the loop
        every call runs on)."""
        return ModelCalls(self, caller, asyncio.get_running_loop())


class ModelCalls:
    """``ServerCalls`` for the instances of one calling model."""

    def __init__(self, bls: Bls, caller: str, loop: asyncio.AbstractEventLoop) -> None:
        self._bls = bls
        self.caller = caller
        self._loop = loop
        self._lock = threading.Lock()
        self.in_flight = 0
        self.model_logs = bls.engine.model_logs
        self.custom_metrics = bls.engine.custom_metrics

    # -- ServerCalls ----------------------------------------------------------------------

    def infer(self, request: InferRequest, timeout_s: float | None = None) -> InferResponse:
        self._admit(request)
        try:
            future = self._submit(self._bls.engine.infer(request), request)
            try:
                return future.result(timeout_s)
            except concurrent.futures.TimeoutError:
                future.cancel()          # the called request is cancelled, not left running
                raise self._deadline(request, timeout_s) from None
            except concurrent.futures.CancelledError:
                raise Unavailable(f"BLS request from model '{self.caller}' to model "
                                  f"'{request.model_name}' was cancelled") from None
        finally:
            self._release()

    def infer_stream(self, request: InferRequest, timeout_s: float | None = None
                     ) -> "BlsStream":
        """The callee's responses as they come; the last has ``final``. Closing the iterator
        early cancels the called request. ``timeout_s`` bounds the whole stream."""
        self._admit(request)
        try:
            items: queue.SimpleQueue = queue.SimpleQueue()
            room = _Room(self._loop, STREAM_BUFFER)
            future = self._submit(self._pump(request, items, room), request)
        except BaseException:
            self._release()
            raise
        return self._read(request, items, room, future, timeout_s)

    # -- inside ---------------------------------------------------------------------------

    def _admit(self, request: InferRequest) -> None:
        """Depth and in-flight bounds; takes an in-flight slot (``_release`` gives it back)."""
        if _on_loop(self._loop):
            raise Internal(f"model '{self.caller}': a BLS call blocks, so it cannot be made "
                           f"from the server's event loop")
        parents = getattr(executing, "requests", None) or ()
        parent_depth = max((r.bls_depth for r in parents), default=0)
        parent_chain = next((getattr(r, "bls_chain", ()) for r in parents
                             if r.bls_depth == parent_depth), ())
        if parents and request.bls_depth <= parent_depth:
            request.bls_depth = parent_depth + 1
        elif not request.bls_depth:
            request.bls_depth = 1
        chain = tuple(parent_chain or ()) + (self.caller,)
        request.bls_chain = chain       # type: ignore[attr-defined]  (never on the wire)
        request.trace_parent = bls_parent(parents) or getattr(request, "trace_parent", None)  # type: ignore[attr-defined]  (engine/observation/trace.py)
        if request.bls_depth > self._bls.max_depth:
            raise InvalidArgument(
                f"BLS request to model '{request.model_name}' is nested {request.bls_depth} "
                f"calls deep, more than the limit of {self._bls.max_depth} (a model calling "
                f"itself, or models calling each other?): "
                f"{' -> '.join(chain + (request.model_name,))}")
        with self._lock:
            if self.in_flight >= self._bls.max_in_flight:
                raise Unavailable(
                    f"model '{self.caller}' already has {self.in_flight} BLS requests in flight "
                    f"(the limit is {self._bls.max_in_flight}); the request to model "
                    f"'{request.model_name}' is refused")
            self.in_flight += 1

    def _submit(self, coro, request: InferRequest) -> concurrent.futures.Future:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:          # the server's loop has closed: it is shutting down
            coro.close()
            raise Unavailable(f"BLS request from model '{self.caller}' to model "
                              f"'{request.model_name}': the server is shutting down") from None

    def _release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _deadline(self, request: InferRequest, timeout_s: float | None) -> DeadlineExceeded:
        return DeadlineExceeded(f"BLS request from model '{self.caller}' to model "
                                f"'{request.model_name}' timed out after {timeout_s:g} s")

    async def _pump(self, request: InferRequest, items: queue.SimpleQueue,
                    room: "_Room") -> None:
        """On the loop: the callee's responses into ``items``; an error or the end last."""
        try:
            async for response in self._bls.engine.infer_stream(request):
                await room.take()       # the calling model reads slower: wait for it
                items.put(response)
        except asyncio.CancelledError:
            items.put(Unavailable(f"BLS stream from model '{self.caller}' to model "
                                  f"'{request.model_name}' was cancelled"))
            raise
        except BaseException as err:
            items.put(err)
            if not isinstance(err, Exception):
                raise
        else:
            items.put(_END)

    def _read(self, request: InferRequest, items: queue.SimpleQueue, room: "_Room",
              future: concurrent.futures.Future, timeout_s: float | None) -> "BlsStream":
        return BlsStream(self, request, items, room, future, timeout_s)


class BlsStream:
    """The calling model's end of a BLS stream: an iterator of responses. ``close()`` (or
    dropping it) cancels the called request and gives the in-flight slot back, also when
    it was never read (a generator's ``finally`` would not run then)."""

    def __init__(self, calls: ModelCalls, request: InferRequest, items: queue.SimpleQueue,
                 room: "_Room", future: concurrent.futures.Future,
                 timeout_s: float | None) -> None:
        self._calls = calls
        self._request = request
        self._items = items
        self._room = room
        self._future = future
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._closed = False

    def __iter__(self) -> "BlsStream":
        return self

    def __next__(self) -> InferResponse:
        if self._closed:
            raise StopIteration
        try:
            item = self._items.get(timeout=None if self._deadline is None
                                   else max(0.0, self._deadline - time.monotonic()))
        except queue.Empty:
            self.close()
            raise self._calls._deadline(self._request, self._timeout_s) from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            if isinstance(item, TritonError):
                raise item
            raise Internal(f"BLS stream to model '{self._request.model_name}' failed: "
                           f"{type(item).__name__}: {item}")
        self._room.release()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._future.done():
            self._future.cancel()      # the caller stopped reading: cancel the called request
        self._calls._release()

    def __del__(self) -> None:
        self.close()


class _Room:
    """Responses a BLS stream may hold for its reader: taken on the loop (waiting when
    none is left), given back by the reading model's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self._loop = loop
        self._free = size
        self._lock = threading.Lock()
        self._wake = asyncio.Event()

    async def take(self) -> None:
        while True:
            with self._lock:
                if self._free:
                    self._free -= 1
                    return
                self._wake.clear()
            await self._wake.wait()

    def release(self) -> None:
        with self._lock:
            self._free += 1
            waiting = not self._wake.is_set()
        if waiting:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass            # the loop has closed: nobody waits any more


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


__all__ = ["Bls", "BlsStream", "ModelCalls", "MAX_BLS_DEPTH", "MAX_BLS_IN_FLIGHT", "executing"]
