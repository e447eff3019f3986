"""Bulk inference from the notebook: ``handle.map(items, ...)`` sends a large input as
order-preserving chunks, a few at a time, at a bulk priority, with a progress bar, and can be
resumed after an interruption without sending again what already finished.

* Each chunk is one request with a batch dimension (``chunk_size`` rows, at most the model's
  ``max_batch_size``). A text model (``text_input`` -> ``text_output``, which takes one prompt
  a request) gets one request per text; a chunk is then the unit of progress and resumption.
* ``priority="bulk"`` is the model's lowest priority level (``dynamic_batching.priority_levels``,
  level 1 being the highest, as in Triton), so interactive requests sent at a higher level are
  taken from the queue first; a number is sent as it is; a model without priority levels gets
  no priority parameter (Triton gives it no meaning there).
* Ctrl-C (KeyboardInterrupt) or a failed chunk stops the run after the chunks already sent
  finish; it raises ``BulkInterrupted`` / ``BulkFailed``, whose ``bulk`` (a ``Bulk``, also
  known by its ``key``) holds every finished chunk: ``handle.map(items, resume=err.bulk)`` (or
  ``resume="<key>"``) sends only the rest and returns the whole result in input order.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from ..progress import Progress, Quiet
from ..protocol.errors import InvalidArgument, TritonError
from .artifacts import TEXT_INPUT, TEXT_OUTPUT



class Mappable(Protocol):
    """What ``run_map`` asks of the handle it maps over (handle.ServedModel)."""
    name: str
    _client: Any

    def metadata(self) -> dict: ...
    def config(self) -> dict: ...
    def _text_model(self, meta: dict) -> bool: ...

#: unfinished runs by key (``resume="<key>"``); a finished run leaves
_RUNS: dict[str, "Bulk"] = {}
_RUNS_LOCK = threading.Lock()


class Bulk:
    """One ``map`` run: which model, how many items in which chunks, and the outputs of the
    chunks that finished (``done``), so that a resumed run sends only the others."""

    def __init__(self, model: str, n_items: int, chunk_size: int) -> None:
        self.key = uuid.uuid4().hex[:8]
        self.model, self.n_items, self.chunk_size = model, int(n_items), int(chunk_size)
        self.n_chunks = -(-self.n_items // self.chunk_size) if self.n_items else 0
        self.chunks: dict[int, Any] = {}           # chunk index -> its outputs
        self.requests = 0                          # requests this object's runs sent
        self.error: BaseException | None = None

    @property
    def done(self) -> int:
        """Chunks finished."""
        return len(self.chunks)

    @property
    def done_items(self) -> int:
        return sum(min(self.chunk_size, self.n_items - i * self.chunk_size) for i in self.chunks)

    @property
    def remaining(self) -> list[int]:
        """Indices of the chunks still to send."""
        return [i for i in range(self.n_chunks) if i not in self.chunks]

    @property
    def finished(self) -> bool:
        return self.done == self.n_chunks

    def __repr__(self) -> str:
        return (f"Bulk('{self.key}': model '{self.model}', {self.done_items}/{self.n_items} items,"
                f" {self.done}/{self.n_chunks} chunks of {self.chunk_size} done)")


class BulkFailed(TritonError):
    """A chunk failed; ``bulk`` holds the finished ones (``handle.map(..., resume=bulk)``)."""

    def __init__(self, message: str, bulk: Bulk) -> None:
        super().__init__(message)
        self.bulk = bulk


class BulkInterrupted(KeyboardInterrupt):
    """The run was interrupted; ``bulk`` holds the finished chunks."""

    def __init__(self, message: str, bulk: Bulk) -> None:
        super().__init__(message)
        self.bulk = bulk


def run_map(handle: Mappable, items: Any, *, chunk_size: int | None = None,
            concurrency: int = 4, priority: int | str = "bulk", progress: bool = True,
            resume: "Bulk | str | None" = None) -> Any:
    """``handle.map``: see the module's text."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, (int, np.integer)) \
            or concurrency < 1:
        raise InvalidArgument(f"map: concurrency must be an integer of 1 or more, not {concurrency!r}")
    meta = handle.metadata()
    config = handle.config()
    text = handle._text_model(meta)
    max_batch = int(config.get("max_batch_size", 0) or 0)
    level = _priority(priority, config, handle.name)
    inputs, n_items = _inputs(items, meta, text, handle.name)
    bulk = _resumed(resume, handle.name, n_items, chunk_size) if resume is not None else None
    if bulk is None:
        if chunk_size is None:
            chunk_size = max_batch or 1
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
                or chunk_size < 1:
            raise InvalidArgument(f"map: chunk_size must be an integer of 1 or more, "
                                  f"not {chunk_size!r}")
        if not text and not max_batch:
            raise InvalidArgument(f"map: model '{handle.name}' does not batch (max_batch_size 0): "
                                  f"its requests carry no batch dimension to chunk along; call "
                                  f"handle.infer per item")
        if max_batch and chunk_size > max_batch:
            raise InvalidArgument(f"map: chunk_size {chunk_size} is more than model "
                                  f"'{handle.name}' takes in one request (max_batch_size "
                                  f"{max_batch})")
        bulk = Bulk(handle.name, n_items, int(chunk_size))
    with _RUNS_LOCK:
        _RUNS[bulk.key] = bulk
    bulk.error = None

    def send(index: int) -> Any:
        lo, hi = index * bulk.chunk_size, min((index + 1) * bulk.chunk_size, bulk.n_items)
        if text:
            answers = []
            for value in inputs[TEXT_INPUT][lo:hi]:
                out = handle._client.infer(handle.name, {TEXT_INPUT: np.array([value], dtype=np.object_)},
                                           priority=level)
                answers.append(_text(np.asarray(out[TEXT_OUTPUT]).reshape(-1)[0]))
                bulk.requests += 1
            return answers
        out = handle._client.infer(handle.name, {k: v[lo:hi] for k, v in inputs.items()},
                                   priority=level)
        bulk.requests += 1
        return out

    todo = iter(bulk.remaining)
    bar = (Progress(bulk.n_items, f"map '{handle.name}'") if progress
           else Quiet(bulk.n_items, f"map '{handle.name}'"))
    bar.update(bulk.done_items, f"chunks: {bulk.done}/{bulk.n_chunks}")
    pool = ThreadPoolExecutor(max_workers=int(concurrency), thread_name_prefix="jt-map")
    running: dict[Future, int] = {}
    try:
        for index in itertools.islice(todo, int(concurrency)):
            running[pool.submit(send, index)] = index
        while running:
            # a timeout, so that an interruption (Ctrl-C, the kernel's interrupt) is seen
            finished, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
            if not finished:
                continue
            for future in finished:
                _collect(bulk, running.pop(future), future)
            bar.update(bulk.done_items, f"chunks: {bulk.done}/{bulk.n_chunks}")
            if bulk.error is None:
                for index in itertools.islice(todo, len(finished)):
                    running[pool.submit(send, index)] = index
    except KeyboardInterrupt:
        for future in running:
            future.cancel()
        pool.shutdown(wait=True)          # the chunks already sent finish and are kept
        for future, index in running.items():
            if not future.cancelled():
                _collect(bulk, index, future)
        bar.close("interrupted")
        raise BulkInterrupted(f"map on '{handle.name}' interrupted: {bulk.done}/{bulk.n_chunks} "
                              f"chunks done; handle.map(items, resume='{bulk.key}') sends only "
                              f"the rest", bulk) from None
    finally:
        pool.shutdown(wait=True)
    if bulk.error is not None:
        bar.close(f"failed: {bulk.error}")
        raise BulkFailed(f"map on '{handle.name}': a chunk failed ({bulk.error}); {bulk.done}/"
                         f"{bulk.n_chunks} chunks done; handle.map(items, resume='{bulk.key}') "
                         f"sends only the rest", bulk) from bulk.error
    bar.close()
    with _RUNS_LOCK:
        _RUNS.pop(bulk.key, None)
    return _assemble(bulk, text, meta)


