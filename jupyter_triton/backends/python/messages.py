"""The python worker's wire: what the server and a worker process say to each other.

Both ends import this module and nothing else of each other: ``worker.py`` is the server's
end (start, send, receive, timeouts, death), ``worker_main.py`` the worker's (the stub
host). A message is a 4-byte little-endian length, then a pickle of a tuple of plain values
whose first item is its kind (classes cost several times more to pickle, on the path every
batch takes). A tensor is (name, dtype, shape, offset, nbytes) in a shared-memory region.

    server -> worker  ("start", job, model_py, payload, blas_threads, environ, cwd)   first
                      ("x", in_region, out_region, [meta])   one batch; meta is a list of tensors,
                      or (tensors, id, correlation id, parameters, output names, flags)
                      ("o", region | None)   the bigger output region asked for (None: no room)
                      ("r",)   release every mapped region     ("f",)   finalize and leave
                      ("xd", in_region, [meta], [key])   a decoupled model's batch
                      ("cr", id, cancelled)   ("br", id, ...)   ("mr", id, ok, result)
                      ("ar", id, region | None)   answers to the worker's questions
                      ("af", name)   the worker may let go of a region it was lent
    worker -> server  ("ready", pid)  ("ok", config)  ("error", StubError tuple)
                      ("res", [tensors | (code, msg)])  ("grow", nbytes)  ("r",)  ("done",)
                      ("xdone",)   a decoupled execute returned
                      ("d", key, {name: array} | None, (code, msg) | None, final)   one response
                      ("cq", id, key)   is request ``key`` cancelled?   ("b", id, ...) a BLS call
                      ("bx", id)   a BLS stream the model dropped   ("m", id, op, args)   a metric
                      ("a", id, nbytes)   lend me a region    ("af", name)   done with a lent one

Either side may send at any time. Decoupled responses and BLS calls carry small tensors
inside the message and large ones (past ``SHM_MESSAGE_BYTES``) in a region lent for that
message: ("a", id, nbytes) -> ("ar", id, name) when the worker sends, ("af", name) once the
worker has read what the server sent. The server creates and unlinks every region, so a
worker that dies leaks nothing.

A model's ``pb_utils.Logger`` lines travel on the worker's stderr (read by the server at
once, where the socket is read only while a batch runs), marked with ``LOGGER_MARK``.
"""
from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_LEN = struct.Struct("<I")
READ_CHUNK = 1 << 16

#: the first message, server -> worker
START = "start"
#: worker -> server messages that are not answers to the server's own request: BLS calls,
#: metrics, loans (the server's reader, or the thread that waits for a batch, hands them on)
SIDE = frozenset({"b", "bx", "m", "a", "af"})
#: server -> worker messages that answer a waiter in the worker rather than start work
REPLIES = frozenset({"o", "cr", "br", "mr", "ar"})

#: tensors of one message past this size travel in a shared-memory region, not the socket
SHM_MESSAGE_BYTES = 1 << 20

#: how a ``pb_utils.Logger`` line is told from a model's own stderr
LOGGER_MARK = "\x1b[jt-model-log]"


def payload_bytes(tensors: dict) -> int:
    return sum(a.nbytes if a.dtype.kind != "O" else 64 * a.size for a in tensors.values())


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
        chunk = os.read(self.fd, max(READ_CHUNK, need))
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
