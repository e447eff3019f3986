"""Triton's sequence batcher (``sequence_batching``): stateful models.

A sequence is the requests that share a correlation id (the ``sequence_id`` request
parameter), from the one flagged ``sequence_start`` to the one flagged ``sequence_end``.
As in Triton's ``SequenceBatchScheduler``:

* every instance has sequence slots (``max_batch_size`` of them, at least one; the
  ``oldest`` strategy: ``max_candidate_sequences``); a starting sequence takes the free
  slot of lowest index (across instances, the first instance first) and keeps it until its
  END request has run or it has been idle ``max_sequence_idle_microseconds``; while every
  slot is taken, new sequences wait in a backlog, oldest first;
* the requests of one sequence run one at a time, in order, on the instance that holds it;
* the control inputs the config names (``CONTROL_SEQUENCE_START/END/READY/CORRID``) are
  added to each request's inputs, with the configured false/true values;
* ``direct``: a batch holds at most one request per slot, in slot order; a slot without a
  request is filled with a null request (READY false) up to the highest slot in use; the
  batch waits up to ``max_queue_delay_microseconds`` for ``minimum_slot_utilization``;
* ``oldest``: the heads of the instance's sequences, oldest first, batch dynamically
  (``preferred_batch_size``, ``max_queue_delay_microseconds``);
* implicit state (``state [...]``): the engine keeps each sequence's state tensors, feeds
  them as the state inputs (the initial state at START), takes the state outputs back from
  what the model returns (the client never sees them), and frees them when the sequence
  ends or is reaped.

What is not implemented is refused at load by ``check_supported``: ``iterative_sequence``,
``oldest.preserve_ordering``, decoupled sequence models, a state's ``use_growable_memory``,
a STRING state's ``initial_state`` from a data file. Requests wait in a slot or the backlog
without a queue timeout (the ``timeout`` request parameter is not applied here).
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.datatypes import config_to_triton, triton_to_numpy
from ...protocol.errors import Internal, InvalidArgument, Unavailable, Unsupported
from ...protocol.types import InferRequest
from ..batching.instances import Instance, InstancePool
from ..batching.scheduler import Pending, Scheduler, default_max_queue_size, queue_full
from ..observation.statistics import ModelStatistics, mark_failure

log = logging.getLogger(__name__)

Control = mc.ModelSequenceBatching.Control


def check_supported(config: mc.ModelConfig, model_dir: Path | None = None) -> None:
    """Refuse, at load, every part of ``sequence_batching`` this server does not implement,
    rather than serve the model without it. With ``model_dir``, also read the initial
    states: every error surfaces before any instance is made."""
    seq = config.sequence_batching
    name = config.name

    def refuse(what: str) -> Unsupported:
        return Unsupported(f"model '{name}': sequence_batching {what} is not supported by this "
                           f"server")

    if seq.iterative_sequence:
        raise refuse("'iterative_sequence'")
    if seq.HasField("oldest") and seq.oldest.preserve_ordering:
        raise refuse("'oldest.preserve_ordering' (requests of one sequence are always "
                     "answered in order; across sequences they are not)")
    if config.model_transaction_policy.decoupled:
        raise refuse("with a decoupled model")
    for state in seq.state:
        if state.use_growable_memory:
            raise refuse(f"state '{state.input_name}' 'use_growable_memory'")
        if len(state.initial_state) > 1:
            raise InvalidArgument(
                f"initial_state field for state input '{state.input_name}' must contain exactly "
                f"one or zero element. Found '{len(state.initial_state)}' elements.")
    _Controls(config)
    if model_dir is not None:
        _States(config, model_dir)


@dataclass(eq=False)
class _Item:
    """A queued request of a sequence."""
    pending: Pending
    sequence_id: int | str
    start: bool
    end: bool


@dataclass(eq=False)
class _Slot:
    instance: int                         # index in the scheduler's instances
    index: int                            # its place in the instance's batches
    sequence_id: int | str | None = None  # the sequence holding it; None: free
    open: bool = False                    # still takes requests of its sequence (no END yet)
    queue: deque[_Item] = field(default_factory=deque)
    state: dict[str, np.ndarray] | None = None
    last_ns: int = 0                      # when its sequence last sent a request
    running: bool = False


@dataclass(eq=False)
class _Backlog:
    sequence_id: int | str
    queue: deque[_Item] = field(default_factory=deque)


def _dims(batching: bool, dims) -> list[int]:
    return ([1] if batching else []) + [int(d) for d in dims]


class _Controls:
    """The control tensors of a config, built once: name -> (false, true) arrays, and the
    CORRID tensor's name and dtype."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.batching = config.max_batch_size > 0
        shape = (1, 1) if self.batching else (1,)
        self.flags: dict[int, list[tuple[str, np.ndarray, np.ndarray]]] = {
            Control.CONTROL_SEQUENCE_START: [], Control.CONTROL_SEQUENCE_END: [],
            Control.CONTROL_SEQUENCE_READY: []}
        self.corrid: list[tuple[str, int]] = []
        self.numeric_corrid: list[tuple[str, np.dtype]] = []
        for control_input in config.sequence_batching.control_input:
            for control in control_input.control:
                if control.kind == Control.CONTROL_SEQUENCE_CORRID:
                    self.corrid.append((control_input.name, control.data_type))
                    if control.data_type != mc.TYPE_STRING:
                        self.numeric_corrid.append((control_input.name, triton_to_numpy(
                            config_to_triton(mc.DataType.Name(control.data_type)))))
                    continue
                if control.int32_false_true:
                    values, dtype = control.int32_false_true, np.int32
                elif control.fp32_false_true:
                    values, dtype = control.fp32_false_true, np.float32
                else:
                    values, dtype = control.bool_false_true, np.bool_
                false, true = (np.full(shape, v, dtype=dtype) for v in values)
                false.flags.writeable = true.flags.writeable = False
                self.flags[control.kind].append((control_input.name, false, true))

    def fill(self, inputs: dict[str, np.ndarray], *, start: bool, end: bool, ready: bool,
             sequence_id: int | str) -> None:
        for name, false, true in self.flags[Control.CONTROL_SEQUENCE_START]:
            inputs[name] = true if start and ready else false
        for name, false, true in self.flags[Control.CONTROL_SEQUENCE_END]:
            inputs[name] = true if end and ready else false
        for name, false, true in self.flags[Control.CONTROL_SEQUENCE_READY]:
            inputs[name] = true if ready else false
        shape = (1, 1) if self.batching else (1,)
        for name, data_type in self.corrid:
            if data_type == mc.TYPE_STRING:
                value = sequence_id if isinstance(sequence_id, str) else str(sequence_id or "")
                inputs[name] = np.full(shape, value.encode(), dtype=object)
        for name, dtype in self.numeric_corrid:
            inputs[name] = np.full(shape, sequence_id or 0, dtype=dtype)