def _collect(bulk: Bulk, index: int, future: Future) -> None:
    err = future.exception()
    if err is None:
        bulk.chunks[index] = future.result()
    elif bulk.error is None:
        bulk.error = err


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _priority(priority: int | str, config: Mapping[str, Any], name: str) -> int:
    if isinstance(priority, str):
        if priority != "bulk":
            raise InvalidArgument(f"map: priority must be 'bulk' or a level (an integer of 0 or "
                                  f"more), not {priority!r}")
        levels = int((config.get("dynamic_batching") or {}).get("priority_levels", 0) or 0)
        return levels            # the lowest level; 0 (none sent) without levels
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or priority < 0:
        raise InvalidArgument(f"map: priority must be 'bulk' or a level (an integer of 0 or "
                              f"more), not {priority!r}")
    return int(priority)


def _inputs(items: Any, meta: Mapping[str, Any], text: bool, name: str
            ) -> tuple[dict[str, np.ndarray], int]:
    """The whole input as arrays by input name, all with the same first dimension."""
    from ..protocol.datatypes import as_numpy
    specs = meta.get("inputs", [])
    if isinstance(items, (str, bytes)):
        raise InvalidArgument("map: items is one string; pass a list of them")
    if text:
        texts = list(items)
        if not all(isinstance(t, (str, bytes)) for t in texts):
            raise InvalidArgument(f"map: model '{name}' is a text model; items must be strings")
        return {TEXT_INPUT: np.array([t.encode("utf-8") if isinstance(t, str) else t
                                      for t in texts] or [b""], dtype=np.object_)[:len(texts)]}, \
            len(texts)
    if isinstance(items, Mapping):
        unknown = [k for k in items if k not in {s["name"] for s in specs}]
        if unknown:
            raise InvalidArgument(f"map: model '{name}' has no input(s) {', '.join(unknown)} "
                                  f"(inputs: {', '.join(s['name'] for s in specs)})")
        values = dict(items)
    else:
        if len(specs) != 1:
            raise InvalidArgument(f"map: model '{name}' takes {len(specs)} inputs "
                                  f"({', '.join(s['name'] for s in specs)}); pass items as a "
                                  f"dict of arrays by input name")
        values = {specs[0]["name"]: items}
    missing = [s["name"] for s in specs if s["name"] not in values]
    if missing:
        raise InvalidArgument(f"map: model '{name}': missing input(s) {', '.join(missing)}")
    arrays = {}
    for spec in specs:
        value = values[spec["name"]]
        if spec["datatype"] == "BYTES" and isinstance(value, Sequence) and not isinstance(value, np.ndarray):
            value = [v.encode("utf-8") if isinstance(v, str) else v for v in value]
        array = as_numpy(value, spec["datatype"])
        if array.ndim == 0:
            raise InvalidArgument(f"map: input '{spec['name']}' is a scalar; map takes a "
                                  f"sequence of items along the first dimension")
        if array.ndim == len(spec["shape"]) - 1 and array.ndim == 1 and len(spec["shape"]) == 2 \
                and int(spec["shape"][1]) in (1, -1):
            array = array.reshape(-1, 1)         # one value an item: [n] -> [n, 1]
        arrays[spec["name"]] = array
    rows = {a.shape[0] for a in arrays.values()}
    if len(rows) != 1:
        raise InvalidArgument(f"map: inputs of model '{name}' differ in length "
                              f"({', '.join(f'{k}: {v.shape[0]}' for k, v in arrays.items())})")
    return arrays, rows.pop()


