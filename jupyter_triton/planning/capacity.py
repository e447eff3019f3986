"""The capacity plan behind ``jupyter_triton.simulate`` (``api``): what a batching config does
under traffic the user does not have yet, answered in seconds by the engine's own dynamic
batcher on a virtual clock (``engine.simulation``) fed with the model's measured execution
times (``service``).

For every ``max_batch_size`` x ``max_queue_delay_us`` x ``instances`` of the grid and every
load (open-loop Poisson ``qps``, closed-loop ``concurrency``, or named ``traffic``), a few
seeded simulations (``replicas``, the requests shared between them) pooled into a row of
p50/p95/p99, throughput and mean batch. The same (config, load) always gives the same row,
and every answer (``best``, ``instances_for``, ``bulk_effect``) is computed from such rows, so
answers and table agree. Some configs have two states that each last, and chance decides
which one a run stays in (closed loop at c=4 with a delay shorter than an execution: four
clients in one batch, or two groups whose requests each arrive while the other's batch runs
and leave alone when it ends); a row whose replicas disagree on its mean batch or throughput
says so (``metastable``) and gives their range in its table, plot and answers: a
measurement there may show either state, or a mix.

Latency here is what a client sees. What the service model measured (``service``) drives
every stage: each batch occupies its instance for a drawn execution plus the measured
hand-off; each request takes the server's event loop in turn for ``loop_ns`` (its measured
CPU per request) and each batch for ``loop_batch_ns`` beside its execution, and spends
``overhead_ns`` side by side with the others (the rest of the c=1 overhead: client, sockets,
wake-ups), drawn per request with the spread of the body of the one-client burst's round trips
(``jitter``); their far tail is drawn as holds on the clients' side, which hold every answer due
meanwhile (a group of clients answered together comes back late together: how closed-loop
clients split by a short delay regroup; ``ServiceModel.holds``), more of them under load;
closed-loop clients start spread over one c=1 round trip (a row's first replica: all at once);
the loop stalls as the machine stalled the server in ``measure``'s bursts (some a second, some
a request). A row's figures and what they say: ``rows``; how the plan looks: ``render``.
"""
from __future__ import annotations

import copy
import dataclasses
import html
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config.formats import config_from_json
from ..engine.batching import simulation as sim
from ..progress import progress as show_progress
from ..protocol.errors import InvalidArgument, Unavailable
from ..kernel.client import TritonHTTP
from ..kernel.discovery import Connection
from . import render, traffic as tr
from .render import COLUMNS, Comparison, knobs_text
from .rows import (REPLICA_FIGURES, describe_range, metastable, noise_note, pool_replicas, summarize,
                   within_noise)
from .service import ServiceModel
from ..kernel.tune import png_bytes

#: an open-loop load is kept up with when this share of it is served (the rest: queue growth)
KEPT_UP = 0.95
#: whether engine.simulation models the server's event loop as a stage requests take in turn
LOOP_MODELLED = "loop_ns" in inspect.signature(sim.simulate).parameters
#: independent simulations a row pools, the requests shared between them. A config can have two
#: states that each last (closed loop at c=4 with a delay shorter than an execution: the four
#: clients in one batch, or in two groups, each arriving while the other's batch runs), and
#: which one a run stays in, and how long, is chance: one run would show one of them as if it
#: were the answer, replicas that disagree show that it is not
REPLICAS = 3


@dataclass(frozen=True)
class Load:
    """One load: ``kind`` "qps" (open loop), "concurrency" (closed loop) or "traffic" (named)."""
    kind: str
    value: float
    label: str = ""

    def __str__(self) -> str:
        if self.kind == "qps":
            return f"{self.value:g} qps"
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        return self.label


@dataclass
class Answer:
    """One answer with the row it rests on and why."""
    config: dict | None
    row: dict | None
    why: str
    rows: list[dict] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return f"Answer({self.config}): {self.why}"

    def _repr_html_(self) -> str:
        knobs = html.escape(knobs_text(self.config)) if self.config else "none"
        return f"<p><b>{knobs}</b>: {html.escape(self.why)}</p>"