class _States:
    """The implicit state tensors of a config: their initial values, built once."""

    def __init__(self, config: mc.ModelConfig, model_dir: Path | None) -> None:
        batching = config.max_batch_size > 0
        self.outputs: dict[str, str] = {}       # state output name -> state input name
        self.initial: dict[str, np.ndarray] = {}
        for state in config.sequence_batching.state:
            dtype = triton_to_numpy(config_to_triton(mc.DataType.Name(state.data_type)))
            self.outputs[state.output_name] = state.input_name
            self.initial[state.input_name] = self._initial(config, state, dtype, batching,
                                                           model_dir)
        # outputs the client may also ask for (a state output listed in config.output)
        self.listed = {o.name for o in config.output}

    @staticmethod
    def _initial(config: mc.ModelConfig, state, dtype: np.dtype, batching: bool,
                 model_dir: Path | None) -> np.ndarray:
        if not state.initial_state:
            # a variable dim starts empty (Triton's docs: the model reads START and ignores it)
            shape = [max(d, 0) for d in _dims(batching, state.dims)]
            return np.full(shape, b"", dtype=object) if dtype == np.object_ else np.zeros(shape, dtype)
        init = state.initial_state[0]
        if init.data_type != state.data_type:
            raise InvalidArgument(
                f"The data type used for 'initial_state' field of state '{state.input_name}' does "
                f"not match the state data type.")
        if any(d < 0 for d in init.dims):
            raise InvalidArgument(f"'initial_state' field for state input name "
                                  f"'{state.input_name}' contains variable dimensions.")
        shape = _dims(batching, init.dims)
        which = init.WhichOneof("state_data")
        if which == "zero_data":
            return np.full(shape, b"", dtype=object) if dtype == np.object_ else np.zeros(shape, dtype)
        if which == "data_file" and model_dir is not None and dtype != np.object_:
            path = model_dir / "initial_state" / init.data_file
            root = (model_dir / "initial_state").resolve()
            if root not in path.resolve().parents:
                raise InvalidArgument(f"model '{config.name}': initial_state data_file "
                                      f"'{init.data_file}' must be inside initial_state/")
            try:
                data = path.read_bytes()
            except OSError as err:
                raise InvalidArgument(f"model '{config.name}': initial_state data_file of state "
                                      f"'{state.input_name}': {err.strerror}: "
                                      f"initial_state/{init.data_file}") from None
            need = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if len(data) < need:
                raise InvalidArgument(
                    f"initial_state setting expects {need} bytes, but the data provided from "
                    f"{init.data_file}only has {len(data)} bytes.")
            return np.frombuffer(data[:need], dtype=dtype).reshape(shape).copy()
        raise Unsupported(f"model '{config.name}': initial_state of state '{state.input_name}' "
                          f"needs zero_data or a data_file of a numeric type")