def _resumed(resume: "Bulk | str", name: str, n_items: int, chunk_size: int | None) -> Bulk:
    if isinstance(resume, str):
        with _RUNS_LOCK:
            bulk = _RUNS.get(resume)
        if bulk is None:
            raise InvalidArgument(f"map: no unfinished map run '{resume}' to resume"
                                  f" (known: {', '.join(_RUNS) or 'none'})")
    elif isinstance(resume, Bulk):
        bulk = resume
    else:
        raise InvalidArgument(f"map: resume takes a Bulk (an interrupted run's err.bulk) or its "
                              f"key, not {type(resume).__name__}")
    if bulk.model != name:
        raise InvalidArgument(f"map: run '{bulk.key}' was a map on model '{bulk.model}', not '{name}'")
    if bulk.n_items != n_items:
        raise InvalidArgument(f"map: run '{bulk.key}' had {bulk.n_items} items, these are "
                              f"{n_items}; resume with the same items")
    if chunk_size is not None and int(chunk_size) != bulk.chunk_size:
        raise InvalidArgument(f"map: run '{bulk.key}' used chunk_size {bulk.chunk_size}; a "
                              f"resumed run keeps it")
    return bulk


def _assemble(bulk: Bulk, text: bool, meta: Mapping[str, Any]) -> Any:
    parts = [bulk.chunks[i] for i in range(bulk.n_chunks)]
    if text:
        return [t for part in parts for t in part]
    if not parts:
        return [] if len(meta.get("outputs", [])) <= 1 else {}
    order = [o["name"] for o in meta.get("outputs", [])]
    names = [k for k in order if k in parts[0]] or list(parts[0])
    outputs = {k: np.concatenate([p[k] for p in parts]) for k in names}
    return next(iter(outputs.values())) if len(outputs) == 1 else outputs
