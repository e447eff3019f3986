"""Shared-memory regions that carry tensors between the server and a python worker.

The server process creates and unlinks every segment (so a worker that dies leaks
nothing); the worker only attaches. A region is reused for every batch and replaced by a
bigger one when a batch does not fit. Only refs, plain tuples (name, dtype, shape,
offset, size), cross the pipe; the bytes stay in the region. BYTES tensors are stored in
Triton's serialized form (4-byte little-endian length before each element).

Segments are named ``jt_<server pid>_<pid namespace>_<random>``. A server killed with SIGKILL
cannot unlink its own, so every server sweeps, once at its first worker start, the segments
of this user, made in its own pid namespace, whose server pid is no longer alive (a pid means
nothing across namespaces: containers that share /dev/shm never sweep each other's). Every region's pages are reserved when it is created
(``posix_fallocate``): on a full /dev/shm (64 MiB in Docker and Kubernetes by default) that is
an error for the batch that asked, where touching an only ``ftruncate``d page would be a
SIGBUS that kills the whole server.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import threading
from multiprocessing import shared_memory

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

log = logging.getLogger(__name__)

ALIGN = 64
MIN_REGION_BYTES = 1 << 20
PREFIX = "jt_"
BYTES = "BYTES"
SHM_DIR = "/dev/shm"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)_(\d+)_[0-9a-f]+")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:   # no procfs (macOS): names stay short, as its 31-character limit asks
        return 0


_PID_NS = _pid_namespace()


def segment_prefix(pid: int | None = None) -> str:
    return f"{PREFIX}{os.getpid() if pid is None else pid}_{_PID_NS}_"


class SharedMemoryFull(Exception):
    """No room in /dev/shm for a region: the message says how much was asked and is free."""


#: A tensor's place in a region, as it crosses the wire: (name, dtype, shape, offset, nbytes),
#: dtype a numpy ``dtype.str`` ("<f4") or "BYTES". A plain tuple: a batch lays out, pickles
#: and reads one per request and tensor, and named tuples cost several times more.
Ref = tuple
#: (ref, payload): an array, or the serialized bytes of a BYTES tensor
Staged = tuple

#: below this many bytes, the tensors of a batch are copied out of a region in one piece
#: and viewed in place (one copy, not one per tensor); above it each gets a copy of its own,
#: so that a tensor someone keeps (a model, the response cache) keeps at most this much alive
SNAPSHOT_BYTES = 1 << 18

_DTYPES: dict[str, np.dtype] = {}


def _dtype(spelling: str) -> np.dtype:
    dtype = _DTYPES.get(spelling)
    if dtype is None:
        dtype = _DTYPES[spelling] = np.dtype(spelling)
    return dtype


#: numpy dtype -> its spelling on the wire (``dtype.str`` builds a new string at each call)
_SPELLINGS: dict[np.dtype, str] = {}


def _spelling(dtype: np.dtype) -> str:
    spelling = _SPELLINGS.get(dtype)
    if spelling is None:
        spelling = _SPELLINGS[dtype] = dtype.str
    return spelling


def stage(tensors: dict[str, np.ndarray], offset: int = 0) -> tuple[list[Staged], int]:
    """Lay ``tensors`` out back to back (aligned) from ``offset``; returns the layout and the
    offset where the next tensor may start."""
    staged: list[Staged] = []
    _, offset = stage_into(staged, tensors, offset)
    return staged, offset


def stage_into(staged: list[Staged], tensors: dict[str, np.ndarray], offset: int) -> tuple[list[Ref], int]:
    """``stage`` onto ``staged`` (a batch's requests one after the other, into one layout);
    returns these tensors' refs and the offset where the next tensor may start."""
    refs = []
    for name, array in tensors.items():
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        if array.dtype.kind in "OSU":
            payload: np.ndarray | bytes = _serialize_bytes(array)
            dtype, nbytes = BYTES, len(payload)
        else:
            payload, dtype, nbytes = array, _spelling(array.dtype), array.nbytes
        ref = (name, dtype, array.shape, offset, nbytes)
        refs.append(ref)
        staged.append((ref, payload))
        offset += -(-nbytes // ALIGN) * ALIGN
    return refs, offset


def _serialize_bytes(array: np.ndarray) -> bytes:
    if array.size == 0:
        return b""
    if array.dtype.kind == "U":
        array = np.char.encode(array, "utf-8").astype(np.object_)
    return serialize_byte_tensor(array).item()


def region_size_for(nbytes: int) -> int:
    """Grow by powers of two so that a slowly growing batch does not recreate a region each time."""
    size = MIN_REGION_BYTES
    while size < nbytes:
        size *= 2
    return size


def _exact_size_for(nbytes: int) -> int:
    return max(MIN_REGION_BYTES, -(-nbytes // MIN_REGION_BYTES) * MIN_REGION_BYTES)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def sweep_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's ``jt_<pid>_*`` segments whose pid is dead; returns their names."""
    try:
        names = os.listdir(directory)
    except OSError:   # no /dev/shm (macOS): segments live elsewhere and the OS reclaims them
        return []
    uid, swept, alive = os.getuid(), [], {}
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match.group(2)) != _PID_NS:
            continue
        pid = int(match.group(1))
        if pid not in alive:
            alive[pid] = _pid_alive(pid)
        if alive[pid]:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
        except OSError:
            continue
        swept.append(name)
    if swept:
        log.info("removed %d shared-memory segment(s) left by dead servers: %s", len(swept),
                 ", ".join(sorted(swept)[:8]) + (" ..." if len(swept) > 8 else ""))
    return swept


_swept = threading.Event()
_sweep_lock = threading.Lock()


def sweep_once() -> None:
    """``sweep_stale_segments`` the first time a server of this process needs a region."""
    if _swept.is_set():
        return
    with _sweep_lock:
        if not _swept.is_set():
            sweep_stale_segments()
            _swept.set()


def _reserve(shm: shared_memory.SharedMemory) -> None:
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    while True:
        try:
            os.posix_fallocate(fd, 0, shm.size)
            return
        except InterruptedError:
            continue
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return   # a file system without fallocate: nothing to reserve with
            raise


def _arrays(buf: memoryview | bytearray, refs: list[Ref], copy: bool) -> dict[str, np.ndarray]:
    """Arrays over ``buf`` (views of a private copy), or copies when ``copy``."""
    out = {}
    for name, dtype, shape, offset, nbytes in refs:
        if not nbytes:
            array = np.empty(shape, dtype=np.object_ if dtype == BYTES else dtype)
        elif dtype == BYTES:
            array = deserialize_bytes_tensor(bytes(buf[offset:offset + nbytes])).reshape(shape)
        else:
            array = np.ndarray(shape, _dtype(dtype), buffer=buf, offset=offset)
            if copy:
                array = array.copy()
        out[name] = array
    return out


class ShmRegion:
    """One named shared-memory segment."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        # plain attributes: SharedMemory's properties cost a Python call at every batch
        self.name: str = shm.name
        self.size: int = shm.size
        self._buf = shm.buf

    @classmethod
    def create(cls, nbytes: int) -> "ShmRegion":
        """A region of at least ``nbytes``, its pages reserved; ``SharedMemoryFull`` when
        /dev/shm has no room for it (never a signal later)."""
        sizes = [region_size_for(nbytes)]
        if _exact_size_for(nbytes) < sizes[0]:
            sizes.append(_exact_size_for(nbytes))   # the headroom does not fit: the bare need may
        for size in sizes:
            name = segment_prefix() + secrets.token_hex(6)
            try:
                shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                continue
            try:
                _reserve(shm)
            except OSError as err:
                cls(shm, owner=True).close()
                if err.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                continue
            return cls(shm, owner=True)
        free = shm_free_bytes()
        raise SharedMemoryFull(
            f"cannot allocate {_mib(_exact_size_for(nbytes))} of shared memory in {SHM_DIR} "
            f"(No space left on device; {_mib(free) if free is not None else 'unknown'} free)")

    @classmethod
    def attach(cls, name: str) -> "ShmRegion":
        return cls(shared_memory.SharedMemory(name=name), owner=False)

    def write(self, staged: list[Staged]) -> list[Ref]:
        """Copies in; returns the layout (what crosses the wire)."""
        buf = self._buf
        for ref, payload in staged:
            nbytes = ref[4]
            if nbytes == 0:
                continue
            offset = ref[3]
            if type(payload) is bytes:
                buf[offset:offset + nbytes] = payload
                continue
            try:   # a byte view of the array: a plain memcpy
                buf[offset:offset + nbytes] = memoryview(payload).cast("B")
                continue
            except (TypeError, ValueError):   # not C-contiguous, or a format that cannot cast
                pass
            view = np.ndarray(payload.shape, payload.dtype, buffer=buf, offset=offset)
            np.copyto(view, payload, casting="no")
            del view   # a live view would keep the segment from closing
        return [ref for ref, _ in staged]

    def read(self, refs: list[Ref]) -> dict[str, np.ndarray]:
        """Copies out: the region is overwritten by the next batch."""
        return self.read_many([refs])[0]

    def read_many(self, groups: list[list[Ref]]) -> list[dict[str, np.ndarray]]:
        """The tensors of several requests (one dict per list of refs), copied out."""
        end = 0
        for refs in groups:
            for ref in refs:
                if ref[3] + ref[4] > end:
                    end = ref[3] + ref[4]
        buf = self._buf
        if end <= SNAPSHOT_BYTES:
            chunk = bytearray(buf[:end])
            return [_arrays(chunk, refs, False) for refs in groups]
        return [_arrays(buf, refs, True) for refs in groups]

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:   # a view still alive somewhere: the mapping goes with the process
            pass
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