class SequenceBatcher(Scheduler):
    """The scheduler of a model with ``sequence_batching``; see the module's docstring."""

    def __init__(self, config: mc.ModelConfig, pool: InstancePool, stats: ModelStatistics,
                 model_dir: Path | None = None) -> None:
        super().__init__(pool)
        check_supported(config)
        self.config = config
        self.stats = stats
        self.model = config.name
        seq = config.sequence_batching
        self.batching = config.max_batch_size > 0
        self.max_batch_size = max(1, config.max_batch_size)
        self.oldest = seq.HasField("oldest")
        slots = self.max_batch_size
        if self.oldest:
            slots = seq.oldest.max_candidate_sequences or slots
            self.delay_ns = seq.oldest.max_queue_delay_microseconds * 1000
            self.preferred = sorted(set(seq.oldest.preferred_batch_size))
            self.min_utilization = 0.0
        else:
            self.delay_ns = seq.direct.max_queue_delay_microseconds * 1000
            self.preferred = []
            self.min_utilization = seq.direct.minimum_slot_utilization
        self.idle_ns = seq.max_sequence_idle_microseconds * 1000
        self.max_queue_size = default_max_queue_size(config)
        self.controls = _Controls(config)
        self.states = _States(config, model_dir)
        # The pool hands out whichever instance is free; a sequence needs the one holding
        # it, so this scheduler keeps the instances itself and empties the pool's free list
        # whenever the pool refills it.
        self.instances: list[Instance] = list(pool.instances)
        while pool.try_acquire() is not None:
            pass
        pool.on_release = self._drain_pool
        self._busy = [False] * len(self.instances)
        self.slots = [[_Slot(i, s) for s in range(slots)] for i in range(len(self.instances))]
        self._free: list[tuple[int, int]] = [(s, i) for i in range(len(self.instances))
                                             for s in range(slots)]
        heapq.heapify(self._free)
        self._active: dict[int | str, _Slot] = {}
        self._backlog: dict[int | str, _Backlog] = {}
        self._backlogs: deque[_Backlog] = deque()
        self._queued = 0
        self._inflight: set[asyncio.Future] = set()
        self._wake: asyncio.TimerHandle | None = None
        self._reaper: asyncio.TimerHandle | None = None
        self._closed = False

    def _drain_pool(self) -> None:
        while self.pool.try_acquire() is not None:
            pass

    # -- taking requests ---------------------------------------------------------------

    async def submit(self, pending: Pending) -> None:
        if self._closed:
            raise mark_failure(Unavailable(
                f"model '{self.model}' is unloading: its scheduler has stopped accepting new "
                f"inference requests"), "REJECTED")
        item = self._item(pending)
        sid = item.sequence_id
        slot = self._active.get(sid)
        backlog = self._backlog.get(sid)
        if not item.start and slot is None and backlog is None:
            raise InvalidArgument(
                f"inference request for sequence {sid} to model '{self.model}' must specify the "
                f"START flag on the first request of the sequence")
        if self.max_queue_size and self._queued >= self.max_queue_size:
            raise queue_full(self.model, self._queued, self.max_queue_size)
        if item.start and (slot is not None or backlog is not None):
            log.warning("sequence %s for model '%s' has a conflict. The previous sequence did "
                        "not end before this sequence start. Previous sequence will be "
                        "terminated early.", sid, self.model)
        now = time.monotonic_ns()
        self._queued += 1
        pending.future.add_done_callback(lambda _, it=item: self._forget(it))
        if slot is not None:
            slot.queue.append(item)
            slot.last_ns = now
            if item.end:
                del self._active[sid]
                slot.open = False
        elif backlog is not None:
            backlog.queue.append(item)
            if item.end:
                del self._backlog[sid]
        elif self._free:
            index, i = heapq.heappop(self._free)
            slot = self.slots[i][index]
            self._assign(slot, sid, deque([item]), open_=not item.end)
        else:
            backlog = _Backlog(sid, deque([item]))
            self._backlogs.append(backlog)
            if not item.end:
                self._backlog[sid] = backlog
        self._pump()

    def _item(self, pending: Pending) -> _Item:
        params = pending.request.parameters
        sid = params.get("sequence_id", 0) if params else 0
        if sid is None or sid == 0 or sid == "" or isinstance(sid, bool):
            raise InvalidArgument(f"inference request to model '{self.model}' must specify a "
                                  f"non-zero or non-empty correlation ID")
        if self.batching and pending.batch_size > 1:
            raise InvalidArgument(
                f"inference request to model '{self.model}' must specify batch-size 1 due to "
                f"requirements of sequence batcher")
        if isinstance(sid, str) and any(t != mc.TYPE_STRING for _, t in self.controls.corrid):
            raise InvalidArgument(
                f"inference request to model '{self.model}' has a string correlation ID "
                f"'{sid}' but the model's CONTROL_SEQUENCE_CORRID input is numeric")
        if isinstance(sid, int):
            for name, dtype in self.controls.numeric_corrid:
                info = np.iinfo(dtype)
                if not info.min <= sid <= info.max:
                    raise InvalidArgument(
                        f"inference request to model '{self.model}': correlation ID {sid} does "
                        f"not fit the {np.dtype(dtype).name} control input '{name}'")
        return _Item(pending, sid, bool(params.get("sequence_start")),
                     bool(params.get("sequence_end")))

    def _assign(self, slot: _Slot, sid: int | str, queue: deque[_Item], open_: bool) -> None:
        slot.sequence_id = sid
        slot.queue = queue
        slot.open = open_
        slot.state = None
        slot.last_ns = time.monotonic_ns()
        if open_:
            self._active[sid] = slot

    def _forget(self, item: _Item) -> None:
        """``item``'s future ended; if still queued (the client went away, unload), drop it."""
        self._queued -= 1
        if item.pending.started:
            return
        for row in self.slots:
            for slot in row:
                if slot.sequence_id == item.sequence_id and item in slot.queue:
                    slot.queue.remove(item)
                    self._release_done_slots()
                    if not self._closed:
                        self._pump()    # a slot it freed may take a backlogged sequence
                    return
        for backlog in list(self._backlogs):
            if backlog.sequence_id == item.sequence_id and item in backlog.queue:
                backlog.queue.remove(item)
                if not backlog.queue:
                    # nothing of it ever ran: the sequence is forgotten, not given a slot
                    self._backlogs.remove(backlog)
                    if self._backlog.get(backlog.sequence_id) is backlog:
                        del self._backlog[backlog.sequence_id]
                return

    # -- slots ---------------------------------------------------------------------------

    def _release_done_slots(self) -> None:
        """Free every slot whose sequence has ended and has nothing left to run; a free slot
        takes the oldest backlogged sequence."""
        for row in self.slots:
            for slot in row:
                while slot.sequence_id is not None and not slot.open and not slot.queue \
                        and not slot.running:
                    self._release(slot)

    def _release(self, slot: _Slot) -> None:
        if slot.open and self._active.get(slot.sequence_id) is slot:
            del self._active[slot.sequence_id]
        slot.sequence_id, slot.open, slot.state = None, False, None
        if self._backlogs:
            backlog = self._backlogs.popleft()
            still_open = self._backlog.get(backlog.sequence_id) is backlog
            if still_open:
                del self._backlog[backlog.sequence_id]
            self._assign(slot, backlog.sequence_id, backlog.queue, still_open)
        else:
            heapq.heappush(self._free, (slot.index, slot.instance))

    def _arm_reaper(self) -> None:
        if not self.idle_ns or self._closed:
            return
        idle = [s.last_ns for s in self._active.values() if not s.queue and not s.running]
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if idle:
            delay = max(0.0, (min(idle) + self.idle_ns - time.monotonic_ns()) / 1e9)
            self._reaper = asyncio.get_running_loop().call_later(delay, self._reap)

    def _reap(self) -> None:
        """Sequences idle past max_sequence_idle_microseconds lose their slot (and state):
        a later request of theirs without START fails."""
        self._reaper = None
        now = time.monotonic_ns()
        for sid, slot in list(self._active.items()):
            if not slot.queue and not slot.running and now - slot.last_ns >= self.idle_ns:
                log.info("sequence %s of model '%s' idle for more than %d us: its slot is freed",
                         sid, self.model, self.idle_ns // 1000)
                slot.open = False
                del self._active[sid]
        self._release_done_slots()
        self._pump()

    # -- forming batches ---------------------------------------------------------------

    def _pump(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        try:
            wait_ns = None
            for i, row in enumerate(self.slots):
                if self._busy[i]:
                    continue
                batch, wait = self._form(row)
                if batch:
                    self._dispatch(i, batch)
                elif wait is not None:
                    wait_ns = wait if wait_ns is None else min(wait_ns, wait)
            if wait_ns is not None and not self._closed:
                self._wake = asyncio.get_running_loop().call_later(wait_ns / 1e9, self._pump)
            self._arm_reaper()
        except Exception:
            log.exception("model '%s': sequence batcher failed", self.model)
            self._fail_queued(Internal(f"model '{self.model}': sequence batcher failed"), "OTHER")

    def _form(self, row: list[_Slot]) -> tuple[list[tuple[_Slot, _Item | None]], int | None]:
        """(slots and their requests to run now, None) or ([], ns to wait or None)."""
        ready = [s for s in row if s.queue]
        if not ready:
            return [], None
        now = time.monotonic_ns()
        waited = now - min(s.queue[0].pending.enqueue_ns for s in ready)
        if self.oldest:
            ready.sort(key=lambda s: s.queue[0].pending.enqueue_ns)
            key = ready[0].queue[0].pending.shape_key()
            taken = [s for s in ready if s.queue[0].pending.shape_key() == key][:self.max_batch_size]
            full = len(taken) >= (self.preferred[-1] if self.preferred else self.max_batch_size)
            if self.delay_ns and not full and waited < self.delay_ns:
                if len(taken) not in self.preferred:
                    return [], self.delay_ns - waited
            elif self.preferred and not (self.delay_ns and waited >= self.delay_ns):
                fits = [p for p in self.preferred if p <= len(taken)]
                if fits:
                    taken = taken[:fits[-1]]
            return [(s, s.queue[0]) for s in taken], None
        if self.delay_ns and self.min_utilization and waited < self.delay_ns \
                and len(ready) / len(row) < self.min_utilization:
            return [], self.delay_ns - waited
        key = ready[0].queue[0].pending.shape_key()
        used = max(s.index for s in row if s.sequence_id is not None or s.queue)
        batch: list[tuple[_Slot, _Item | None]] = []
        for slot in row[:used + 1]:
            item = slot.queue[0] if slot.queue else None
            if item is not None and item.pending.shape_key() != key:
                item = None     # another shape waits for a batch of its own kind
            batch.append((slot, item))
        return batch, None

    def _dispatch(self, i: int, batch: list[tuple[_Slot, _Item | None]]) -> None:
        loop = asyncio.get_running_loop()
        template = next(item.pending for _, item in batch if item is not None)
        runs: list[Pending] = []
        nulls = 0
        for slot, item in batch:
            if item is None:
                runs.append(self._null(template, loop))
                nulls += 1
                continue
            slot.queue.popleft()
            slot.running = True
            pending = item.pending
            if item.start or slot.state is None:
                slot.state = dict(self.states.initial)
            inputs = dict(pending.inputs)
            self.controls.fill(inputs, start=item.start, end=item.end, ready=True,
                               sequence_id=item.sequence_id)
            inputs.update(slot.state)
            inner = loop.create_future()
            inner.add_done_callback(lambda f, s=slot, p=pending: self._answer(f, s, p))
            request = pending.request
            if self.states.outputs and request.outputs is not None:
                # the model must return its state outputs too; the client's choice of
                # outputs is applied to the answer, from the outer request
                request = dataclasses.replace(request, outputs=None)
            runs.append(dataclasses.replace(pending, request=request, inputs=inputs, future=inner))
            pending.started = True      # the engine's pending count ends with the inner one's
        # the pool counts every request it starts out of the pending gauge; null requests
        # never entered it
        self.stats.pending += nulls
        self._busy[i] = True
        done = self.pool.launch(self.instances[i], runs)
        self._inflight.add(done)
        done.add_done_callback(lambda f, i=i, batch=batch: self._finished(f, i, batch))

    def _null(self, template: Pending, loop: asyncio.AbstractEventLoop) -> Pending:
        """Triton's null request for an idle slot: the template's shapes, zeros, READY false."""
        inputs = {name: (np.full(value.shape, b"", dtype=object) if value.dtype == np.object_
                         else np.zeros_like(value)) for name, value in template.inputs.items()}
        self.controls.fill(inputs, start=False, end=False, ready=False, sequence_id=0)
        # a dummy state, as Triton: never the slot's own (a variable-dim state of the
        # sequence could not batch with the others' shapes)
        inputs.update(self.states.initial)
        return Pending(InferRequest(self.model), inputs, 0, loop.create_future())

    def _answer(self, inner: asyncio.Future, slot: _Slot, outer: Pending) -> None:
        """The model answered one request of ``slot``'s sequence: keep its state outputs,
        hand the rest to the client."""
        if outer.future.done():
            if not inner.cancelled() and inner.exception() is None:
                self._keep_state(slot, inner.result())
            return
        if inner.cancelled():
            outer.future.cancel()
        elif inner.exception() is not None:
            outer.future.set_exception(inner.exception())
        else:
            outer.future.set_result(self._keep_state(slot, inner.result()))

    def _keep_state(self, slot: _Slot, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.states.outputs:
            return outputs
        outputs = dict(outputs)
        state = dict(slot.state or self.states.initial)
        for out_name, in_name in self.states.outputs.items():
            value = outputs.get(out_name) if out_name in self.states.listed else \
                outputs.pop(out_name, None)
            if value is not None:
                state[in_name] = np.asarray(value)
        slot.state = state
        return outputs

    def _finished(self, done: asyncio.Future, i: int,
                  batch: list[tuple[_Slot, _Item | None]]) -> None:
        self._inflight.discard(done)
        self._busy[i] = False
        for slot, item in batch:
            if item is not None:
                slot.running = False
                slot.last_ns = time.monotonic_ns()
        if not done.cancelled() and done.exception() is not None:
            log.error("model '%s': sequence batch failed", self.model, exc_info=done.exception())
            for _, item in batch:
                if item is not None and not item.pending.future.done():
                    item.pending.future.set_exception(mark_failure(Internal(
                        f"model '{self.model}': batch execution failed: {done.exception()}"),
                        "BACKEND"))
        self._release_done_slots()
        if not self._closed:
            self._pump()

    # -- stopping ----------------------------------------------------------------------

    def _fail_queued(self, err: Exception, reason: str) -> None:
        queues = [s.queue for row in self.slots for s in row] + [b.queue for b in self._backlogs]
        for queue in queues:
            while queue:
                item = queue.popleft()
                if not item.pending.future.done():
                    item.pending.future.set_exception(mark_failure(type(err)(str(err)), reason))

    def queued_count(self) -> int:
        return self._queued

    def unloading(self) -> None:
        """The version is unloading: requests waiting for a slot fail now (the sequences
        holding the slots may never end); those already in a slot still run."""
        backlogs, self._backlogs = self._backlogs, deque()
        self._backlog.clear()
        for backlog in backlogs:
            for item in backlog.queue:
                if not item.pending.future.done():
                    item.pending.future.set_exception(mark_failure(Unavailable(
                        f"model '{self.model}' was unloaded before sequence "
                        f"{item.sequence_id} got a sequence slot"), "REJECTED"))

    async def close(self) -> None:
        """Refuse new requests, fail the queued ones (slots and backlog) with Unavailable,
        and wait for the batches already running."""
        self._closed = True
        for handle in (self._wake, self._reaper):
            if handle is not None:
                handle.cancel()
        self._wake = self._reaper = None
        self._fail_queued(Unavailable(
            f"model '{self.model}' was unloaded before the request could be scheduled"), "REJECTED")
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
