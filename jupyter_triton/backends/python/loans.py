"""Regions the server lends one worker for the tensors of a single message.

Decoupled responses and BLS calls leave at any time, not in a batch's two regions: past
``SHM_MESSAGE_BYTES`` their tensors travel in a region made for that one message (the
worker asks with ``LoanAsk``; the server packs its BLS answers itself). The server creates
and unlinks every one, so a worker that dies leaks nothing: what is still lent goes with it
(``close``).
"""
from __future__ import annotations

import logging
from typing import Any

from .messages import SHM_MESSAGE_BYTES, payload_bytes
from .shm import SharedMemoryFull, ShmRegion, stage

log = logging.getLogger(__name__)


class Loans:
    """The regions lent to one worker and not given back yet, by name."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._regions: dict[str, ShmRegion] = {}
        self._closed = False

    def pack(self, tensors: dict | None) -> Any:
        """Tensors for a message to the worker: inline when small, else in a region lent to
        it (it sends ``LoanDone`` once read; the region goes with the worker otherwise)."""
        if not tensors or payload_bytes(tensors) < SHM_MESSAGE_BYTES:
            return tensors
        staged, end = stage(tensors)
        try:
            region = ShmRegion.create(end)
        except SharedMemoryFull:
            return tensors            # no room: the socket carries them
        refs = region.write(staged)
        self._keep(region)
        return ("shm", region.name, refs)

    def lend(self, nbytes: int) -> str | None:
        """A region for tensors the worker is about to send; None when /dev/shm has no room."""
        try:
            region = ShmRegion.create(nbytes)
        except SharedMemoryFull:
            return None
        self._keep(region)
        return region.name

    def returned(self, name: str) -> None:
        """The worker has read the region it was sent."""
        region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def take(self, packed: tuple) -> dict:
        """The tensors the worker wrote in a region it was lent (``("shm", name, refs)``)."""
        _, name, refs = packed
        region = self._regions.pop(name, None)
        if region is None:   # never lent (a confused worker): no tensors rather than a dead reader
            log.error("python worker %s: tensors in region %s, which it was not lent", self.label, name)
            return {}
        try:
            return region.read(refs)
        finally:
            region.close()

    def close(self) -> None:
        self._closed = True
        while self._regions:
            self._regions.popitem()[1].close()

    def _keep(self, region: ShmRegion) -> None:
        self._regions[region.name] = region
        if self._closed:   # closed meanwhile (a BLS answer racing the worker's end)
            self._regions.pop(region.name, None)
            region.close()
