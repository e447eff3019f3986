"""Triton's system shared memory extension: regions a client registers by POSIX shm key, and
the inputs read from / outputs written to them.

A region is an open file descriptor on ``/dev/shm/<key>`` plus the (offset, byte_size) window
the client registered. Tensor bytes move with ``pread``/``pwrite`` on that descriptor rather
than through an ``mmap``: a client may shrink or truncate its object at any time, and touching
a mapping past the end of the file is a SIGBUS that kills the server, while a short read or
write past the end is only a short count. Every access also re-checks the object's current
size first, so a truncated region is a 400 that names it.

Inputs and outputs name a region with the parameters ``shared_memory_region``,
``shared_memory_byte_size`` and (optional) ``shared_memory_offset``. The codecs leave such an
input's ``data`` as None and mark the request (``InferRequest.shared_memory``): the engine
comes here for marked requests only. ``resolve_inputs`` fills it before the model runs, and
``place_outputs`` writes each output asked for in a region there and leaves its ``data`` None,
which the encoders send as no data (an empty ``raw_output_contents`` entry over gRPC, as Triton
does) and no added parameters: Triton adds none, and perf_analyzer's HTTP client requires
``binary_data_size`` in any output ``parameters`` it finds.

CUDA shared memory needs a GPU and CUDA IPC; on this server its status is empty, its unregister
a no-op (tritonclient's examples call it unconditionally) and its register a clear 400.
"""
from __future__ import annotations

import asyncio
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

from ..backends.python.shm import PREFIX as PYTHON_BACKEND_PREFIX
from ..protocol.datatypes import tensor_from_wire, tensor_wire_buffer
from ..protocol.errors import InvalidArgument, NotFound, TritonError
from ..protocol.types import InferRequest, InferResponse
from ..repository.layout import MAX_NAME_BYTES, fits_file_name

SHM_DIR = "/dev/shm"
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
_SHM_KEYS = (REGION, BYTE_SIZE, OFFSET)
# Above this many bytes a request's region reads/writes leave the event loop.
INLINE_BYTES = 1 << 20


class AlreadyExists(TritonError):
    """Triton's ALREADY_EXISTS: HTTP 400 (tritonserver has no closer code), gRPC ALREADY_EXISTS."""
    status = 400
    grpc_code = "ALREADY_EXISTS"


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    users: int = 0
    retired: bool = False       # unregistered; the fd closes when the last user is done

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer, got {value!r}"[:200])
    return value


def _shm_path(key: Any) -> str:
    """``/dev/shm/<name>`` for a POSIX shm key ``/<name>``; anything that could name another
    file (a '/' inside, '.', '..') or the server's own python-backend segments is refused."""
    if not isinstance(key, str):
        raise InvalidArgument(f"shared memory key must be a string, got {key!r}"[:200])
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name or not fits_file_name(name):
        raise InvalidArgument(
            f"invalid shared memory key '{key[:300]}': a POSIX shared memory key is '/' followed "
            f"by a file name: 1 to {MAX_NAME_BYTES} bytes of UTF-8 without '/'")
    if name.startswith(PYTHON_BACKEND_PREFIX):
        raise InvalidArgument(
            f"shared memory key '{key}' is reserved for the server's python backend")
    return os.path.join(SHM_DIR, name)


