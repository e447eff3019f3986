"""``jupyter_triton.simulate``: the notebook's entry to capacity planning. It checks the
grid and the loads, measures the served model (``sweep``: on a temporary copy when the grid's
max_batch_size exceeds the served one) unless given a service model, and returns the
``CapacityPlan`` of every config at every load (``capacity``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from typing import Any, Iterator, Sequence

from ..protocol.errors import InvalidArgument, TritonError
from ..kernel.client import TritonHTTP
from ..kernel.discovery import Connection
from ..kernel.tune import temporary
from . import traffic as tr
from .capacity import REPLICAS, CapacityPlan, Load
from .service import ServiceModel
from .sweep import measure

TEMP_SUFFIX = "__sim"


def _grid(values: Sequence[int] | int | None, default: int, what: str) -> list[int]:
    if values is None:
        return [default]
    out = [int(values)] if isinstance(values, (int, float)) else [int(v) for v in values]
    if not out or min(out) < 0:
        raise InvalidArgument(f"simulate: {what} needs values >= 0")
    return out


def simulate(model: Any, qps: Sequence[float] | float | None = None,
             max_batch_size: Sequence[int] | int | None = None,
             max_queue_delay_us: Sequence[int] | int | None = None,
             instances: Sequence[int] | int | None = None, *,
             concurrency: Sequence[int] | int | None = None,
             traffic: dict[str, list] | None = None, classes: Sequence[tr.TrafficClass] = (),
             bulk: tr.TrafficClass | None = None, slo_p99_ms: float | None = None,
             service: ServiceModel | None = None, requests: int = tr.DEFAULT_REQUESTS,
             seed: int = 0, overhead_us: float | None = None, loop_us: float | None = None,
             measured: Any = None, repeats: int = 15, stalls: bool = True, replicas: int = REPLICAS,
             files: dict[str, bytes] | None = None, connection: Connection | None = None,
             progress: bool = True, lengths: Sequence[Any] | None = None, tokenizer: Any = None,
             length_buckets: Sequence[Sequence[int]] | None = None,
             max_batch_tokens: Sequence[int] | int | None = None,
             length_grid: tuple[Sequence[int], Sequence[int]] | None = None,
             burst_s: float | None = None) -> Any:
    """Simulate every config of the grid at every load; see ``capacity``'s docstring.

    ``model``: a served model's name or handle. Its execution times are measured once per
    model version and config (``service`` to pass your own); a grid whose max_batch_size
    exceeds the served one is measured on a temporary copy (``<model>__sim``) when this
    kernel served the model (or ``files`` are given), else extrapolated. ``classes``: more
    traffic on top of every load; ``bulk``: the class ``bulk_effect`` weighs; ``measured``:
    a ``tune()`` result, shown beside the same configs simulated (``compare``).

    ``overhead_us``: what your client sees at c=1 beyond one execution (default: what the
    sweep's client saw; ``calibrate_overhead`` measures it for another load generator); of
    it, ``loop_us`` (default: the server's event-loop CPU per request, measured by the
    sweep's bursts; its part per batch, run beside the batch's execution, is the service
    model's ``loop_batch_ns``) is work requests take in turn on the server's one event loop,
    which spreads a batch's answers and bounds throughput, and the instance's hand-off per
    batch is occupation of the instance; the rest is a delay requests spend side by side.
    ``stalls``: the event loop stalls as often and as long as ``measure``'s bursts saw this
    machine stall the server (some a second, some a request: a lighter load meets fewer; the
    default: the tail a shared machine gives); False plans for a host of the server's own,
    where no neighbour takes its cores. ``replicas``: independent simulations a row pools,
    ``requests`` shared between them (a row marked metastable where they disagree).
    ``progress``: a bar (a notebook) or text lines (elsewhere) through the measurement and the
    simulations.

    ``lengths`` (a list of texts or token counts; texts counted by ``tokenizer`` if given, else
    split on whitespace): plan padding batching for a ``[batch, length]`` model instead
    (``planning.lengths``): its execution is measured per (batch size, length) on
    ``length_grid`` (batch sizes, lengths; default from the distribution), and every
    ``length_buckets`` x ``max_batch_tokens`` x ``max_queue_delay_us`` (default: from the
    distribution) is simulated at each load; a ``LengthPlan`` recommends one for ``slo_p99_ms``.
    ``burst_s``: the seconds of each of ``measure``'s two bursts (0: none; default its own).
    """
    from ..kernel import api
    name = model if isinstance(model, str) else model.name
    conn = connection or api.connection()
    client = TritonHTTP(conn)
    base = client.config(name)
    base_mbs = int(base.get("max_batch_size", 0) or 0)
    if base_mbs < 1:
        raise InvalidArgument(f"simulate '{name}': the model does not batch (max_batch_size 0)")
    if lengths is not None:
        return _by_length(client, conn, name, base, lengths, tokenizer, qps, concurrency,
                          max_queue_delay_us, length_buckets, max_batch_tokens, length_grid,
                          service, burst_s, files, repeats=repeats, requests=requests, seed=seed, stalls=stalls,
                          slo_p99_ms=slo_p99_ms, progress=progress)
    sizes = _grid(max_batch_size, base_mbs, "max_batch_size")
    delays = _grid(max_queue_delay_us, int((base.get("dynamic_batching") or {})
                                           .get("max_queue_delay_microseconds", 0) or 0),
                   "max_queue_delay_us")
    groups = base.get("instance_group") or [{}]
    counts = _grid(instances, int(groups[0].get("count", 1) or 1), "instances")
    if min(sizes) < 1 or min(counts) < 1 or max(counts) > 64:
        raise InvalidArgument("simulate: max_batch_size >= 1 and instances in [1, 64]")
    if not 1 <= requests <= 100_000:
        raise InvalidArgument("simulate: requests must be in [1, 100000]")
    if replicas < 1:
        raise InvalidArgument("simulate: replicas must be 1 or more")
    loads = [Load("qps", float(q)) for q in ([qps] if isinstance(qps, (int, float)) else qps or [])]
    loads += [Load("concurrency", float(c)) for c in
              ([concurrency] if isinstance(concurrency, int) else concurrency or [])]
    loads += [Load("traffic", 0.0, label) for label in (traffic or {})]
    if not loads:
        raise InvalidArgument("simulate: give qps=, concurrency= or traffic=")
    if any(l.value <= 0 for l in loads if l.kind != "traffic") or \
            any(l.value > 1024 for l in loads if l.kind == "concurrency"):
        raise InvalidArgument("simulate: qps must be > 0 and concurrency in [1, 1024]")
    if files is None and name in api.uploaded:
        files = dict(api.uploaded[name].files)
    if service is None:
        bursts = {} if burst_s is None else {"burst_s": burst_s}
        service = _measure(client, conn, name, base, max(sizes), files, repeats, progress=progress, **bursts)
    return CapacityPlan(name, base, service, loads, [(m, d, n) for m in sizes for d in delays for n in counts],
                        extra=classes, traffic=traffic, slo_p99_ms=slo_p99_ms, requests=requests,
                        seed=seed, overhead_ns=None if overhead_us is None else
                        parallel_ns(service, overhead_us, loop_us),
                        bulk=bulk, files=files, connection=conn,
                        loop_ns=None if loop_us is None else int(loop_us * 1000), stalls=stalls,
                        measured=measured, replicas=replicas, progress=progress)


def parallel_ns(service: ServiceModel, overhead_us: float, loop_us: float | None = None) -> int:
    """The part of a client's c=1 overhead (``overhead_us``) spent side by side: less the
    event loop's turn (``loop_us``, default the service model's) and the instance's hand-off."""
    loop_ns = service.loop_ns if loop_us is None else int(loop_us * 1000)
    return max(0, int(overhead_us * 1000) - loop_ns - service.handoff_ns)


def _measure(client: TritonHTTP, conn: Connection, name: str, base: dict, largest: int,
             files: dict[str, bytes] | None, repeats: int, server_pid: int | None = None,
             **keywords: Any) -> ServiceModel:
    """The served model's sweep; past its max_batch_size, a temporary copy's (``keywords``:
    ``measure``'s)."""
    mbs = int(base["max_batch_size"])
    if largest <= mbs or files is None:
        return measure(conn, name, repeats=repeats, server_pid=server_pid, **keywords)
    with _copy(client, name, base, files, largest) as temp:
        temp_service = measure(conn, temp, repeats=repeats, server_pid=server_pid, **keywords)
    version = str(max(int(v) for v in client.metadata(name)["versions"]))
    return dataclasses.replace(temp_service, model=name, version=version,
                               method=temp_service.method + f", on a copy with max_batch_size {largest}")


@contextlib.contextmanager
def _copy(client: TritonHTTP, name: str, base: dict, files: dict[str, bytes],
          max_batch_size: int) -> Iterator[str]:
    """A temporary copy of the model (``<model>__sim``) with this max_batch_size and no queue
    delay (the sweep's bursts read a batch's cycle as its execution and hand-off: a delay
    would count as hand-off), unloaded after."""
    temp = name + TEMP_SUFFIX
    config = copy.deepcopy(base)
    config.update(name=temp, max_batch_size=max_batch_size)
    batching = dict(config.get("dynamic_batching") or {})
    batching["max_queue_delay_microseconds"] = 0
    batching.pop("preferred_batch_size", None)
    config["dynamic_batching"] = batching
    try:
        client.load(temp, json.dumps(temporary(config, temp)), files)
        yield temp
    finally:
        try:
            client.unload(temp)
        except TritonError:
            pass          # the failure that brought us here is the one to report


def _by_length(client: TritonHTTP, conn: Connection, name: str, base: dict, lengths: Sequence[Any],
               tokenizer: Any, qps: Any, concurrency: Any, delays: Any, buckets: Any, budgets: Any,
               grid: Any, service: Any, burst_s: float | None, files: dict[str, bytes] | None, *,
               repeats: int, progress: bool, **options: Any) -> Any:
    """``simulate(..., lengths=...)``: the lengths counted, the model measured by length (or
    ``service``, a ``LengthService``; on a copy without queue delay where the served model has
    one and its files are known), every candidate simulated (``lengths.plan_by_length``)."""
    from ..kernel import api
    from .length_service import LengthService, measure_lengths
    from .lengths import measure_grid, plan_by_length, token_counts
    counts = token_counts(lengths, tokenizer)
    loads = [Load("qps", float(q)) for q in ([qps] if isinstance(qps, (int, float)) else qps or [])]
    loads += [Load("concurrency", float(c)) for c in
              ([concurrency] if isinstance(concurrency, int) else concurrency or [])]
    if not loads or any(l.value <= 0 for l in loads) or \
            any(l.value > 1024 for l in loads if l.kind == "concurrency"):
        raise InvalidArgument("simulate: by length, give qps= (> 0) or concurrency= (1 to 1024)")
    if not 1 <= options["requests"] <= 100_000:
        raise InvalidArgument("simulate: requests must be in [1, 100000]")
    if service is not None and not isinstance(service, LengthService):
        raise InvalidArgument("simulate: by length, service= is a LengthService (measure_lengths)")
    if service is None:
        batches, sizes = grid if grid is not None else measure_grid(counts, int(base["max_batch_size"]))
        bursts = {} if burst_s is None else {"burst_s": burst_s}
        if files is None and name in api.uploaded:
            files = dict(api.uploaded[name].files)
        delay = int((base.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)
        with contextlib.ExitStack() as stack:
            measured = name
            if delay and files is not None:
                measured = stack.enter_context(_copy(client, name, base, files, int(base["max_batch_size"])))
            outside = measure(conn, measured, sizes=[1], repeats=repeats, progress=progress, **bursts)
            service = measure_lengths(conn, measured, list(batches), list(sizes), outside,
                                      repeats=max(1, repeats // 3), progress=progress)
        if measured != name:        # (the sweep keeps its figures: a copy of them is renamed)
            service.model = name
            service.base = dataclasses.replace(outside, model=name,
                                               method=outside.method + ", on a copy without queue delay")
    return plan_by_length(name, base, service, counts, loads, buckets=buckets,
                          budgets=[budgets] if isinstance(budgets, int) else budgets,
                          delays=[delays] if isinstance(delays, int) else delays,
                          progress=progress, **options)
