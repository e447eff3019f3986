"""Triton's local response cache: ``response_cache { enable: true }`` in a model's config and
a server-wide size (tritonserver's ``--cache-config local,size=<bytes>``; 0: no cache).

One LRU for the whole server, bounded in bytes. A response is keyed on the loaded version's
identity (model, number, files and config, minted once when the version was read:
repository/identity.py; so files put under a number that served before never meet the
earlier files' answers), every input (name, datatype, shape, bytes), the requested outputs
(names and their parameters) and the request's own parameters (a model may read them;
Triton's key leaves them out); the request id is not in the key and each hit answers with
its own.
Only successes are cached (Triton 2.51 caches an error response of a python model as an
empty 200 one). A model without ``response_cache`` pays one attribute check per request.

Statistics as Triton keeps them: a hit counts as a success and in ``queue`` (no time) and
``cache_hit`` (the lookup's time), not in inference/execution counts; a miss runs the
model as usual and adds its lookup and insertion time to ``cache_miss``.

A version's entries go when it unloads, is evicted or is set aside (``ModelCache.forget``):
the cache holds no answer of a version that is not loaded. An ensemble's answer is its
composing models' too: its key adds what serves its steps at the request
(``ModelCache.composed``), so that a composing model loaded again with other files, or
another version of it served, is not answered for by its earlier answers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from ..protocol.errors import InvalidArgument
from ..protocol.types import InferRequest, InferResponse

if TYPE_CHECKING:
    from ..repository.identity import VersionIdentity
    from .model import ModelVersion
    from .observation.statistics import ModelStatistics

#: request parameters that only say how to schedule or encode, not what to compute
_NOT_IN_KEY = frozenset({"priority", "timeout", "binary_data_output", "headers"})

#: bytes an entry costs besides its tensors (key, lists, objects): keeps tiny responses
#: from being counted as free
_ENTRY_OVERHEAD = 256


def parse_cache_config(values: Iterable[str]) -> int:
    """The cache size in bytes from tritonserver's ``--cache-config`` values
    (``local,size=1048576``; repeated flags add settings); 0 when none is given."""
    size = 0
    for value in values:
        name, _, rest = value.partition(",")
        if name != "local":
            raise InvalidArgument(f"--cache-config: only the 'local' cache is available, "
                                  f"got '{name}'")
        for setting in filter(None, rest.split(",")):
            key, sep, val = setting.partition("=")
            if not sep:
                raise InvalidArgument(f"--cache-config: '{setting}' is not <key>=<value>")
            if key != "size":
                raise InvalidArgument(f"--cache-config: unknown setting '{key}' of the local "
                                      f"cache (it takes size=<bytes>)")
            try:
                size = int(val)
            except ValueError:
                raise InvalidArgument(f"--cache-config: size must be a number of bytes, "
                                      f"got '{val}'") from None
            if size < 0:
                raise InvalidArgument("--cache-config: size must not be negative")
    return size


class ResponseCache:
    """The server's LRU of responses, at most ``size`` bytes (entries larger than the whole
    cache are not stored). Used from the engine's event loop only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self.evictions = 0
        # key -> (response, bytes it costs, the loaded version whose answer it is)
        self._entries: OrderedDict[bytes, tuple[InferResponse, int, ModelCache | None]] = \
            OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def utilization(self) -> float:
        return self.used / self.size if self.size else 0.0

    def lookup(self, key: bytes) -> InferResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def insert(self, key: bytes, response: InferResponse,
               owner: "ModelCache | None" = None) -> None:
        nbytes = _response_bytes(response) + len(key) + _ENTRY_OVERHEAD
        if nbytes > self.size or key in self._entries:
            return
        while self.used + nbytes > self.size:
            evicted, (_, freed, held_by) = self._entries.popitem(last=False)
            if held_by is not None:
                held_by.keys.discard(evicted)
            self.used -= freed
            self.evictions += 1
        self._entries[key] = (response, nbytes, owner)
        if owner is not None:
            owner.keys.add(key)
        self.used += nbytes

    def drop(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used -= entry[1]

    def for_model(self, stats: "ModelStatistics", identity: "VersionIdentity",
                  composed: "Callable[[], bytes | None] | None" = None) -> "ModelCache":
        """The way through the cache of one loaded version; its ``identity`` starts every key
        (and, for an ensemble, ``composed``: see ``ModelCache``)."""
        return ModelCache(self, stats, identity, composed)


class ModelCache:
    """One loaded model version's way through the cache (``ModelVersion.response_cache``)."""

    def __init__(self, cache: ResponseCache, stats: "ModelStatistics",
                 identity: "VersionIdentity",
                 composed: "Callable[[], bytes | None] | None" = None) -> None:
        self.cache = cache
        self.stats = stats
        self.identity_key = identity.key
        # an ensemble's: the identities of what would serve its steps now, asked at each
        # request (None: nothing to key on, as while a canary draws which version answers)
        self.composed = composed
        self.keys: set[bytes] = set()     # its entries in the cache
        self.forgotten = False

    def forget(self) -> None:
        """The version unloads: its entries go now, and nothing it answers later is kept."""
        self.forgotten = True
        self.cache.drop(self.keys)
        self.keys.clear()

    async def infer(self, version: "ModelVersion", request: InferRequest) -> InferResponse:
        start = time.monotonic_ns()
        identity_key = self.identity_key
        if self.composed is not None:
            steps = self.composed()
            identity_key = None if steps is None else identity_key + steps
        key = None if self.forgotten or identity_key is None else \
            request_key(identity_key, request)
        if key is None:                  # nothing to key on (inputs not in memory), or unloading
            return await version.infer(request)
        hit = self.cache.lookup(key)
        if hit is not None:
            self.stats.record_cache_hit(time.monotonic_ns() - start)
            return dataclasses.replace(hit, id=request.id)
        looked_up = time.monotonic_ns() - start
        response = await version.infer(request)       # raises on failure: nothing cached
        insert_start = time.monotonic_ns()
        if not self.forgotten:           # unless it began unloading while this request ran
            self.cache.insert(key, response, self)
        self.stats.record_cache_miss(looked_up + time.monotonic_ns() - insert_start)
        return response


def request_key(identity_key: bytes, request: InferRequest) -> bytes | None:
    """The digest a response is cached under (``identity_key``: the version's
    ``VersionIdentity.key``), or None when an input is not in memory."""
    h = hashlib.blake2b(identity_key, digest_size=32)     # keyed by the version: no extra update
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        data = tensor.data
        if data is None:
            return None
        h.update(f"{tensor.name}\0{tensor.datatype}\0{list(tensor.shape)}\0".encode())
        if data.dtype == np.object_:
            for item in data.reshape(-1):
                raw = item if isinstance(item, bytes) else str(item).encode()
                h.update(struct.pack("<I", len(raw)))
                h.update(raw)
        else:
            h.update(np.ascontiguousarray(data).data)
    outputs = None if request.outputs is None else \
        [(o.name, sorted(o.parameters.items())) for o in request.outputs]
    params = sorted((k, v) for k, v in request.parameters.items() if k not in _NOT_IN_KEY)
    h.update(json.dumps([outputs, params], default=str).encode())
    return h.digest()


def _response_bytes(response: InferResponse) -> int:
    total = 0
    for tensor in response.outputs:
        data = tensor.data
        if data is None:
            continue
        if data.dtype == np.object_:
            total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in data.reshape(-1))
        else:
            total += data.nbytes
    return total