class SharedMemoryRegistry:
    """The system shared memory regions clients registered. Thread-safe: the event loop
    registers and looks up, executor threads may read and write concurrently."""

    def __init__(self, max_input_size: int | None = None) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        # Inputs are copied out of their regions: the same bound as a request body's, so that
        # no request makes the server allocate more than the operator allowed.
        self.max_input_size = max_input_size

    # -- the extension's API --------------------------------------------------------------
    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        if not isinstance(name, str) or not name or not fits_file_name(name):
            raise InvalidArgument(f"shared memory region name must be 1 to {MAX_NAME_BYTES} "
                                  f"bytes of UTF-8 text")
        offset = _uint(offset, f"'offset' of shared memory region '{name}'")
        byte_size = _uint(byte_size, f"'byte_size' of shared memory region '{name}'")
        path = _shm_path(key)
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            try:
                # no symlink out of /dev/shm; a FIFO planted there must not block the loop
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as err:
                raise InvalidArgument(
                    f"Unable to open shared memory region: '{key}' ({err.strerror})") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(
                        f"Unable to open shared memory region: '{key}' (not a shared memory object)")
                if offset + byte_size > st.st_size:
                    raise InvalidArgument(
                        f"failed to register shared memory region '{name}': invalid args: offset "
                        f"{offset} + byte_size {byte_size} is past the end of the {st.st_size}-byte "
                        f"shared memory object '{key}'")
            except BaseException:
                os.close(fd)
                raise
            self._regions[name] = _Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str = "") -> None:
        """One region, or every region when ``name`` is empty; an unknown name is no error
        (as in Triton, so clients can unregister blindly before they start)."""
        with self._lock:
            names = [name] if name else list(self._regions)
            for n in names:
                region = self._regions.pop(n, None)
                if region is not None:
                    region.retired = True
                    if region.users == 0:
                        os.close(region.fd)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
            if region is None:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            return [region.status()]

    # -- CUDA: no device here ----------------------------------------------------------------
    def cuda_register(self, name: str, *_: Any) -> None:
        raise InvalidArgument(
            f"failed to register CUDA shared memory region: '{name}', GPUs not supported: this "
            "server has no CUDA shared memory; use system shared memory")

    def cuda_unregister(self, name: str = "") -> None:
        """Nothing is ever registered, so there is nothing to unregister."""

    def cuda_status(self, name: str = "") -> list[dict[str, Any]]:
        if name:
            raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
        return []

    # -- tensor bytes ------------------------------------------------------------------------
    def check(self, name: Any, offset: int, byte_size: int) -> None:
        """That ``[offset, offset + byte_size)`` lies inside the registered region ``name``, and
        inside its object as it is now (before a model runs for a result nobody could store)."""
        region = self._acquire(name, offset, byte_size)
        try:
            self._checked_start(region, offset, byte_size)
        finally:
            self._release(region)

    def read(self, name: str, offset: int, byte_size: int) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` in region ``name``."""
        region = self._acquire(name, offset, byte_size)
        try:
            start = self._checked_start(region, offset, byte_size)
            out = bytearray(byte_size)
            view = memoryview(out)
            done = 0
            while done < byte_size:
                n = os.preadv(region.fd, [view[done:]], start + done)
                if n <= 0:
                    raise self._truncated(region, start + done)
                done += n
            return out
        finally:
            self._release(region)

    def write(self, name: str, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        region = self._acquire(name, offset, view.nbytes)
        try:
            start = self._checked_start(region, offset, view.nbytes)
            done = 0
            while done < view.nbytes:
                done += os.pwrite(region.fd, view[done:], start + done)
        finally:
            self._release(region)

    def _acquire(self, name: Any, offset: int, byte_size: int) -> _Region:
        with self._lock:
            region = self._regions.get(name) if isinstance(name, str) else None
            if region is None:
                raise InvalidArgument(f"Unable to find shared memory region: '{name}'")
            if offset > region.byte_size or (offset == region.byte_size and byte_size):
                raise InvalidArgument(f"Invalid offset for shared memory region: '{name}'")
            if offset + byte_size > region.byte_size:
                raise InvalidArgument(
                    f"Invalid offset + byte size for shared memory region: '{name}' (offset "
                    f"{offset} + byte size {byte_size} > region size {region.byte_size})")
            region.users += 1
            return region

    def _release(self, region: _Region) -> None:
        with self._lock:
            region.users -= 1
            if region.retired and region.users == 0:
                os.close(region.fd)

    def _checked_start(self, region: _Region, offset: int, byte_size: int) -> int:
        start = region.offset + offset
        if os.fstat(region.fd).st_size < start + byte_size:
            raise self._truncated(region, start + byte_size)
        return start

    @staticmethod
    def _truncated(region: _Region, needed: int) -> InvalidArgument:
        size = os.fstat(region.fd).st_size
        return InvalidArgument(
            f"shared memory region '{region.name}' (key '{region.key}') is now {size} bytes, "
            f"fewer than the {needed} it needs: the object was truncated after it was registered")


# -- requests ------------------------------------------------------------------------------

def _placement(params: dict[str, Any], what: str) -> tuple[str, int, int]:
    region = params.get(REGION)
    if not isinstance(region, str):
        raise InvalidArgument(f"'{REGION}' of {what} must be a string, got {region!r}"[:200])
    if BYTE_SIZE not in params:
        raise InvalidArgument(
            f"{what} sets '{REGION}' without '{BYTE_SIZE}': both are required")
    size = _uint(params[BYTE_SIZE], f"'{BYTE_SIZE}' of {what}")
    offset = _uint(params.get(OFFSET, 0), f"'{OFFSET}' of {what}")
    return region, offset, size


async def resolve_inputs(request: InferRequest, registry: SharedMemoryRegistry) -> None:
    """Fill every shared-memory input's data from its region (a copy: the client may rewrite
    the region while the model runs), and check every shared-memory output's region before
    anything runs."""
    reads = []
    for t in request.inputs:
        if REGION in t.parameters:
            reads.append((t, *_placement(t.parameters, f"input '{t.name}'")))
    for o in request.outputs or ():
        if REGION in o.parameters:
            if o.parameters.get("classification"):
                raise InvalidArgument(
                    f"output '{o.name}' asks for classification and shared memory; a "
                    "classification output cannot be placed in shared memory")
            registry.check(*_placement(o.parameters, f"output '{o.name}'"))
    if not reads:
        return
    total = sum(r[3] for r in reads)
    cap = registry.max_input_size
    if cap is not None and total > cap:
        raise InvalidArgument(
            f"the inputs of this request in shared memory total {total} bytes, more than the "
            f"maximum input size of {cap} bytes (--http-max-input-size)")

    def load() -> None:
        for t, region, offset, size in reads:
            t.data = tensor_from_wire(registry.read(region, offset, size), t.datatype, t.shape,
                                      t.name, request.model_name)
            t.parameters = {k: v for k, v in t.parameters.items() if k not in _SHM_KEYS}

    if total > INLINE_BYTES:
        await asyncio.get_running_loop().run_in_executor(None, load)
    else:
        load()


async def place_outputs(response: InferResponse, request: InferRequest,
                        registry: SharedMemoryRegistry) -> None:
    """Write each output the request asked for in a region into it; its data becomes None."""
    wanted = {o.name: o.parameters for o in request.outputs or () if REGION in o.parameters}
    if not wanted:
        return
    writes = []
    for t in response.outputs:
        params = wanted.get(t.name)
        if params is None:
            continue
        region, offset, size = _placement(params, f"output '{t.name}'")
        buf = tensor_wire_buffer(t.data, t.datatype)
        nbytes = memoryview(buf).nbytes
        if nbytes > size:
            raise InvalidArgument(
                f"shared memory size specified with the request for output '{t.name}' ({size} "
                f"bytes) should be at least {nbytes} bytes to hold the results")
        writes.append((t, region, offset, buf, nbytes))

    def store() -> None:
        for t, region, offset, buf, nbytes in writes:
            registry.write(region, offset, buf)
            t.data = None

    if sum(w[4] for w in writes) > INLINE_BYTES:
        await asyncio.get_running_loop().run_in_executor(None, store)
    else:
        store()


__all__ = ["SharedMemoryRegistry", "AlreadyExists", "resolve_inputs", "place_outputs"]