class CapacityPlan:
    """The simulated grid: ``results`` (one dict per config and load), the answers
    (``best``, ``instances_for``, ``bulk_effect``), a table and plots (``_repr_html_``),
    ``apply``. ``run`` simulates one more (config, load) on the same service model."""

    def __init__(self, model: str, base_config: dict, service: ServiceModel, loads: list[Load],
                 grid: list[tuple[int, int, int]], *, extra: Sequence[tr.TrafficClass] = (),
                 traffic: dict[str, list] | None = None, slo_p99_ms: float | None = None,
                 requests: int = tr.DEFAULT_REQUESTS, seed: int = 0, overhead_ns: int | None = None,
                 bulk: tr.TrafficClass | None = None, files: dict[str, bytes] | None = None,
                 connection: Connection | None = None, loop_ns: int | None = None, jitter: bool = True,
                 stalls: bool = True, measured: Any = None, replicas: int = REPLICAS,
                 progress: bool = False) -> None:
        self.model = model
        self.service = service
        self.loads = loads
        self.grid = grid
        self.extra = list(extra)
        self.traffic = dict(traffic or {})
        self.slo_p99_ms = slo_p99_ms
        self.requests = requests
        self.seed = seed
        if replicas < 1:
            raise InvalidArgument("simulate: replicas must be 1 or more")
        self.replicas = replicas          # simulations a row pools (``run``)
        # overhead_ns: the parallel delay alone (the c=1 overhead less the stages modelled)
        self.overhead_ns = service.parallel_ns if overhead_ns is None else int(overhead_ns)
        self.loop_ns = service.loop_ns if loop_ns is None else int(loop_ns)
        self.jitter = jitter              # False: no drawn delays nor stalls, fixed figures only
        self.stalls = stalls              # False: the machine's stalls left out (a dedicated host)
        self.measured = measured          # a TuneResult (or its results): shown side by side
        if self.loop_ns and not LOOP_MODELLED:
            raise InvalidArgument("simulate: this engine's simulation has no loop_ns (the server's "
                                  "event-loop work per request); leave loop_us unset")
        self.bulk = bulk
        self._base = base_config
        self._files = files
        self._connection = connection
        self._memo: dict[tuple, dict] = {}
        started = time.perf_counter()
        runs = [(mbs, delay, inst, load) for mbs, delay, inst in grid for load in loads]
        self.results = []
        with show_progress(len(runs), f"simulate {model}", progress) as bar:
            for mbs, delay, inst, load in runs:
                bar.update(len(self.results), f"b{mbs} d{delay}us x{inst}: {load}")
                self.results.append(self.run(mbs, delay, inst, load))
        self.seconds = time.perf_counter() - started

    # ---- simulating ----------------------------------------------------------------------
    def config(self, max_batch_size: int, max_queue_delay_us: int, instances: int,
               priority_levels: int = 0) -> dict:
        """The model's config (JSON, as the server returned it) with these knobs."""
        config = copy.deepcopy(self._base)
        config["max_batch_size"] = int(max_batch_size)
        batching = dict(config.get("dynamic_batching") or {})
        batching["max_queue_delay_microseconds"] = int(max_queue_delay_us)
        preferred = [int(p) for p in batching.get("preferred_batch_size", [])]
        if preferred == [int(self._base.get("max_batch_size", 0) or 0)]:
            # what the server's auto-complete writes ([max_batch_size]): no preference of the
            # user's, so it follows the new max_batch_size instead of capping its batches
            preferred = []
        preferred = [p for p in preferred if p <= max_batch_size]
        if preferred:
            batching["preferred_batch_size"] = preferred
        else:
            batching.pop("preferred_batch_size", None)
        if priority_levels > int(batching.get("priority_levels", 0) or 0):
            batching["priority_levels"] = priority_levels
            batching["default_priority_level"] = priority_levels   # unnamed requests go last
        config["dynamic_batching"] = batching
        groups = config.get("instance_group") or [{}]
        config["instance_group"] = [{**{k: v for k, v in groups[0].items() if k != "count"},
                                     "count": int(instances)}]
        return config

    def _traffic(self, load: Load, extra: Sequence[tr.TrafficClass], seed: int, requests: int) -> list:
        if load.kind == "traffic":
            main = list(self.traffic[load.label])
        elif load.kind == "qps":
            main = [tr.TrafficClass("", qps=load.value)]
        else:
            main = [tr.TrafficClass("", concurrency=int(load.value))]
        if load.kind == "traffic":
            span = max((a.t_ns for a in main if isinstance(a, sim.Arrival)), default=0) / 1e9
            others = [a for i, c in enumerate(extra)
                      for a in c.traffic(seed + 1 + i, requests, span or None)]
            arrivals = sorted((a for a in main + others if isinstance(a, sim.Arrival)),
                              key=lambda a: a.t_ns)
            return arrivals + [a for a in main + others if not isinstance(a, sim.Arrival)]
        return tr.mix(main + list(extra), seed, requests)

    def _replicas(self, load: Load, extra: Sequence[tr.TrafficClass]) -> list[tuple[int, list]]:
        """(seed, traffic) of each replica: the requests (and a class's own count) shared
        between them, so that a row costs what one simulation of them all would. Named traffic
        is one replica: its arrivals are the one realisation given."""
        if load.kind == "traffic" or self.replicas == 1:
            return [(self.seed, self._traffic(load, extra, self.seed, self.requests))]
        count = min(self.replicas, self.requests)
        out = []
        for i in range(count):
            share = self.requests // count + (i < self.requests % count)
            own = [dataclasses.replace(c, requests=max(1, round(c.requests / count))) if c.requests else c
                   for c in extra]
            seed = self.seed * self.replicas + i
            out.append((seed, self._traffic(load, own, seed, share)))
        return out

    def run(self, max_batch_size: int, max_queue_delay_us: int, instances: int, load: Load,
            extra: Sequence[tr.TrafficClass] | None = None) -> dict:
        """One row (memoized: the same arguments give the same row): ``replicas`` seeded
        simulations pooled, each one's figures in ``row["replicas"]``, and
        ``row["metastable"]`` where they disagree (``metastable``)."""
        extra = self.extra if extra is None else list(extra)
        key = (max_batch_size, max_queue_delay_us, instances, load, tuple(extra))
        if key in self._memo:
            return self._memo[key]
        replicas = self._replicas(load, extra)
        levels = max([getattr(a, "priority", 0) for _, traffic in replicas for a in traffic] + [0])
        config = config_from_json(self.config(max_batch_size, max_queue_delay_us, instances, levels),
                                  self._base.get("name", self.model))
        service = self.service
        loop = {"loop_ns": self.loop_ns} if self.loop_ns else {}
        if self.loop_ns and service.loop_batch_ns:
            loop["loop_batch_ns"] = service.loop_batch_ns
        # Closed-loop clients start spread over one c=1 round trip, the first replica's all at
        # once: a closed loop may keep to the state its start gave it (at c=4 with a delay
        # shorter than an execution, one merged batch or two groups), and clients do start
        # together at times (perf_analyzer's first sends: benchmarks/results/planning-notes.md), so
        # the replicas show both and the row is metastable where both last.
        stagger = self.overhead_ns + self.loop_ns + int(service.median_ns(1)) + service.handoff_ns
        staggers = [0 if i == 0 and len(replicas) > 1 else stagger for i in range(len(replicas))]
        stalled = self.jitter and self.stalls and bool(service.stall_ns)
        hold_ns = service.holds()[0] if self.jitter else []

        def run(chance: float, hold_rate: float) -> list[sim.SimResult]:
            return [sim.simulate(config, service, traffic, seed=seed, overhead_ns=self.overhead_ns,
                                 jitter_ns=service.jitter_ns() if self.jitter else (), stagger_ns=staggers[i],
                                 stall_ns=service.stall_ns if stalled else (), stall_rate=service.stall_rate,
                                 stall_chance=chance, hold_ns=hold_ns, hold_rate=hold_rate, **loop)
                    for i, (seed, traffic) in enumerate(replicas)]
        # Both depend on the load, known once it is served: simulated once at one client's
        # holds, then again where the served rate calls for others.
        # Stalls: some a second whatever the load, some a request (``measure`` splits them).
        # Those a request were seen to grow up to the saturating burst's request rate, which
        # saturated the cores; a load served faster (larger batches: less CPU a request) is
        # not extrapolated past it: there they are as many a second as in the burst.
        # Holds: one client's as often a second, the burst's load's ``hold_scale`` times as
        # often (``ServiceModel.hold_load``).
        first = (service.stall_chance, service.holds()[1] if hold_ns else 0.0)
        results = run(*first)
        if (stalled and service.stall_chance and service.burst_qps) or (hold_ns and service.hold_scale != 1):
            pooled = pool_replicas(results)
            served = sum(o.status == "ok" for o in pooled.requests) / (pooled.duration_ns / 1e9 or 1e-9)
            chance, hold_rate = first
            if stalled and service.stall_chance and served > service.burst_qps > 0:
                chance = service.stall_chance * service.burst_qps / served
            if hold_ns:
                hold_rate = service.holds(served)[1]
            if (chance, hold_rate) != first:
                results = run(chance, hold_rate)
        row = {"max_batch_size": max_batch_size, "max_queue_delay_us": max_queue_delay_us,
               "instances": instances, "load": str(load), "kind": load.kind, "offered": load.value,
               **summarize(pool_replicas(results))}
        row["replicas"] = [{k: figures[k] for k in REPLICA_FIGURES} for figures in map(summarize, results)]
        row["metastable"] = metastable(row)
        self._memo[key] = row
        return row

    # ---- answers -------------------------------------------------------------------------
    @staticmethod
    def kept_up(row: dict) -> bool:
        """No request refused or timed out, and (open loop) the offered rate served."""
        if row["rejected"] or row["timeouts"]:
            return False
        return row["kind"] != "qps" or row["throughput"] >= KEPT_UP * row["offered"]

    def best(self, slo_p99_ms: float | None = None) -> Answer:
        """The config whose p99 meets the SLO at the highest load of the table (open loop:
        offered QPS; closed loop: throughput); ties go to fewer instances, then lower p99."""
        slo = self.slo_p99_ms if slo_p99_ms is None else slo_p99_ms
        limit = float("inf") if slo is None else float(slo)
        ok = [r for r in self.results if self.kept_up(r) and r["p99_ms"] <= limit]
        if not ok:
            low = min(self.results, key=lambda r: r["p99_ms"])
            return Answer(None, None, f"no config meets a p99 of {limit:g} ms at any load; the "
                          f"lowest p99 is {low['p99_ms']:.2f} ms ({knobs_text(_config_of(low))}, "
                          f"{low['load']})")

        def rank(r: dict) -> tuple:
            load = r["offered"] if r["kind"] == "qps" else r["throughput"]
            return (load, -r["instances"], -r["p99_ms"])
        row = max(ok, key=rank)
        why = (f"meets p99 <= {limit:g} ms up to {row['load']}: p99 {row['p99_ms']:.2f} ms, "
               f"{row['throughput']:.0f} infer/s, mean batch {row['mean_batch']:.1f}"
               if slo is not None else
               f"the most throughput: {row['throughput']:.0f} infer/s at {row['load']}, "
               f"p99 {row['p99_ms']:.2f} ms")
        if row["metastable"]:
            why += f" ({describe_range(row)})"
        close = [r for r in ok if r is not row and r["load"] == row["load"] and within_noise(row, r)]
        if close:
            why += "; " + noise_note(row, close[0]) + \
                (f" (and {len(close) - 1} more config(s) as close)" if len(close) > 1 else "")
        return Answer(_config_of(row), row, why)

    def instances_for(self, qps: float, slo_p99_ms: float | None = None,
                      config: dict | None = None, max_instances: int = 16) -> Answer:
        """The fewest instances with which ``config`` (default: the best config's batching)
        serves ``qps`` open loop within the SLO (and without refusals)."""
        slo = self.slo_p99_ms if slo_p99_ms is None else slo_p99_ms
        limit = float("inf") if slo is None else float(slo)
        if config is None:
            chosen = self.best(slo).config or _config_of(max(self.results, key=lambda r: r["throughput"]))
        else:
            chosen = config
        mbs, delay = int(chosen["max_batch_size"]), int(chosen["max_queue_delay_us"])
        tried = []
        for n in range(1, max_instances + 1):
            row = self.run(mbs, delay, n, Load("qps", float(qps)))
            tried.append(row)
            if self.kept_up(row) and row["p99_ms"] <= limit:
                return Answer({"max_batch_size": mbs, "max_queue_delay_us": delay, "instances": n},
                              row, f"{n} instance(s) serve {qps:g} qps with p99 "
                              f"{row['p99_ms']:.2f} ms" + (f" (SLO {limit:g} ms)" if slo else ""),
                              tried)
        last = tried[-1]
        return Answer(None, last, f"{max_instances} instances do not serve {qps:g} qps within "
                      f"{limit:g} ms: {last['throughput']:.0f} infer/s, p99 {last['p99_ms']:.2f} ms",
                      tried)

    def bulk_effect(self, bulk: tr.TrafficClass | None = None, qps: float | None = None,
                    config: dict | None = None) -> "BulkEffect":
        """The interactive class's latency alone, with ``bulk`` in the same batch window at
        the same priority, with ``bulk`` at a lower priority level, and with ``bulk`` split
        onto a model of its own (``qps``: the interactive rate, default the table's highest;
        ``config``: default ``best()``'s)."""
        bulk = bulk or self.bulk
        if bulk is None:
            raise InvalidArgument("simulate: bulk_effect needs a bulk TrafficClass")
        qps = qps or max((l.value for l in self.loads if l.kind == "qps"), default=None)
        if qps is None:
            raise InvalidArgument("simulate: bulk_effect needs an interactive qps")
        chosen = config or self.best().config or _config_of(self.results[0])
        mbs, delay = int(chosen["max_batch_size"]), int(chosen["max_queue_delay_us"])
        inst = int(chosen.get("instances", self.results[0]["instances"]))
        load = Load("qps", float(qps))
        name = bulk.name or "bulk"
        same = tr.TrafficClass(name, qps=bulk.qps, concurrency=bulk.concurrency, rows=bulk.rows,
                               priority=0, timeout_us=bulk.timeout_us, burst=bulk.burst)
        low = tr.TrafficClass(name, qps=bulk.qps, concurrency=bulk.concurrency, rows=bulk.rows,
                              priority=2, timeout_us=bulk.timeout_us, burst=bulk.burst)
        # with priorities the interactive class must name level 1: it is its own class then
        interactive_first = tr.TrafficClass("interactive", qps=float(qps), priority=1)
        scenarios = [
            ("interactive alone", self.run(mbs, delay, inst, load, extra=[]), ""),
            (f"+ {name}, one batch window, same priority", self.run(mbs, delay, inst, load, extra=[same]), ""),
            (f"+ {name} at priority 2 (interactive 1)",
             self._with_priority(mbs, delay, inst, interactive_first, low), "interactive"),
        ]
        # "split models or instance groups": the bulk class on a copy of the model with one
        # instance of its own; the interactive class keeps this config's instances to itself
        # (the simulation shares no CPU between the two: give the copy its own hardware)
        alone = self.run(mbs, delay, inst, load, extra=[])
        alone_bulk = self._with_priority(mbs, delay, 1, None, same)
        split = {**alone, "classes": {"": alone, name: alone_bulk["classes"][name]}}
        scenarios.append((f"{name} split onto its own model (1 instance)", split, ""))
        return BulkEffect(name, {"max_batch_size": mbs, "max_queue_delay_us": delay, "instances": inst},
                          qps, scenarios)

    def _with_priority(self, mbs: int, delay: int, inst: int, first: tr.TrafficClass | None,
                       low: tr.TrafficClass) -> dict:
        """``first`` (None: no traffic) with ``low`` on top, as a named traffic load."""
        label = f"interactive {first.qps:g} qps at priority {first.priority}" if first else "nothing"
        if label not in self.traffic:
            self.traffic[label] = first.traffic(self.seed, self.requests) if first else []
        return self.run(mbs, delay, inst, Load("traffic", 0.0, label), extra=[low])

    # ---- measured beside simulated -----------------------------------------------------
    def compare(self, measured: Any) -> Comparison:
        """For each row ``tune()`` measured (a TuneResult or its ``results``), the same config
        simulated closed loop at the same concurrency, side by side, with the ratios; where the
        simulated row is metastable, its replicas' figures and their range in words. A list of
        dicts shown as a table (``Comparison``), noting configs within noise of each other."""
        rows = measured.results if hasattr(measured, "results") else measured
        inst = self.results[0]["instances"] if self.results else 1
        out, simulated = [], []
        for m in rows:
            if m.get("failures") or not m.get("throughput"):
                continue
            s = self.run(int(m["max_batch_size"]), int(m["max_queue_delay_us"]), inst,
                         Load("concurrency", float(m["concurrency"])))
            row = {"max_batch_size": m["max_batch_size"], "max_queue_delay_us": m["max_queue_delay_us"],
                   "concurrency": m["concurrency"]}
            for k in ("throughput", "p50_ms", "p99_ms", "mean_batch"):
                row[f"measured_{k}"] = float(m[k])
                row[f"simulated_{k}"] = float(s[k])
                row[f"error_{k}"] = (s[k] - float(m[k])) / float(m[k]) if float(m[k]) else float("nan")
            row["simulated_metastable"] = s["metastable"]
            row["simulated_replicas"] = s["replicas"]
            row["simulated_range"] = describe_range(s)
            out.append(row)
            simulated.append(s)
        notes = [noise_note(a, b) for i, a in enumerate(simulated) for b in simulated[i + 1:]
                 if a is not b and a["load"] == b["load"] and within_noise(a, b)]
        return Comparison(out, notes)

    # ---- showing (``render``) ------------------------------------------------------------
    def plot_png(self) -> bytes:
        """``plot_figure`` as a PNG."""
        return png_bytes(self.plot_figure())

    def plot_figure(self):
        """Left: p99 (solid) and p50 (dotted) against load, one colour and marker per config
        (the legend beside the plot), a metastable row's replicas' range as a cross
        (throughput across, closed loop; p99 up). Right: the batch sizes formed at the highest
        load, one step histogram per config. A matplotlib Figure on an Agg canvas."""
        return render.plan_figure(self)

    def table_html(self, rows: Sequence[dict] | None = None, columns: Sequence[str] = COLUMNS) -> str:
        return render.plan_table_html(self, rows, columns)

    def _repr_html_(self) -> str:
        return render.plan_html(self)

    def __repr__(self) -> str:
        return render.plan_text(self)

    # ---- acting --------------------------------------------------------------------------
    def apply(self, config: dict | Answer | None = None) -> Any:
        """Serve ``config`` (default: ``best()``'s) as a new version of the model, as
        ``tune().apply()`` does: loaded before the old version stops serving."""
        from ..kernel.handle import ServedModel
        chosen = config.config if isinstance(config, Answer) else (config or self.best().config)
        if chosen is None:
            raise Unavailable(f"simulate '{self.model}': no config to apply")
        if self._connection is None or self._files is None:
            raise InvalidArgument(f"simulate '{self.model}': apply needs the model's files "
                                  f"(serve it from this kernel, or pass files=)")
        inst = int(chosen.get("instances", self.results[0]["instances"] if self.results else 1))
        config = self.config(int(chosen["max_batch_size"]), int(chosen["max_queue_delay_us"]), inst)
        config["name"] = self.model
        client = TritonHTTP(self._connection)
        client.load(self.model, json.dumps(config), self._files)
        versions = client.metadata(self.model)["versions"]
        return ServedModel(self.model, max(int(v) for v in versions), self._connection,
                           notes=[f"simulated: {knobs_text(chosen)}"])