#: Triton 2.51's cache metric families (name, help, kind); the per-model ones are labelled
#: model and version, the server's have no labels
PER_MODEL_FAMILIES = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "counter"),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     "counter"),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "counter"),
    ("nv_cache_miss_duration_per_model",
     "Total cache miss (insert+lookup) duration per model, in microseconds", "counter"),
)


def metric_values(cache: ResponseCache | None, models: Iterable[tuple["ModelVersion", dict]]
                  ) -> list[tuple[str, str, str, list[tuple[dict, float]]]]:
    """The nv_cache_* families (name, help, kind, samples); none without a server cache."""
    if cache is None:
        return []
    cached = [(m.stats, labels) for m, labels in models
              if getattr(m, "response_cache", None) is not None]
    families = []
    for (name, doc, kind), pick in zip(PER_MODEL_FAMILIES, (
            lambda s: s.cache_hit.count, lambda s: s.cache_hit.ns // 1000,
            lambda s: s.cache_miss.count, lambda s: s.cache_miss.ns // 1000)):
        families.append((name, doc, kind, [(labels, pick(s)) for s, labels in cached]))
    hits = sum(s.cache_hit.count for s, _ in cached)
    misses = sum(s.cache_miss.count for s, _ in cached)
    families += [
        ("nv_cache_util", "Cache utilization [0.0 - 1.0]", "gauge", [({}, cache.utilization)]),
        ("nv_cache_num_entries", "Number of responses stored in response cache", "gauge",
         [({}, len(cache))]),
        ("nv_cache_num_hits", "Number of cache hits in response cache", "gauge", [({}, hits)]),
        ("nv_cache_num_misses", "Number of cache misses in response cache", "gauge",
         [({}, misses)]),
        ("nv_cache_num_lookups", "Number of cache lookups in response cache", "gauge",
         [({}, hits + misses)]),
        ("nv_cache_num_evictions", "Number of cache evictions in response cache", "gauge",
         [({}, cache.evictions)]),
    ]
    return families
