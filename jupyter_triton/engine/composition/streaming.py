"""Decoupled models: the responses of one request travel from the model's response sender
(any thread, any time until the final flag) to the engine's async iterator (the loop).

A ``ResponseStream`` is both ends. The model side is Triton's response sender
(``backends.base.ResponseSender``): each ``send`` builds the response as ``Engine.infer``
would (requested outputs, datatypes, classification, ``max_output_size``), records its
``response_stats`` entry, and hands it to the loop with one ``call_soon_threadsafe``. The loop
side is read by ``ModelVersion.infer_stream`` until the final response.

A sender that outruns its reader is held back: past ``max_buffered`` responses not yet read,
``send`` blocks its (model) thread until the reader catches up, so a fast model and a slow
client cannot grow the server's memory without end. ``send`` from the event loop's own thread
never blocks (it would wait for itself); there the bound is only counted, and a sender on
the loop (an ensemble's steps) awaits ``room()`` instead.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ...protocol.errors import Internal, InvalidArgument, TritonError, Unavailable
from ...protocol.types import InferRequest, InferResponse

if TYPE_CHECKING:
    from ..observation.statistics import ModelStatistics

#: responses a stream buffers before its sender waits for the reader
DEFAULT_MAX_BUFFERED = 256
#: requests of one decoupled model version open at once (parameter max_open_streams)
DEFAULT_MAX_OPEN_STREAMS = 4096
#: how long a sender waits for a stalled reader before the response fails the request
SEND_WAIT_SECONDS = 30.0


_CLOSED = "Unable to send response. Response sender has been closed."


class DecoupledRefused(InvalidArgument):
    """A one-response call (``Engine.infer``) to a decoupled model. Frontends may render it
    with their own prefix ("HTTP end point", "ModelInfer RPC"), as Triton does."""


def decoupled_refusal(model: str, version: int | str) -> DecoupledRefused:
    return DecoupledRefused(
        f"inference end point doesn't support models with decoupled transaction policy "
        f"(model '{model}' version {version}); use a streaming end point (gRPC "
        f"ModelStreamInfer, generate_stream)")


class ResponseStream:
    """One request's responses to a decoupled model (a ``ResponseSender`` for the model)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: InferRequest,
                 build: Callable[[InferRequest, dict], InferResponse], stats: "ModelStatistics",
                 start_ns: int, max_buffered: int = DEFAULT_MAX_BUFFERED, version: str = "") -> None:
        self._loop = loop
        self._version = version or request.model_version
        self._request = request
        self._build = build
        self._stats = stats
        self.start_ns = start_ns
        self.max_buffered = max(1, max_buffered)
        # The model's side. _order keeps one sender's responses in order (held while one is
        # built); _state guards the flags and is never held for long, so the loop may take it;
        # _room is where a sender waits for its reader.
        self._order = threading.Lock()
        self._state = threading.Lock()
        self._room = threading.Condition()
        self._closed = False            # final sent, or the engine ended the stream
        self._ended = False             # the engine ended it (close): later sends fail
        self._cancelled = False
        self._index = 0                 # response_stats key of the next response
        self._last_ns = 0               # when the previous response was done (or compute began)
        self._unread = 0                # sent, not yet taken by the reader (under _room)
        # the loop's side
        self._items: deque[InferResponse] = deque()
        self._waiter: asyncio.Future | None = None
        self._room_waiter: asyncio.Future | None = None    # room()'s, on the loop
        self.failed = False             # the final response was an error

    # -- the model's side (ResponseSender) ------------------------------------------------

    def compute_started(self, ns: int) -> None:
        """The instance began executing this request: the first response's compute starts."""
        self._last_ns = ns

    def is_cancelled(self) -> bool:
        return self._cancelled

    def send(self, outputs: dict | None = None, *, error: TritonError | None = None,
             final: bool = False) -> None:
        entered = time.monotonic_ns()
        with self._order:
            with self._state:
                if self._closed:
                    raise InvalidArgument(_CLOSED)
                if final:
                    self._closed = True     # from here on this send owns the stream's end
            if not self._wait_for_room():
                error, outputs = Unavailable(
                    f"model '{self._request.model_name}': the client did not read the stream's "
                    f"responses for {SEND_WAIT_SECONDS:g} s ({self.max_buffered} buffered); "
                    f"the request is ended"), None
                with self._state:
                    final = not self._closed or final
                    self._closed = True
            if self._ended and not final:
                raise InvalidArgument(_CLOSED)   # the engine ended it while this one waited
            index = self._index
            response_start = self._last_ns or self.start_ns
            self._index += 1
            if self._cancelled:
                # nobody reads it any more: counted (Triton's 'cancel') and dropped
                self._stats.record_response(index, "cancel", 0, 0, entered - response_start)
                self._last_ns = entered
                return
            kind = "fail" if error is not None else "success"
            if error is None and outputs is not None:
                try:
                    response = self._build(self._request, outputs)
                except TritonError as err:      # e.g. an output the model did not produce
                    response, kind = self._error_response(err), "fail"
                except Exception as err:        # a model's malformed tensor must not kill it
                    response, kind = self._error_response(Internal(
                        f"model '{self._request.model_name}' sent a response that cannot be "
                        f"built: {type(err).__name__}: {err}")), "fail"
            elif error is not None:
                if not isinstance(error, TritonError):
                    error = Internal(f"{type(error).__name__}: {error}")
                response = self._error_response(error)
            else:
                response, kind = self._error_response(None), "empty"
            response.final = final
            done = time.monotonic_ns()
            if kind == "empty":
                self._stats.record_response(index, "empty", 0, 0, done - response_start)
            else:
                self._stats.record_response(index, kind, entered - response_start,
                                            done - entered, done - response_start)
            if index == 0:
                self._stats.record_first_response(done - self.start_ns)
            self._last_ns = done
            with self._room:
                self._unread += 1
            try:
                self._loop.call_soon_threadsafe(self._put, response)
            except RuntimeError:
                pass            # the loop has closed: nobody reads any more

    def _wait_for_room(self) -> bool:
        """Hold a sender ``max_buffered`` responses ahead of its reader; False past the wait."""
        with self._room:
            if self._unread < self.max_buffered or self._cancelled or self._ended:
                return True
            if _on_loop_thread(self._loop):
                return True     # it would wait for itself
            deadline = time.monotonic() + SEND_WAIT_SECONDS
            while self._unread >= self.max_buffered and not (self._cancelled or self._ended):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(left)
            return True

    def _wake_room(self) -> None:
        waiter = self._room_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def room(self) -> None:
        """Wait, on the loop, while ``max_buffered`` responses are unread; past
        ``SEND_WAIT_SECONDS`` the request fails (Unavailable), as a blocked ``send`` does."""
        deadline = self._loop.time() + SEND_WAIT_SECONDS
        while self._unread >= self.max_buffered and not (self._cancelled or self._ended):
            left = deadline - self._loop.time()
            if left <= 0:
                raise Unavailable(
                    f"model '{self._request.model_name}': the client did not read the stream's "
                    f"responses for {SEND_WAIT_SECONDS:g} s ({self.max_buffered} buffered); "
                    f"the request is ended")
            self._room_waiter = self._loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._room_waiter), left)
            except asyncio.TimeoutError:
                pass
            finally:
                self._room_waiter = None

    def _error_response(self, error: TritonError | None) -> InferResponse:
        request = self._request
        response = InferResponse(request.model_name, self._version, request.id)
        response.error = error
        return response

    # -- the engine's side ------------------------------------------------------------------

    def _put(self, response: InferResponse) -> None:
        self._items.append(response)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> InferResponse:
        """The next response (the loop's side); the last one has ``final`` set."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        response = self._items.popleft()
        with self._room:
            self._unread -= 1
            self._room.notify_all()
        self._wake_room()
        if response.final and response.error is not None:
            self.failed = True
        return response

    def cancel(self) -> None:
        """The reader has gone: the model sees ``is_cancelled()``; later sends are dropped."""
        self._cancelled = True
        with self._room:
            self._room.notify_all()
        self._wake_room()

    def close(self, error: TritonError) -> bool:
        """End the stream with ``error`` unless its final response was already sent (execute
        failed, the worker died, the model was unloaded). True if this ended it. Never
        blocks: it may run on the loop while a sender waits."""
        with self._state:
            if self._closed:
                return False
            self._closed = self._ended = True
        with self._room:
            self._room.notify_all()
        if _on_loop_thread(self._loop):
            self._wake_room()
        response = self._error_response(error)
        response.final = True
        try:
            self._loop.call_soon_threadsafe(self._put, response)
        except RuntimeError:
            pass
        return True

    @property
    def closed(self) -> bool:
        return self._closed


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class CollectingSender:
    """A sender for warmup requests of a decoupled model: keeps the first error, drops the
    rest (warmup has no client)."""

    def __init__(self) -> None:
        self.error: Any = None
        self.closed = False

    def send(self, outputs: dict | None = None, *, error: TritonError | None = None,
             final: bool = False) -> None:
        if self.closed:
            raise InvalidArgument(_CLOSED)
        if error is not None and self.error is None:
            self.error = error
        if final:
            self.closed = True

    def is_cancelled(self) -> bool:
        return False
