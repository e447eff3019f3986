"""Shared-memory regions that carry tensors between the server and a python worker.

The server process creates and unlinks every segment (so a worker that dies leaks
nothing); the worker only attaches. A region is reused for every batch and replaced by a
bigger one when a batch does not fit. Only ``TensorRef`` tuples (name, dtype, shape,
offset, size) cross the pipe; the bytes stay in the region. BYTES tensors are stored in
Triton's serialized form (4-byte little-endian length before each element).
"""
from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory
from typing import NamedTuple

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

ALIGN = 64
MIN_REGION_BYTES = 1 << 20
PREFIX = "jt_"
BYTES = "BYTES"


class TensorRef(NamedTuple):
    name: str
    dtype: str          # numpy dtype.str ("<f4"), or "BYTES"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Staged(NamedTuple):
    ref: TensorRef
    payload: np.ndarray | bytes


def stage(tensors: dict[str, np.ndarray], offset: int = 0) -> tuple[list[Staged], int]:
    """Lay ``tensors`` out back to back (aligned) from ``offset``; returns the layout and the
    offset where the next tensor may start."""
    staged = []
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype.kind in "OSU":
            payload: np.ndarray | bytes = _serialize_bytes(array)
            dtype, nbytes = BYTES, len(payload)
        else:
            payload, dtype, nbytes = array, array.dtype.str, array.nbytes
        staged.append(Staged(TensorRef(name, dtype, tuple(array.shape), offset, nbytes), payload))
        offset += -(-nbytes // ALIGN) * ALIGN
    return staged, offset


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


class ShmRegion:
    """One named shared-memory segment."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner

    @classmethod
    def create(cls, nbytes: int) -> "ShmRegion":
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        return cls(shared_memory.SharedMemory(name=name, create=True, size=region_size_for(nbytes)),
                   owner=True)

    @classmethod
    def attach(cls, name: str) -> "ShmRegion":
        return cls(shared_memory.SharedMemory(name=name), owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def size(self) -> int:
        return self._shm.size

    def write(self, staged: list[Staged]) -> list[TensorRef]:
        buf = self._shm.buf
        for ref, payload in staged:
            if ref.nbytes == 0:
                continue
            if isinstance(payload, bytes):
                buf[ref.offset:ref.offset + ref.nbytes] = payload
            else:
                view = np.ndarray(payload.shape, payload.dtype, buffer=buf, offset=ref.offset)
                np.copyto(view, payload, casting="no")
                del view   # a live view would keep the segment from closing
        return [s.ref for s in staged]

    def read(self, refs: list[TensorRef]) -> dict[str, np.ndarray]:
        """Copies out: the region is overwritten by the next batch."""
        buf = self._shm.buf
        out = {}
        for ref in refs:
            raw = buf[ref.offset:ref.offset + ref.nbytes]
            if ref.dtype == BYTES:
                array = deserialize_bytes_tensor(bytes(raw)).reshape(ref.shape) if ref.nbytes \
                    else np.empty(ref.shape, dtype=np.object_)
            else:
                array = np.frombuffer(raw, dtype=np.dtype(ref.dtype)).reshape(ref.shape).copy()
            raw.release()
            out[ref.name] = array
        return out

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
