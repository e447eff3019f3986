"""The python worker's wire: what the server and a worker process say to each other.

Both ends import this module and nothing of each other: ``worker.py`` is the server's end
(start, send, receive, timeouts, death), ``worker_main.py`` the worker's (the stub host).
Every message is one of the ``NamedTuple`` classes below. On the socket it is a fixed
header, a 4-byte little-endian length and a 1-byte kind, then a pickle of its fields as a
plain tuple: a class in the pickle would cost several microseconds more per message to
write and to read, on the path every batch takes (benchmarks/results/notes-backends.md);
the kind byte gives the class back for the price of ``tuple.__new__``. A tensor is
(name, dtype, shape, offset, nbytes) in a shared-memory region.

One batch is ``Execute`` -> ``Results`` (or ``Failed``; ``Grow`` -> ``OutputRegion``
first when the outputs do not fit), a decoupled one ``ExecuteDecoupled`` -> ``Response``...
and ``DecoupledReturned``. Either side may send at any time: the worker asks
(``CancelQuery``, ``BlsCall``, ``Metric``, ``LoanAsk``) and the server answers with the
message whose first field is the asking id. Decoupled responses and BLS calls carry small
tensors inside the message and large ones (past ``SHM_MESSAGE_BYTES``) in a region lent for
that message: ``LoanAsk`` -> ``LoanReply`` when the worker sends, ``LoanDone`` once the worker
has read what the server sent. The server creates and unlinks every region, so a worker that
dies leaks nothing.

The worker runs the model's code, which may write anything on its socket: the server loads a
worker's pickles with an allow-list of the globals the protocol carries (those a numpy array
or scalar pickles as), and a message that names anything else, has a kind nobody sends or
the wrong fields is a ``ProtocolError``, never an object built in the server. The worker
loads the server's messages as they are.

A model's ``pb_utils.Logger`` lines travel on the worker's stderr (read by the server at
once, where the socket is read only while a batch runs), marked with ``LOGGER_MARK``.
"""
from __future__ import annotations

import io
import os
import pickle
import select
import struct
import time
from typing import Any, NamedTuple

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<IB")
READ_CHUNK = 1 << 16
_BY_KIND: dict[int, type] = {}


def _kind(code: int):
    def register(cls: type) -> type:
        cls.KIND = code
        _BY_KIND[code] = cls
        return cls
    return register


# ------------------------------------------------------------------- server -> worker

@_kind(1)
class Start(NamedTuple):
    """The first message: what to do, and the server's environment and folder now (a worker
    forked from the template would otherwise have those of when the template started)."""
    job: str                 # "serve" (payload: Triton's args) or "auto_complete"
    model_py: str
    payload: Any             # "auto_complete": (module name, config JSON)
    blas_threads: int        # 0: the library's or the environment's choice
    environ: dict
    cwd: str
    poll_us: int             # how long to poll for the next batch after a batch of one; 0: don't


@_kind(2)
class Execute(NamedTuple):
    """One batch: each meta is a list of tensors, or (tensors, request id, correlation id,
    parameters JSON, output names or None for all, flags)."""
    in_region: str
    out_region: str
    metas: list


@_kind(3)
class ExecuteDecoupled(NamedTuple):
    in_region: str
    metas: list
    keys: list               # one per request: its ``Response`` messages carry it


@_kind(4)
class OutputRegion(NamedTuple):
    """The bigger output region ``Grow`` asked for (None: no room, the batch fails)."""
    name: str | None


@_kind(5)
class Release(NamedTuple):
    """Unmap every region (the server needs their pages back)."""


@_kind(6)
class Finalize(NamedTuple):
    """Run ``finalize`` and leave."""


@_kind(7)
class CancelReply(NamedTuple):
    call_id: int
    cancelled: bool


@_kind(8)
class BlsReply(NamedTuple):
    """One response of a BLS call; ``key`` is (call id, response number)."""
    key: tuple
    outputs: Any             # {name: array}, ("shm", region, refs), or None
    error: tuple | None      # (pb_utils code, message)
    final: bool


@_kind(9)
class MetricReply(NamedTuple):
    call_id: int
    ok: bool
    result: Any


@_kind(10)
class LoanReply(NamedTuple):
    call_id: int
    region: str | None       # None: no room in /dev/shm, the socket carries the tensors


# ------------------------------------------------------------------- worker -> server

@_kind(20)
class Ready(NamedTuple):
    pid: int


@_kind(21)
class AutoCompleted(NamedTuple):
    config: dict


@_kind(22)
class Failed(NamedTuple):
    error: tuple             # StubError.to_tuple()


@_kind(23)
class Results(NamedTuple):
    """A batch's outputs: per request, tensors in the output region, or (code, message)."""
    items: list


@_kind(24)
class Grow(NamedTuple):
    nbytes: int


@_kind(25)
class Released(NamedTuple):
    pass


@_kind(26)
class Finalized(NamedTuple):
    pass


@_kind(27)
class DecoupledReturned(NamedTuple):
    """A decoupled model's execute returned (its responses may still come)."""


@_kind(28)
class Response(NamedTuple):
    """One response of a decoupled request."""
    key: int
    outputs: Any             # {name: array}, ("shm", region, refs), or None
    error: tuple | None
    final: bool