@dataclass
class BulkEffect:
    """The interactive class's latency in three scenarios; ``rows`` one per scenario."""
    bulk: str
    config: dict
    qps: float
    scenarios: list[tuple[str, dict, str]]

    @property
    def rows(self) -> list[dict]:
        out = []
        for name, row, cls in self.scenarios:
            inter = row["classes"][cls] if cls and "classes" in row else (
                row["classes"][""] if "classes" in row else row)
            bulk = row.get("classes", {}).get(self.bulk)
            out.append({"scenario": name, "interactive_p50_ms": inter["p50_ms"],
                        "interactive_p95_ms": inter["p95_ms"], "interactive_p99_ms": inter["p99_ms"],
                        "bulk_throughput": bulk["throughput"] if bulk else 0.0,
                        "bulk_p95_ms": bulk["p95_ms"] if bulk else float("nan"),
                        "mean_batch": row["mean_batch"]})
        return out

    def p95(self, scenario: int) -> float:
        return self.rows[scenario]["interactive_p95_ms"]

    def _repr_html_(self) -> str:
        return render.bulk_effect_html(self)

    def __repr__(self) -> str:
        return render.bulk_effect_text(self)


def _config_of(row: dict) -> dict:
    return {"max_batch_size": row["max_batch_size"], "max_queue_delay_us": row["max_queue_delay_us"],
            "instances": row["instances"]}