@_kind(29)
class CancelQuery(NamedTuple):
    call_id: int
    key: int


@_kind(30)
class BlsCall(NamedTuple):
    call_id: int
    decoupled: bool
    spec: tuple              # stub.bls_spec, its inputs possibly ("shm", region, refs)


@_kind(31)
class BlsDropped(NamedTuple):
    """The model dropped a BLS stream before its end: cancel it."""
    call_id: int


@_kind(32)
class Metric(NamedTuple):
    call_id: int             # 0: no answer wanted
    op: str
    args: tuple


@_kind(33)
class LoanAsk(NamedTuple):
    call_id: int
    nbytes: int


@_kind(34)
class LoanDone(NamedTuple):
    region: str


#: worker -> server messages that are not answers to the server's own request (the server's
#: reader, or the thread that waits for a batch, hands them on)
SIDE = frozenset({BlsCall, BlsDropped, Metric, LoanAsk, LoanDone})
#: server -> worker messages that answer a waiter in the worker (by their first field, the
#: asking id; ``OutputRegion`` answers the one batch in flight)
REPLIES = frozenset({OutputRegion, CancelReply, BlsReply, MetricReply, LoanReply})

#: tensors of one message past this size travel in a shared-memory region, not the socket
SHM_MESSAGE_BYTES = 1 << 20

#: how a ``pb_utils.Logger`` line is told from a model's own stderr
LOGGER_MARK = "\x1b[jt-model-log]"


def payload_bytes(tensors: dict) -> int:
    return sum(a.nbytes if a.dtype.kind != "O" else 64 * a.size for a in tensors.values())


_new = tuple.__new__


class ProtocolError(Exception):
    """A message the protocol does not carry (from a worker: a model that wrote on its socket)."""


#: the globals a worker's message may name: what numpy arrays (object arrays too) and numpy
#: scalars pickle as, in numpy 2's spelling and numpy 1's (a packed environment may hold either)
ALLOWED_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
})


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise ProtocolError(f"the message names {module}.{name}, which the protocol does not carry")
        return super().find_class(module, name)


def _loads_allowed(data: bytes) -> Any:
    return _AllowListUnpickler(io.BytesIO(data)).load()


class Channel:
    """Length-prefixed pickles over one socket, with raw ``os.read``/``os.write`` (no
    ``multiprocessing.Connection`` layers, no selector built per wait). The server's end
    loads what it reads through the allow-list; ``trust_peer`` (the worker's end) loads the
    server's messages as they are."""

    def __init__(self, fd: int, trust_peer: bool = False) -> None:
        self.fd = fd
        self._loads = pickle.loads if trust_peer else _loads_allowed
        self._buf = bytearray()
        self._ready: Any = None    # a poll object on fd, made at the first _poll

    def send(self, msg: Any) -> None:
        data = pickle.dumps(tuple(msg), protocol=5)
        frame = _HEAD.pack(len(data) + 1, msg.KIND) + data
        sent = os.write(self.fd, frame)
        while sent < len(frame):   # a full socket buffer: the rest, as it drains
            sent += os.write(self.fd, memoryview(frame)[sent:])

    def take(self) -> Any:
        """The next whole message already read, or ``None``; ``ProtocolError`` for one the
        protocol does not carry (the frame is dropped: the next one reads as it should)."""
        buf = self._buf
        if len(buf) < 4:
            return None
        end = 4 + _LEN.unpack_from(buf)[0]
        if len(buf) < end:
            return None
        cls = _BY_KIND.get(buf[4]) if end > 4 else None
        data = bytes(buf[5:end])
        del buf[:end]
        if cls is None:
            raise ProtocolError("a message of a kind nobody sends")
        try:
            fields = self._loads(data)
        except ProtocolError:
            raise
        except Exception as err:
            raise ProtocolError(f"a {cls.__name__} message that does not load: {err}") from None
        if type(fields) is not tuple or len(fields) != len(cls._fields):
            raise ProtocolError(f"a {cls.__name__} message without its {len(cls._fields)} fields")
        return _new(cls, fields)

    def fill(self) -> bool:
        """One read; False at end-of-file."""
        need = 4 + _LEN.unpack_from(self._buf)[0] - len(self._buf) if len(self._buf) >= 4 else 0
        chunk = os.read(self.fd, max(READ_CHUNK, need))
        if not chunk:
            return False
        self._buf += chunk
        return True

    def recv(self, poll_until: float = 0.0) -> Any:
        """Blocking; ``EOFError`` when the other end is gone. Until ``poll_until``
        (``time.monotonic()``) it polls the socket before it sleeps (busy polling: a core
        that sleeps is slow to wake on a virtual machine, several times a request)."""
        while True:
            msg = self.take()
            if msg is not None:
                return msg
            if poll_until:
                self._poll(poll_until)
                poll_until = 0.0
            if not self.fill():
                raise EOFError

    def _poll(self, until: float) -> None:
        ready = self._ready
        if ready is None:
            ready = self._ready = select.poll()
            ready.register(self.fd, select.POLLIN)
        while not ready.poll(0) and time.monotonic() < until:
            os.sched_yield()   # a runnable task on this core (the server, a client) goes first
